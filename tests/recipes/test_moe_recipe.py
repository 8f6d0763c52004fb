"""A mixture of experts through the GRPO recipe (docs/moe.md): the tiny Qwen3-MoE (``model.tiny_arch=moe``) warm-
started, sampled by the native engine, and trained by the FSDP engine, with routing replay one key away. The
rollout's routes cross the Ray dispatch as the ``routed_experts`` column; fp32 rollout and trainer route alike, so
a route mismatch of 0 and rollout log-probs equal to the trainer's show the routes arrive aligned with their
tokens (a shifted or mis-packed column would replay wrong experts and move both)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from recipe_testlib import BRIEF_GRPO, BRIEF_RLM

from recipes import grpo, ppo, rlm
from recipes.config import ConfigError, load_config
from recipes.trainer.run import start_run
from workers.agents.examples.word_count import write_dataset


def train_two_moe_steps(recipe, name: str, tmp_path, *overrides: str) -> list[dict]:
    """Two training steps of recipe ``name`` (its module ``recipe``) on the tiny MoE, briefly; their metric rows."""
    cfg = load_config(
        name,
        [
            *BRIEF_GRPO,
            "model.tiny_arch=moe",
            *overrides,
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    history = recipe.train(cfg, start_run(cfg, name, start_ray=False))["history"]
    steps = [row for row in history if row["step"] >= 1]
    assert len(steps) == 2
    return steps


@pytest.mark.parametrize("replay", ["rollout", "old_log_prob"])
def test_grpo_trains_the_tiny_moe_with_routing_replay(ray_session, tmp_path, replay):
    steps = train_two_moe_steps(
        grpo,
        "grpo",
        tmp_path,
        f"actor.moe.routing_replay={replay}",
        f"actor.moe.reference_replay={str(replay == 'rollout').lower()}",  # the KL's reference on the same experts
        "algorithm.old_log_prob=recompute",  # the old log-prob pass runs (and replays, or gives its routes)
        "actor.moe.aux_loss_coef=0.01",
        "sft.total_steps=20",
        "sft.optim.total_steps=20",
        "sft.optim.warmup_steps=2",
    )
    for row in steps:
        assert row["actor/moe/route_mismatch"] == 0.0
        assert row["actor/moe/unreplayed_share"] == 0.0  # every trained position had a route to replay
        assert row["actor/moe/route_mismatch/layer_0"] == 0.0 and "actor/moe/route_mismatch/layer_1" in row
        assert 1.0 <= row["actor/moe/expert_load_max_over_mean"] <= 2.0  # 4 experts, top-2: at most 2
        assert row["training/rollout_logprob_diff_max"] < 1e-3
        assert row["actor/moe/aux_loss"] >= 1.0 - 1e-6  # the load-balancing loss is 1 at perfect balance
        assert row["actor/grad_norm"] > 0
        # one mini-batch: the update's first forward replays the routes the old log-probs were computed with,
        # so its ratio is exactly 1 (a wrong or shifted route column would move it)
        assert abs(row["actor/ppo_kl"]) < 1e-6


def test_ppo_trains_the_tiny_moe_with_an_moe_critic(ray_session, tmp_path):
    """PPO on the tiny MoE: the critic is the same mixture of experts with a value head, and the actor replays
    the rollout's routes."""
    steps = train_two_moe_steps(
        ppo,
        "ppo",
        tmp_path,
        "actor.moe.routing_replay=rollout",
        "critic.ppo_mini_batch_size=2",
        "sft.total_steps=2",
    )
    for row in steps:
        assert row["actor/moe/route_mismatch"] == 0.0 and row["actor/moe/unreplayed_share"] == 0.0
        assert row["critic/vf_loss"] > 0 and row["critic/grad_norm"] > 0


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "grpo",
            ["model.tiny_arch=moe", "actor.strategy=megatron"],
            "actor.strategy='megatron' does not train",
        ),
        ("grpo", ["actor.moe.routing_replay=rollout"], "but the model is dense"),
        (  # an engine class that records no routes (SGLang records them: tests/workers/rollout/test_sglang_routes.py)
            "grpo",
            [
                "model.tiny_arch=moe",
                "actor.moe.routing_replay=rollout",
                "rollout.name=workers.rollout.base:RolloutEngine",
            ],
            "rollout.name='workers.rollout.base:RolloutEngine' does not record",
        ),
        ("grpo", ["model.tiny_arch=moe", "actor.moe.routing_replay=r3"], "routing_replay must be one of"),
        ("grpo", ["actor.moe.reference_replay=true"], "routes in the reference, but the model is dense"),
        (
            "grpo",
            ["model.tiny_arch=moe", "actor.moe.reference_replay=true", "actor.use_kl_loss=false"],
            "but no reference loads",
        ),
        (
            "grpo",
            ["model.tiny_arch=moe", "rollout.tensor_model_parallel_size=2"],
            "rollout.tensor_model_parallel_size=2 does not split",
        ),
        ("grpo", ["model.tiny_arch=experts"], "model.tiny_arch='experts'; choose one of"),
    ],
)
def test_moe_settings_that_cannot_work_are_refused_before_ray(recipe, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(recipe, overrides)


def test_an_agent_environments_multi_turn_rows_carry_their_routes(ray_session, tmp_path):
    """The one-file word-count environment (a tool call, its observation, then the answer: two engine calls per
    trajectory) on the tiny MoE with rollout replay: each row takes its last call's routes, whose prompt was the
    whole row before its response, so the trainer's own routers agree with them everywhere (fp32) and its
    log-probs are the engine's."""
    yaml = Path(__file__).resolve().parents[2] / "recipes" / "rlm_word_count.yaml"
    paths = write_dataset(str(tmp_path / "data"), n_train=8, n_val=2)
    result = rlm.main(
        [
            "--config",
            str(yaml),
            f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['val']}]",
            "model.tiny_size=nano",
            "model.tiny_arch=moe",
            "actor.moe.routing_replay=rollout",
            "data.train_batch_size=2",
            "data.val_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "sft.total_steps=2",
            "sft.batch_size=4",
            "env.agent.max_new_tokens=16",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.progress_bar=false",
            "trainer.logger=[console]",
            "trainer.plot=false",
            "trainer.export_hf=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    assert_rows_carry_their_routes(result)


@pytest.mark.parametrize("step_wise", [False, True])
def test_the_rlm_repl_environments_rows_carry_their_routes(ray_session, tmp_path, step_wise):
    """The RLM recipe (the REPL environment: code, its output, more code; its own agent loop) on the tiny MoE
    with rollout replay: its rows (whole trajectories, or one row per call with ``env.step_wise``) carry their
    call's routes too, the trainer's routers agree with them (fp32), and its log-probs are the engine's."""
    result = rlm.main(
        [
            *BRIEF_RLM,
            "model.tiny_arch=moe",
            "actor.moe.routing_replay=rollout",
            f"env.step_wise={str(step_wise).lower()}",
            "trainer.val_before_train=false",
            "trainer.export_hf=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    assert_rows_carry_their_routes(result)


def assert_rows_carry_their_routes(result: dict) -> None:
    """Every row of an agent recipe's last batch brought routes (its prompt's, from its call's prefill; none on
    padding), the trainer's routers agreed with them (fp32) and replayed them all, and its log-probs are the
    engine's."""
    batch = result["last_batch"].batch
    routes, real = batch["routed_experts"], batch["attention_mask"].bool()
    assert routes.shape[:2] == real.shape and routes.shape[2:] == (2, 2)  # 2 routed layers, top-2
    P = batch["prompts"].shape[1]
    for i in range(len(routes)):
        have = routes[i, :, 0, 0] >= 0
        assert have[:P][real[i, :P]].all() and not have[~real[i]].any()
    assert result["final"]["actor/moe/route_mismatch"] == 0.0
    assert result["final"]["actor/moe/unreplayed_share"] == 0.0
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
    assert diff.numel() > 0 and float(diff.max()) < 1e-3
