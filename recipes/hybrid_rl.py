"""Hybrid RL on a tool-use math environment: outcome GRPO + process reward model + hindsight bridge-thought OPD.

    python -m recipes.hybrid_rl                                         # recipes/hybrid_rl.yaml (tiny model, CPU)
    python -m recipes.hybrid_rl --config recipes/hybrid_rl_grpo.yaml    # the GRPO baseline on the same task
    python -m recipes.hybrid_rl prm.scorer=http prm.endpoint=http://host:8000/v1 prm.api_model=judge
    python -m recipes.compare_hybrid                                    # both from one warm start, pass@k plot

1. the tiny model and the ``tool_math`` task (multi-digit sums/products; a sandboxed Python tool helps);
2. warm start: the task's multi-turn demonstrations replayed in the sandbox, trained with ``sft_step``; with
   ``hybrid.hinted_demos`` some also as [prompt + hint + correct solution], so the reference can use a hint;
3. per step:
   - rollout: ``rollout.n`` tool trajectories per prompt (``workers/math_env``): ``<python>`` calls run in
     the sandbox, errors / timeouts / empty output / malformed calls come back as observations;
   - reward: the ``\\boxed{}`` answer against the ground truth (reward worker);
   - PRM (``workers/prm``): m votes per step (``\\boxed{1}`` / ``\\boxed{-1}``), and for failed trajectories a
     bridge thought between ``<hint>`` markers (or "no intervention");
   - log-probs: old (actor); teacher = the reference given [prompt + hint + response]
     (``RefWorker.compute_teacher_log_prob``), aligned with the policy's response tokens;
   - advantage ``hybrid``: w_rl * (A_grpo + A_prm(step)) + w_opd * hint * (log pi_teacher - log pi_old) on the
     policy's own tokens (``algorithms/hybrid.py``); with ``algorithm.adv_estimator=grpo`` plain GRPO;
   - PPO clipped update (optional KL loss), weights to the rollout engine;
4. validation: pass@k on held-out problems (``eval.*``) before training (``trainer.val_before_train``), every
   ``trainer.test_freq`` steps and after the last.
"""

from __future__ import annotations

import time
from functools import partial

from dataproto import DataProto
from recipes.schemas import HybridConfig
from recipes.trainer import (
    PassAtK,
    Run,
    Session,
    check_env_errors,
    cli,
    compute_advantage,
    fill_mini_batches,
    log_probs,
    parse_args,
    print_summary,
    replayed,
    rollout_meta,
    score,
    start_run,
    timer,
    update_actor,
    warm_start,
)
from recipes.trainer.hybrid import (
    PRMRole,
    add_teacher_hints,
    hinted_demonstrations,
    hybrid_advantage,
    role_options,
)
from recipes.trainer.warm_start import SFTData

RECIPE = "hybrid_rl"


def hybrid_step(
    s: Session, batch: DataProto, metrics: dict, timings: dict, *, prm: PRMRole | None
) -> DataProto:
    """One step on a batch of prompts; returns the batch with every column the step computed."""
    cfg, roles = s.cfg, s.roles
    assert isinstance(cfg, HybridConfig)  # train's session
    hybrid = cfg.algorithm.adv_estimator == "hybrid"  # else the GRPO baseline
    # 1. rollout: rollout.n tool trajectories per prompt, code run in the sandbox; their outcome reward (the
    #    \boxed{} answer)
    with timer("gen", timings):
        batch = roles.generate(batch, rollout_meta(cfg, s.state.step))
    batch = score(roles, batch, timings)
    check_env_errors(batch, s.state.step)  # every trajectory failed (no sandbox, no engine): stop loudly
    batch = fill_mini_batches(cfg, batch, with_critic=False)  # step-wise turns / children vary the row count
    # 2. log-probs under the policy (before the update: the OPD term reads them) and the reference
    batch = log_probs(cfg, roles, batch, timings, old_log_probs_needed=hybrid)
    # 3. process reward model: step votes and bridge thoughts
    if prm is not None:
        with timer("prm", timings):
            batch = batch.union(prm.score(batch))
    # 4. the hint-conditioned teacher's log-probs of the policy's tokens (OPD)
    if hybrid:
        with timer("teacher", timings):
            add_teacher_hints(batch, cfg.hybrid.hint_template, cfg.hybrid.teacher_reads_hint)
            batch = batch.union(roles.reference().compute_teacher_log_prob(batch))
    # 5. advantages on the controller
    with timer("adv", timings):
        if hybrid:
            metrics |= hybrid_advantage(batch, cfg)
        else:
            metrics |= compute_advantage(batch, cfg.algorithm, s.kl_ctrl)
    # 6. PPO update, then the new weights to the rollout engine
    metrics |= update_actor(roles, batch, timings, sync_weights=True, version=s.state.step)
    return batch


def warm_start_data(cfg: HybridConfig) -> SFTData:
    """The demonstrations replayed in the sandbox, and ``hybrid.hinted_demos`` of them hint-conditioned."""
    return replayed(
        partial(hinted_demonstrations, frac=cfg.hybrid.hinted_demos, template=cfg.hybrid.hint_template),
        "demonstrations",
    )


def train(cfg: HybridConfig, run: Run, recipe: str = RECIPE) -> dict:
    validator = PassAtK(cfg.eval.pass_k, cfg.eval.temperature)
    # the hybrid estimator's PRM and OPD terms still teach where every group's outcome rewards are equal; the GRPO
    # baseline (hybrid_rl_grpo.yaml) has only the outcome reward
    outcome_only = cfg.algorithm.adv_estimator != "hybrid"
    session = Session(
        cfg, run, recipe, validator=validator, outcome_only=outcome_only, **role_options(cfg, run)
    )  # fmt: skip
    try:
        prm = PRMRole(cfg, run, session.roles) if cfg.prm.enable else None  # own pool, or the rollout group
    except BaseException:
        session.roles.shutdown()
        raise
    try:
        return session.train(partial(hybrid_step, prm=prm))  # per step; validation / checkpoint when due
    finally:
        if prm is not None:
            prm.close()


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = parse_args(RECIPE, argv)
    assert isinstance(cfg, HybridConfig)  # SCHEMAS[RECIPE]
    run = start_run(cfg, RECIPE)
    print(f"[{RECIPE}] run dir {run.dir}; model {run.model_path}; advantage {cfg.algorithm.adv_estimator}")
    run.model_path = warm_start(cfg, run, warm_start_data(cfg))
    result = train(cfg, run)
    vals = result["val_history"]
    k = max(cfg.eval.pass_k)
    print()
    if vals:
        first, last = vals[0][1], vals[-1][1]
        print(
            f"pass@1 {first['val/pass@1'] if 'val/pass@1' in first else float('nan'):.3f} -> "
            f"{last.get('val/pass@1', float('nan')):.3f}, pass@{k} {first[f'val/pass@{k}']:.3f} -> "
            f"{last[f'val/pass@{k}']:.3f}  ({int(last['val/num_problems'])} held-out problems, step "
            f"{vals[0][0]} -> {vals[-1][0]})"
        )
    return {**result, "wall_s": print_summary(result, t0), "model_path": run.model_path}


if __name__ == "__main__":
    cli(main)
