"""Recipes with ``actor.strategy=megatron`` and TP/PP inside the role workers: the config checks that count
data-parallel replicas as ``world / (tp * pp)``, and one GRPO step end to end on the nano model with a TP=2
hybrid actor (2 CPU ranks over gloo, colocated with an FSDP reference), checkpointed."""

import importlib.util
import math

import pytest

from recipes import grpo
from recipes.config import ConfigError, load_config
from recipes.trainer.checkpoint import latest_step
from recipes.trainer.run import start_run
from tests.skips import skip_or_fail
from workers.engine.checkpoint import verify_checkpoint

TINY = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=16",
    "task.n_val=4",
    "data.val_max_samples=4",
    "data.train_batch_size=2",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "trainer.total_training_steps=1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.logger=[console]",
]
TP2 = ["actor.strategy=megatron", "actor.megatron.tensor_model_parallel_size=2"]


def test_megatron_sizes_set_the_data_parallel_size():
    # 4 devices at TP=2 are 2 replicas: 1 prompt x 2 samples per optimizer step divide among them...
    four = [*TINY, "trainer.n_gpus_per_node=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=1"]
    cfg = load_config("grpo", [*four, *TP2])
    assert cfg.actor.megatron.tensor_model_parallel_size == 2
    # ... but not among 4 FSDP ranks
    with pytest.raises(
        ConfigError, match=r"actor.ppo_mini_batch_size \* rollout.n = 1 \* 2 = 2 rows .* size 4"
    ):
        load_config("grpo", four)
    # 3 devices cannot hold TP=2 replicas: the error names the keys
    with pytest.raises(
        ConfigError,
        match=r"actor.megatron.tensor_model_parallel_size \* actor.megatron.pipeline_model_parallel_size = "
        r"2 \* 1 = 2 must divide the 3 device\(s\)",
    ):
        load_config("grpo", [*TINY, "trainer.n_gpus_per_node=3", "data.train_batch_size=3", *TP2])
    with pytest.raises(ConfigError, match="actor.strategy must be fsdp or megatron, got 'deepspeed'"):
        load_config("grpo", [*TINY, "actor.strategy=deepspeed"])


def test_colocated_megatron_actor_and_critic_share_sizes():
    ppo = [
        *TINY,
        "trainer.n_gpus_per_node=4",
        "data.train_batch_size=4",
        "critic.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=gae",
        "critic.strategy=megatron",
        *TP2,
    ]
    with pytest.raises(ConfigError, match=r"actor.megatron \(tp, pp\) = \(2, 1\) and critic.megatron"):
        load_config("ppo", [*ppo, "critic.megatron.pipeline_model_parallel_size=2"])
    cfg = load_config("ppo", [*ppo, "critic.megatron.tensor_model_parallel_size=2"])
    assert cfg.critic.megatron.tensor_model_parallel_size == 2
    # the critic's own pool may use other sizes (its own processes); its replicas count from its pool
    split = [*ppo, "trainer.placement=split_critic", "trainer.critic_gpus_per_node=2"]
    load_config("ppo", [*split, "critic.megatron.pipeline_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="critic.megatron.* = 4 must divide the 2 device"):
        load_config("ppo", [*split, "critic.megatron.tensor_model_parallel_size=4"])


# A reward that differs between the samples of a prompt (their lengths differ), so GRPO advantages are non-zero
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100.0
"""


@pytest.mark.e2e
def test_grpo_step_with_tensor_parallel_actor(ray_session, tmp_path):
    if importlib.util.find_spec("megatron.core") is None:
        skip_or_fail("megatron-core is not installed (pip install -e '.[megatron]')")
    reward_file = tmp_path / "length.py"
    reward_file.write_text(LENGTH_REWARD)
    overrides = [
        *TINY,
        *TP2,
        f"custom_reward_function.path={reward_file}",
        "trainer.n_gpus_per_node=2",
        "actor.use_kl_loss=true",  # a reference worker (FSDP) colocated with the Megatron actor
        "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.save_freq=1",  # the Megatron actor's DCP checkpoint, one shard per TP rank
    ]
    cfg = load_config("grpo", overrides)
    result = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert latest_step(ckpt_dir) == 1
    manifest = verify_checkpoint(ckpt_dir / "actor" / "step_1")
    assert {"model_optim/__0_0.distcp", "model_optim/__1_0.distcp"} <= set(manifest["files"])
    (row,) = result["history"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "perf/weight_sync_bytes"):
        assert key in row and math.isfinite(row[key]), key
    assert row["critic/advantages/max"] > 0  # the samples' rewards differed: a real policy-gradient step
    assert row["actor/grad_norm"] > 1e-3 and row["perf/weight_sync_bytes"] > 0
