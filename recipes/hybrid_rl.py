"""Hybrid RL on a tool-use math environment: outcome GRPO + process reward model + hindsight bridge-thought OPD.

    python -m recipes.hybrid_rl                                         # recipes/hybrid_rl.yaml (tiny model, CPU)
    python -m recipes.hybrid_rl --config recipes/hybrid_rl_grpo.yaml    # the GRPO baseline on the same task
    python -m recipes.hybrid_rl prm.scorer=http prm.endpoint=http://host:8000/v1 prm.api_model=judge
    python -m recipes.compare_hybrid                                    # both from one warm start, pass@k plot

1. the tiny model and the ``tool_math`` task (multi-digit sums/products; a sandboxed Python tool helps);
2. warm start: the task's multi-turn demonstrations replayed in the sandbox, trained with ``sft_step``;
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
4. validation: pass@k on held-out problems (``eval.*``) before training and when due.
"""

from __future__ import annotations

import time

from recipes.hybrid_config import HybridConfig, check, register_schema
from recipes.trainer import (
    Run,
    Session,
    cli,
    compute_advantage,
    due,
    merge,
    metrics_of,
    parse_args,
    rollout_meta,
    start_run,
    timer,
)
from recipes.trainer.hybrid import (
    PRMRole,
    add_teacher_hints,
    hybrid_advantage,
    reference_batch,
    role_classes,
    tool_generate,
    tool_validate,
)
from recipes.trainer.warm_start import warm_start_on_replays

RECIPE = "hybrid_rl"


def warm_start(cfg: HybridConfig, run: Run) -> str:
    """SFT on the replayed demonstrations with an ActorWorker group; returns the exported HF directory."""
    return warm_start_on_replays(cfg, run, reference_batch, "demonstrations")


def train(cfg: HybridConfig, run: Run, recipe: str = RECIPE) -> dict:
    check(cfg)
    hybrid = cfg.algorithm.adv_estimator == "hybrid"
    session = Session(cfg, run, recipe, **role_classes(cfg))  # tool env in the actor-rollout / env workers
    roles = session.roles
    history_val, batch, val_data = [], None, session.val_data
    try:
        prm = PRMRole(cfg, run, roles) if cfg.prm.enable else None  # own pool, or the rollout group
    except BaseException:
        roles.shutdown()
        raise
    try:
        with session:  # weights -> rollout engine; on exit: export, plot, shutdown
            if cfg.eval.before_train and session.state.step == 0:
                history_val.append((0, tool_validate(roles, val_data, cfg)))
                session.tracker.log(history_val[-1][1], step=0)
            for batch in session.steps():
                metrics, timings = {}, {}
                step = session.state.step
                with timer("step", timings):
                    # 1. rollout: rollout.n tool trajectories per prompt, code run in the sandbox
                    with timer("gen", timings):
                        batch = tool_generate(roles, batch, rollout_meta(cfg, step))
                        metrics |= {k: v for k, v in metrics_of(batch).items() if k.startswith("tool/")}
                    # 2. outcome reward: the \boxed{} answer
                    with timer("reward", timings):
                        batch = merge(batch, roles.reward.compute_rm_score(batch), metrics)
                    # 3. process reward model: step votes and bridge thoughts
                    if prm is not None:
                        with timer("prm", timings):
                            batch = merge(batch, prm.score(batch), metrics)
                    # 4. log-probs: policy (old), reference (KL loss), hint-conditioned teacher (OPD)
                    with timer("old_log_prob", timings):
                        batch = merge(batch, roles.actor.compute_log_prob(batch))
                    if roles.ref is not None and (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
                        with timer("ref", timings):
                            batch = merge(batch, roles.ref.compute_ref_log_prob(batch))
                    if hybrid:
                        with timer("teacher", timings):
                            add_teacher_hints(batch, cfg.hybrid.hint_template)
                            batch = merge(batch, roles.ref.compute_teacher_log_prob(batch), metrics)
                    # 5. advantages on the controller
                    with timer("adv", timings):
                        if hybrid:
                            metrics |= hybrid_advantage(batch, cfg)
                        else:
                            metrics |= compute_advantage(batch, cfg.algorithm, session.kl_ctrl)
                    # 6. PPO update, then the new weights to the rollout engine
                    with timer("update_actor", timings):
                        merge(batch, roles.actor.update_actor(batch), metrics)
                    with timer("update_weights", timings):
                        metrics |= roles.sync_weights()
                if due(step, cfg.eval.freq, session.total) or step == session.total:
                    with timer("testing", timings):
                        val = tool_validate(roles, val_data, cfg)
                    history_val.append((step, val))
                    metrics |= val
                session.end_step(batch, metrics, timings)
    finally:
        if prm is not None:
            prm.close()
    result = session.result()
    result["val_history"] = history_val
    result["last_batch"] = batch
    return result


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    register_schema()
    cfg = parse_args(RECIPE, argv)
    check(cfg)
    run = start_run(cfg, RECIPE)
    print(f"[{RECIPE}] run dir {run.dir}; model {run.model_path}; advantage {cfg.algorithm.adv_estimator}")
    if cfg.sft.enable:
        run.model_path = warm_start(cfg, run)
    result = train(cfg, run)
    vals = result["val_history"]
    k = max(cfg.eval.pass_k)
    wall = time.perf_counter() - t0
    print()
    if vals:
        first, last = vals[0][1], vals[-1][1]
        print(
            f"pass@1 {first['val/pass@1'] if 'val/pass@1' in first else float('nan'):.3f} -> "
            f"{last.get('val/pass@1', float('nan')):.3f}, pass@{k} {first[f'val/pass@{k}']:.3f} -> "
            f"{last[f'val/pass@{k}']:.3f}  ({int(last['val/num_problems'])} held-out problems, step "
            f"{vals[0][0]} -> {vals[-1][0]})"
        )
    print(f"metrics:     {result['metrics_file']}")
    print(f"wall time:   {wall:.0f}s")
    return {**result, "wall_s": wall, "model_path": run.model_path}


if __name__ == "__main__":
    cli(main)
