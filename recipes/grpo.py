"""GRPO (group-relative policy optimisation), driven by a single controller; with a critic, PPO.

    python -m recipes.grpo                                        # recipes/grpo.yaml
    python -m recipes.grpo rollout.n=8 trainer.total_training_steps=50 model.path=/path/to/hf_model
    python -m recipes.grpo trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1

Each step samples ``rollout.n`` responses per prompt, scores them with the rule reward, and moves the policy
towards the responses that beat their group's mean (advantage = (score - group mean) / group std), with a KL
loss to the frozen reference. Every call on ``roles.*`` runs on a WorkerGroup of Ray actors; advantages are
computed here on the controller. Pools, data, metrics, tracking and checkpoints live in ``recipes/trainer``.

``rl_step`` is also PPO's step (``recipes/ppo.py``): a session with a critic adds the critic's values, GAE
advantages and the critic update; ``recipes/rlm.py`` runs it with an environment generating.
"""

from __future__ import annotations

from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer import (
    Run,
    Session,
    check_env_errors,
    cli,
    compute_advantage,
    demonstrations,
    fill_mini_batches,
    log_probs,
    metrics_of,
    parse_args,
    rollout_meta,
    score,
    start_run,
    timer,
    update_actor,
    warm_start,
)


def rl_step(s: Session, batch: DataProto, metrics: dict, timings: dict) -> DataProto:
    """One step on a batch of prompts; returns the batch with every column the step computed."""
    cfg, roles = s.cfg, s.roles
    # 1. rollout: rollout.n samples per prompt (rows a,a,..,b,b,..), seeded by the step, then the reward (the
    #    rule verifier's score on each response's last token)
    with timer("gen", timings):
        batch = roles.generate(batch, rollout_meta(cfg, s.state.step))
    batch = score(roles, batch, timings)
    # an agent env whose every trajectory failed stops the run; step-wise turns and children as rows vary the
    # row count: filled up to whole PPO mini-batches with rows that carry no loss
    check_env_errors(batch, s.state.step)
    batch = fill_mini_batches(cfg, batch, roles.critic is not None)
    # 2. log-probs of the sampled tokens under the current policy (unless the update computes them:
    #    algorithm.old_log_prob) and the frozen reference (and PPO: the critic's values)
    batch = log_probs(cfg, roles, batch, timings)
    if roles.critic is not None:
        with timer("values", timings):
            batch = batch.union(roles.critic.compute_values(batch))
    # 3. advantages, here on the controller: group-relative (GRPO), or rewards minus the KL penalty and GAE
    with timer("adv", timings):
        metrics |= compute_advantage(batch, cfg.algorithm, s.kl_ctrl)
    # 4. PPO: the critic's update towards the returns
    if roles.critic is not None:
        with timer("update_critic", timings):
            metrics |= metrics_of(roles.critic.update_critic(batch))
    # 5. policy update (clipped surrogate + KL loss) once a critic has warmed up, then the new weights to the
    #    rollout engine as policy version = step (its tokens record it: rollout_versions)
    if s.state.step > cfg.trainer.critic_warmup:
        metrics |= update_actor(roles, batch, timings, sync_weights=True, version=s.state.step)
    return batch


def train(cfg: RecipeConfig, run: Run, recipe: str = "grpo", **role_options) -> dict:
    """``role_options``: ``build_roles``' options, e.g. an environment's role that generates
    (`recipes.trainer.roles.env_generator`)."""
    session = Session(cfg, run, recipe, **role_options)  # data, pools + WorkerGroups, KL controller, resume
    # weights -> rollout engine, validation before training; rl_step, then metrics, validation and
    # checkpoint when due, per step; at the end: export, plot, shutdown
    return session.train(rl_step)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args("grpo", argv)  # recipes/grpo.yaml + key.sub=value overrides, validated before Ray starts
    run = start_run(cfg, "grpo")
    run.model_path = warm_start(cfg, run, demonstrations)  # the tiny model's SFT (sft.enable), else as it is
    return train(cfg, run)


if __name__ == "__main__":
    cli(main)
