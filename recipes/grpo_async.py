"""GRPO with generation overlapping training: one-step off-policy or fully asynchronous (``async_rl``).

    python -m recipes.grpo_async                                    # recipes/grpo_async.yaml: fully async
    python -m recipes.grpo_async async_rl.mode=one_step             # batch k+1 generated while batch k trains
    python -m recipes.grpo_async async_rl.mode=sync                 # generate, then train (recipes.grpo's step)
    python -m recipes.grpo_async async_rl.on_weight_update=abort algorithm.rollout_correction=decoupled_ppo

The rollout pool (``trainer.rollout_gpus_per_node`` devices) keeps generating while the training pool
updates. Each step takes a batch of whole GRPO groups from the rollout source (``recipes/trainer/async_rl.py``):
samples may come from weights up to ``async_rl.max_staleness`` updates old, each token tagged with its
version. The trainer recomputes the log-probs under its current weights (the proximal policy), the correction
``algorithm.rollout_correction`` weighs each token by proximal / behaviour (the rollout engine's log-probs),
and after the update the new weights go to the rollout engines while they generate.
"""

from __future__ import annotations

from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer import (
    Run,
    Session,
    apply_rollout_correction,
    check_env_errors,
    cli,
    compute_advantage,
    demonstrations,
    fill_mini_batches,
    log_probs,
    parse_args,
    score,
    start_run,
    timer,
    update_actor,
    warm_start,
)
from recipes.trainer.async_rl import RolloutStream, SyncRollout, rollout_source


def async_step(s: Session, source: SyncRollout | RolloutStream, metrics: dict, timings: dict) -> DataProto:
    """One update on the next batch of finished groups; the new weights go to the rollout engines."""
    cfg, roles = s.cfg, s.roles
    version = s.state.step - 1  # updates the trainer's weights have had
    # 1. a batch of whole groups (rollout.n samples per prompt) at most async_rl.max_staleness versions old
    with timer("wait_rollout", timings):
        batch, took = source.take(version)
    metrics |= took
    check_env_errors(batch, s.state.step)
    batch = fill_mini_batches(cfg, batch, with_critic=False)
    # 2. reward, the current policy's log-probs (the proximal policy) and the reference's
    batch = log_probs(cfg, roles, score(roles, batch, timings), timings, old_log_probs_needed=True)
    # 3. off-policy correction: proximal / behaviour (the rollout engine's log-probs) per token
    metrics |= apply_rollout_correction(batch, cfg.algorithm)
    # 4. group-relative advantages, then the policy update
    with timer("adv", timings):
        metrics |= compute_advantage(batch, cfg.algorithm, s.kl_ctrl)
    metrics |= update_actor(roles, batch, timings)
    # 5. version + 1 to the rollout engines, while they generate
    with timer("update_weights", timings):
        metrics |= source.sync_weights(version + 1)
    return batch


def train(cfg: RecipeConfig, run: Run, recipe: str = "grpo_async", **role_options) -> dict:
    """``role_options``: ``build_roles``' options, e.g. an agent environment's role that generates
    (``recipes/rlm.py`` with ``async_rl.mode`` one_step / full, `recipes.trainer.roles.env_generator`)."""
    asynchronous = cfg.async_rl.mode != "sync"  # type: ignore[attr-defined]
    s = Session(cfg, run, recipe, fixed_prompt_width=True, async_rollout=asynchronous, **role_options)

    def loop() -> None:  # run again from the latest checkpoint after a worker fault (Session.survive)
        with rollout_source(s) as source:  # the stream starts
            # checkpoints: loader + untrained prompts
            s.data_state = lambda: source.checkpoint_state(s.loader)
            for _ in s.step_numbers():
                metrics: dict[str, float] = {}
                timings: dict[str, float] = {}
                with timer("step", timings):
                    batch = async_step(s, source, metrics, timings)
                metrics["async/trainer_idle_frac"] = timings["wait_rollout"] / timings["step"]
                metrics["perf/samples_per_s"] = len(batch) / timings["step"]
                s.end_step(batch, metrics, timings)

    with s:  # weights -> rollout, validation
        s.survive(loop)
    return s.result()


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args("grpo_async", argv)  # recipes/grpo_async.yaml + key.sub=value overrides
    run = start_run(cfg, "grpo_async")
    run.model_path = warm_start(cfg, run, demonstrations)  # the tiny model's SFT (sft.enable), else as it is
    return train(cfg, run)


if __name__ == "__main__":
    cli(main)
