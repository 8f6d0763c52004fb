"""The third placement (split_critic) in the recipe config: its device counts, and errors naming the keys."""

from __future__ import annotations

import pytest

from recipes.config import ConfigError, load_config
from recipes.sections import device_counts

SPLIT = ["trainer.placement=split_critic", "trainer.n_gpus_per_node=3", "trainer.critic_gpus_per_node=1"]


def test_split_critic_config_and_device_counts():
    batches = ["data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "critic.ppo_mini_batch_size=6"]
    cfg = load_config("ppo", [*SPLIT, *batches])
    assert device_counts(cfg) == {"train": 2, "rollout": 2, "critic": 1, "total": 3}


@pytest.mark.parametrize(
    "recipe, overrides, match",
    [
        ("grpo", SPLIT, "trainer.placement=split_critic puts the critic on its own pool, but "
         "algorithm.adv_estimator=grpo trains no critic"),
        ("ppo", ["trainer.placement=split_critic", "trainer.n_gpus_per_node=2"],
         "needs 0 < trainer.critic_gpus_per_node < trainer.n_gpus_per_node"),
        ("ppo", ["trainer.critic_gpus_per_node=1"],
         "trainer.critic_gpus_per_node=1 is only used with trainer.placement=split_critic"),
        # a critic pool of 3: 8 prompts x 2 samples per critic mini-batch do not split 3 ways
        ("ppo", ["trainer.placement=split_critic", "trainer.n_gpus_per_node=4", "trainer.critic_gpus_per_node=3",
                 "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"],
         r"critic.ppo_mini_batch_size \* rollout.n = 8 \* 2 = 16 rows per optimizer step is not divisible by the "
         "training data-parallel size 3"),
    ],
)  # fmt: skip
def test_split_critic_errors_name_the_keys(recipe, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(recipe, overrides)
