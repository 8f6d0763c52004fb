"""A mixture of experts through the GRPO recipe (docs/moe.md): the tiny Qwen3-MoE (``model.tiny_arch=moe``) warm-
started, sampled by the native engine, and trained by the FSDP engine, with routing replay one key away. The
rollout's routes cross the Ray dispatch as the ``routed_experts`` column; fp32 rollout and trainer route alike, so
a route mismatch of 0 and rollout log-probs equal to the trainer's show the routes arrive aligned with their
tokens (a shifted or mis-packed column would replay wrong experts and move both)."""

from __future__ import annotations

import re

import pytest
from recipe_testlib import BRIEF_GRPO

from recipes import grpo
from recipes.config import ConfigError, load_config
from recipes.trainer.run import start_run


@pytest.mark.parametrize("replay", ["rollout", "old_log_prob"])
def test_grpo_trains_the_tiny_moe_with_routing_replay(ray_session, tmp_path, replay):
    overrides = [
        *BRIEF_GRPO,
        "model.tiny_arch=moe",
        f"actor.moe.routing_replay={replay}",
        "algorithm.old_log_prob=recompute",  # the old log-prob pass runs (and replays, or gives its routes)
        "actor.moe.aux_loss_coef=0.01",
        "sft.total_steps=20",
        "sft.optim.total_steps=20",
        "sft.optim.warmup_steps=2",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    cfg = load_config("grpo", overrides)
    history = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))["history"]
    steps = [row for row in history if row["step"] >= 1]
    assert len(steps) == 2
    for row in steps:
        assert row["actor/moe/route_mismatch"] == 0.0
        assert row["actor/moe/route_mismatch/layer_0"] == 0.0 and "actor/moe/route_mismatch/layer_1" in row
        assert 1.0 <= row["actor/moe/expert_load_max_over_mean"] <= 2.0  # 4 experts, top-2: at most 2
        assert row["training/rollout_logprob_diff_max"] < 1e-3
        assert row["actor/moe/aux_loss"] >= 1.0 - 1e-6  # the load-balancing loss is 1 at perfect balance
        assert row["actor/grad_norm"] > 0
        # one mini-batch: the update's first forward replays the routes the old log-probs were computed with,
        # so its ratio is exactly 1 (a wrong or shifted route column would move it)
        assert abs(row["actor/ppo_kl"]) < 1e-6


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "grpo",
            ["model.tiny_arch=moe", "actor.strategy=megatron"],
            "actor.strategy='megatron' does not train",
        ),
        ("grpo", ["actor.moe.routing_replay=rollout"], "but the model is dense"),
        (
            "grpo",
            ["model.tiny_arch=moe", "actor.moe.routing_replay=rollout", "rollout.name=sglang"],
            "rollout.name='sglang' does not record",
        ),
        (
            "rlm",
            ["model.tiny_arch=moe", "actor.moe.routing_replay=rollout"],
            "do not carry the engine's expert",
        ),
        ("grpo", ["model.tiny_arch=moe", "actor.moe.routing_replay=r3"], "routing_replay must be one of"),
        ("grpo", ["model.tiny_arch=experts"], "model.tiny_arch='experts'; choose one of"),
    ],
)
def test_moe_settings_that_cannot_work_are_refused_before_ray(recipe, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(recipe, overrides)
