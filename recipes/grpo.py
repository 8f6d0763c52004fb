"""GRPO (group-relative policy optimisation), driven by a single controller.

    python -m recipes.grpo                                        # recipes/grpo.yaml
    python -m recipes.grpo rollout.n=8 trainer.total_training_steps=50 model.path=/path/to/hf_model
    python -m recipes.grpo trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1

Each step samples ``rollout.n`` responses per prompt, scores them with the rule reward, and moves the policy
towards the responses that beat their group's mean (advantage = (score - group mean) / group std), with a KL
loss to the frozen reference. Every call on ``roles.*`` runs on a WorkerGroup of Ray actors; advantages are
computed here on the controller. Pools, data, metrics, tracking and checkpoints live in ``recipes/trainer``.
"""

from __future__ import annotations

from recipes.schemas import RecipeConfig
from recipes.trainer import (
    Run,
    Session,
    cli,
    compute_advantage,
    metrics_of,
    parse_args,
    rollout_meta,
    score_and_log_probs,
    start_run,
    timer,
)


def train(cfg: RecipeConfig, run: Run, recipe: str = "grpo", **role_classes) -> dict:
    """``role_classes``: the workers that generate (``build_roles``' hook), e.g. an environment's."""
    session = Session(cfg, run, recipe, **role_classes)  # data, pools + WorkerGroups, KL controller, resume
    roles = session.roles
    with session:  # weights -> rollout engine, validation before training; on exit: export, plot, shutdown
        for batch in session.steps():
            metrics, timings = {}, {}
            with timer("step", timings):
                # 1. rollout: rollout.n samples per prompt (rows a,a,..,b,b,..), seeded by the step
                with timer("gen", timings):
                    batch = roles.generate(batch, rollout_meta(cfg, session.state.step))
                # 2. reward (the rule verifier's score on each response's last token), then log-probs of the
                #    sampled tokens under the current policy and the frozen reference
                batch = score_and_log_probs(cfg, roles, batch, timings)
                # 3. group-relative advantages, here on the controller
                with timer("adv", timings):
                    metrics |= compute_advantage(batch, cfg.algorithm, session.kl_ctrl)
                # 4. policy update (clipped surrogate + KL loss), then the new weights to the rollout engine
                with timer("update_actor", timings):
                    metrics |= metrics_of(roles.actor.update_actor(batch))
                with timer("update_weights", timings):
                    metrics |= roles.sync_weights()
            session.end_step(batch, metrics, timings)  # metrics; validation / checkpoint when due; logging
    return session.result()


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args("grpo", argv)  # recipes/grpo.yaml + key.sub=value overrides, validated before Ray starts
    return train(cfg, start_run(cfg, "grpo"))


if __name__ == "__main__":
    cli(main)
