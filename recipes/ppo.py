"""PPO with a learned critic (GAE advantages), driven by a single controller.

    python -m recipes.ppo                                         # recipes/ppo.yaml
    python -m recipes.ppo algorithm.use_kl_in_reward=false critic.optim.lr=1e-4 trainer.critic_warmup=2
    python -m recipes.ppo trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1

Each step samples responses, scores them with the rule reward, subtracts a KL penalty to the frozen reference
from the reward (``algorithm.use_kl_in_reward``), estimates per-token advantages with GAE from the critic's
values, then updates the critic (value loss) and, after ``trainer.critic_warmup`` steps, the actor (clipped
surrogate). The step is GRPO's (``recipes.grpo.rl_step``) in a session with a critic. Every call on ``roles.*``
runs on a WorkerGroup of Ray actors; advantages are computed here on the controller.
"""

from __future__ import annotations

from recipes.grpo import rl_step
from recipes.sections import RecipeConfig
from recipes.trainer import Run, Session, cli, demonstrations, parse_args, start_run, warm_start


def train(cfg: RecipeConfig, run: Run, recipe: str = "ppo") -> dict:
    session = Session(cfg, run, recipe, critic=True)  # data, pools + WorkerGroups (+ critic), resume, tracker
    return session.train(rl_step)  # per step: rl_step, then metrics, validation / checkpoint when due


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args("ppo", argv)  # recipes/ppo.yaml + key.sub=value overrides, validated before Ray starts
    run = start_run(cfg, "ppo")
    run.model_path = warm_start(cfg, run, demonstrations)  # policy, reference and critic start from it
    return train(cfg, run)


if __name__ == "__main__":
    cli(main)
