"""PPO with a learned critic (GAE advantages), driven by a single controller.

    python -m recipes.ppo                                         # recipes/ppo.yaml
    python -m recipes.ppo algorithm.use_kl_in_reward=false critic.optim.lr=1e-4 trainer.critic_warmup=2
    python -m recipes.ppo trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1

Each step samples responses, scores them with the rule reward, subtracts a KL penalty to the frozen reference
from the reward (``algorithm.use_kl_in_reward``), estimates per-token advantages with GAE from the critic's
values, then updates the critic (value loss) and the actor (clipped surrogate). Every call on ``roles.*`` runs
on a WorkerGroup of Ray actors; advantages are computed here on the controller.
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


def train(cfg: RecipeConfig, run: Run, recipe: str = "ppo") -> dict:
    session = Session(cfg, run, recipe, critic=True)  # data, pools + WorkerGroups (+ critic), resume, tracker
    roles = session.roles
    with session:  # weights -> rollout engine, validation before training; on exit: export, plot, shutdown
        for batch in session.steps():
            metrics, timings = {}, {}
            with timer("step", timings):
                # 1. rollout: rollout.n samples per prompt, seeded by the step
                with timer("gen", timings):
                    batch = roles.generate(batch, rollout_meta(cfg, session.state.step))
                # 2. reward, log-probs under the current policy and the reference, values from the critic
                batch = score_and_log_probs(cfg, roles, batch, timings)
                with timer("values", timings):
                    batch = batch.union(roles.critic.compute_values(batch))
                # 3. rewards minus the KL penalty, then GAE advantages and returns, here on the controller
                with timer("adv", timings):
                    metrics |= compute_advantage(batch, cfg.algorithm, session.kl_ctrl)
                # 4. critic update towards the returns
                with timer("update_critic", timings):
                    metrics |= metrics_of(roles.critic.update_critic(batch))
                # 5. actor update once the critic has warmed up, then the new weights to the rollout engine
                if session.state.step > cfg.trainer.critic_warmup:
                    with timer("update_actor", timings):
                        metrics |= metrics_of(roles.actor.update_actor(batch))
                    with timer("update_weights", timings):
                        metrics |= roles.sync_weights()
            session.end_step(batch, metrics, timings)  # metrics; validation / checkpoint when due; logging
    return session.result()


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args("ppo", argv)  # recipes/ppo.yaml + key.sub=value overrides, validated before Ray starts
    return train(cfg, start_run(cfg, "ppo"))


if __name__ == "__main__":
    cli(main)
