"""GRPO on Recursive Language Model (RLM) trajectories: the policy drives a persistent sandboxed Python REPL
that holds a long context, turn by turn, until ``FINAL(...)`` / ``FINAL_VAR(...)``.

    python -m recipes.rlm                                   # recipes/rlm.yaml: tiny model, S-NIAH 2K-8K chars, CPU
    python -m recipes.rlm trainer.total_training_steps=20 env.agent.max_iterations=3
    python -m recipes.rlm trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1

1. build the tiny model and the long-context task data (``task.name``: sniah / oolong / oolong_pairs);
2. warm start: the tasks' reference solutions replayed as multi-turn RLM trajectories (system prompt + query,
   the reference repl turns as assistant messages, the observations the sandbox really printed), trained
   with ``ActorWorker.sft_step`` on the assistant turns only;
3. GRPO: the env role (``workers/rlm/env_worker.py``) runs ``rollout.n`` RLM trajectories per prompt in its
   sandbox; the reward is the task scorer on each trajectory's final answer; then the usual GRPO step
   (log-probs, group-relative advantages, clipped update, weight sync) on the trajectories' model tokens
   (observation tokens are attended to but carry loss mask 0);
4. greedy RLM validation before and after: success rate (``val/accuracy``) and ``val-env/*``.
"""

from __future__ import annotations

import time

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
    val_batches,
)
from recipes.trainer.rlm import (
    RLMConfig,
    check,
    reference_batch,
    register_schema,
    rlm_generate,
    rlm_role_classes,
    rlm_validate,
)
from recipes.trainer.warm_start import warm_start_on_replays


def warm_start(cfg: RLMConfig, run: Run) -> str:
    """SFT on the replayed reference trajectories with an ActorWorker group; returns the exported HF dir."""
    return warm_start_on_replays(cfg, run, reference_batch, "reference trajectories")


def train(cfg: RLMConfig, run: Run, recipe: str = "rlm") -> dict:
    check(cfg)
    session = Session(cfg, run, recipe, **rlm_role_classes(cfg))  # hybrid actor/env worker(s) + sandbox
    roles, val_data = session.roles, val_batches(cfg, run)
    history_val = []
    batch = None
    with session:  # weights -> rollout engine; on exit: export, plot, shutdown
        if cfg.eval.before_train and session.state.step == 0:
            history_val.append((0, rlm_validate(roles, val_data, cfg)))
            session.tracker.log(history_val[-1][1], step=0)
        for batch in session.steps():
            metrics, timings = {}, {}
            step = session.state.step
            with timer("step", timings):
                # 1. rollout: rollout.n RLM trajectories per prompt, run in the env's sandbox (env/* metrics)
                with timer("gen", timings):
                    batch = rlm_generate(roles, batch, rollout_meta(cfg, step))
                    metrics |= {k: v for k, v in metrics_of(batch).items() if k.startswith("env/")}
                # 2. reward: the task scorer on each trajectory's final answer
                with timer("reward", timings):
                    batch = merge(batch, roles.reward.compute_rm_score(batch), metrics)  # scores `answer`
                # 3. log-probs of the model's tokens (observations masked) under the policy and the reference
                with timer("old_log_prob", timings):
                    batch = merge(batch, roles.actor.compute_log_prob(batch))
                if roles.ref is not None:
                    with timer("ref", timings):
                        batch = merge(batch, roles.ref.compute_ref_log_prob(batch))
                # 4. group-relative advantages on the controller
                with timer("adv", timings):
                    metrics |= compute_advantage(batch, cfg.algorithm, session.kl_ctrl)
                # 5. policy update, then the new weights to the rollout engine
                with timer("update_actor", timings):
                    merge(batch, roles.actor.update_actor(batch), metrics)
                with timer("update_weights", timings):
                    metrics |= roles.sync_weights()
            if due(step, cfg.eval.freq, session.total) or step == session.total:
                with timer("testing", timings):
                    val = rlm_validate(roles, val_data, cfg)
                history_val.append((step, val))
                metrics |= val
            session.end_step(batch, metrics, timings)
    result = session.result()
    result["val_history"] = history_val
    result["last_batch"] = batch
    return result


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    register_schema()
    cfg = parse_args("rlm", argv)
    run = start_run(cfg, "rlm")
    print(f"[rlm] run dir {run.dir}; model {run.model_path}; data {run.train_files[0]}")
    if cfg.sft.enable:
        run.model_path = warm_start(cfg, run)
    result = train(cfg, run)
    vals = result["val_history"]
    before, after = (vals[0][1]["val/accuracy"], vals[-1][1]["val/accuracy"]) if vals else (float("nan"),) * 2
    wall = time.perf_counter() - t0
    print()
    if vals:
        n = int(vals[-1][1]["val/num_samples"])
        print(f"RLM success rate {before:.2f} -> {after:.2f}  (greedy, {n} held-out problems, "
              f"step {vals[0][0]} -> step {vals[-1][0]})")  # fmt: skip
    print(f"curves:      {result['plot']}")
    print(f"metrics:     {result['metrics_file']}")
    print(f"wall time:   {wall:.0f}s")
    return {**result, "val_before": before, "val_after": after, "wall_s": wall}


if __name__ == "__main__":
    cli(main)
