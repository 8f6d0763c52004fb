"""``actor.ppo_max_token_len_per_gpu: auto`` (recipes/trainer/sizing.py): on a GPU, the largest micro-batch token
budget whose colocated update the memory model fits on the device; 4096 on the CPU; refused before Ray where the
model does not describe the run. The device is given in GiB: these tests stand in for a CUDA device's memory
(`torch.cuda.get_device_properties`), which the CPU cannot report."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from benchmarks.common import QWEN2_0_5B_SHAPE
from recipes.config import ConfigError, load_config
from recipes.trainer.sizing import CPU_TOKEN_BUDGET, resolve_token_budget, run_settings
from workers.models.memory import GIB, MARGIN, TOKEN_STEP, RunSettings, estimate_run

GPU_RUN = [
    "trainer.device=cuda",
    "trainer.n_gpus_per_node=8",
    "model.dtype=bfloat16",
    "actor.use_kl_loss=true",
    "actor.ppo_max_token_len_per_gpu=auto",
    "data.max_prompt_length=1024",
    "rollout.prompt_length=1024",
    "data.max_response_length=3072",
    "rollout.response_length=3072",
    "rollout.max_num_seqs=128",
    "rollout.free_cache_engine=false",
]


@pytest.fixture(scope="module")
def qwen2_0_5b(tmp_path_factory):
    """A folder with the Qwen2-0.5B shape's config.json (no weights: the memory model reads the config only)."""
    path = tmp_path_factory.mktemp("qwen2-0.5b-shape")
    Qwen2Config(**QWEN2_0_5B_SHAPE).save_pretrained(path)
    return str(path)


def test_the_settings_are_the_runs_keys():
    cfg = load_config("grpo", [*GPU_RUN, "model.activation_checkpointing=true"])
    assert run_settings(cfg) == RunSettings(
        devices=8,
        param_dtype=torch.bfloat16,
        compute_dtype=torch.bfloat16,
        rollout_dtype=torch.bfloat16,
        reference=True,
        max_num_seqs=128,
        prompt_length=1024,
        response_length=3072,
        activation_checkpointing=True,
        rollout_tp=1,
        free_cache_engine=False,
        cuda_graphs=True,
    )
    # no KL term, or LoRA (its base is the reference): no reference model; graphs off, rollout in fp32
    plain = load_config(
        "grpo", [*GPU_RUN, "actor.use_kl_loss=false", "rollout.cuda_graphs=false", "rollout.dtype=float32"]
    )
    s = run_settings(plain)
    assert not s.reference and not s.cuda_graphs and s.rollout_dtype == torch.float32
    lora = load_config("grpo", [*GPU_RUN, "actor.lora.rank=8"])
    assert not run_settings(lora).reference


def test_the_settings_take_every_dtype_name_the_config_takes():
    """model.dtype and rollout.dtype accept short names (bf16, fp16): the settings read them as the engines do."""
    cfg = load_config("grpo", [*GPU_RUN, "model.dtype=bf16", "rollout.dtype=float16"])
    s = run_settings(cfg)
    assert s.param_dtype == torch.bfloat16 and s.rollout_dtype == torch.float16


@pytest.mark.parametrize("gib", [80.0, 40.0])
def test_auto_is_the_largest_budget_that_fits_the_device(qwen2_0_5b, gib):
    """The resolved budget's update fits the device less the margin, the next step's does not, and the config
    the workers get holds the number."""
    cfg = load_config("grpo", GPU_RUN)
    line = resolve_token_budget(cfg, qwen2_0_5b, use_gpu=True, gib=gib)
    tokens = cfg.actor.ppo_max_token_len_per_gpu
    assert isinstance(tokens, int) and tokens % TOKEN_STEP == 0 and tokens >= 4096
    config = Qwen2Config(**QWEN2_0_5B_SHAPE)
    settings = RunSettings(
        devices=8, param_dtype=torch.bfloat16, max_num_seqs=128, prompt_length=1024, response_length=3072,
        free_cache_engine=False,
    )  # fmt: skip
    limit = gib * GIB * (1 - MARGIN)
    assert estimate_run(config, settings, tokens).update_actor <= limit
    assert estimate_run(config, settings, tokens + TOKEN_STEP).update_actor > limit
    assert line is not None and f"auto: {tokens} tokens" in line and f"{gib:.1f} GiB per device" in line


def test_auto_where_nothing_fits_is_refused_naming_the_stage(qwen2_0_5b):
    cfg = load_config("grpo", GPU_RUN)
    with pytest.raises(
        ConfigError, match=r"fits no micro-batch on a 2.0 GiB device: gen .* while generating"
    ):
        resolve_token_budget(cfg, qwen2_0_5b, use_gpu=True, gib=2.0)


def test_auto_on_the_cpu_and_a_number_are_kept_as_they_are(qwen2_0_5b):
    cfg = load_config("grpo", ["actor.ppo_max_token_len_per_gpu=auto"])
    assert resolve_token_budget(cfg, qwen2_0_5b, use_gpu=False) == (
        f"actor.ppo_max_token_len_per_gpu=auto: {CPU_TOKEN_BUDGET} tokens (the CPU's)"
    )
    assert cfg.actor.ppo_max_token_len_per_gpu == CPU_TOKEN_BUDGET
    numbered = load_config("grpo", ["actor.ppo_max_token_len_per_gpu=2048"])
    assert resolve_token_budget(numbered, qwen2_0_5b, use_gpu=True, gib=80.0) is None
    assert numbered.actor.ppo_max_token_len_per_gpu == 2048


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["rollout.name=sglang"], "rollout.name='sglang'"),
        (["actor.strategy=megatron"], "actor.strategy='megatron'"),
    ],
)
def test_auto_is_refused_where_the_memory_model_does_not_describe_the_run(overrides, named, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "sglang" else real(n, *a))
    with pytest.raises(ConfigError) as err:
        load_config("grpo", [*GPU_RUN, *overrides])
    assert "actor.ppo_max_token_len_per_gpu=auto sizes a colocated FSDP actor" in str(err.value)
    assert named in str(err.value) and "set a token count" in str(err.value)


def test_a_colocated_critic_is_not_counted_so_auto_is_refused_with_it():
    with pytest.raises(ConfigError, match="a colocated critic"):
        load_config("ppo", [*GPU_RUN, "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"])


def test_bad_budgets_are_named():
    for value in ("lots", "0", "-4"):
        with pytest.raises(ConfigError, match="ppo_max_token_len_per_gpu must be a token count >= 1 or auto"):
            load_config("grpo", [f"actor.ppo_max_token_len_per_gpu={value}"])


def test_a_worker_given_auto_unresolved_says_who_resolves_it():
    from workers.config import ActorConfig
    from workers.roles.common import ppo_micro_batch_kwargs

    with pytest.raises(ValueError, match="reached a worker unresolved: the recipe driver"):
        ppo_micro_batch_kwargs(ActorConfig(ppo_max_token_len_per_gpu="auto"))
    assert ppo_micro_batch_kwargs(ActorConfig(ppo_max_token_len_per_gpu="2048"))["max_token_len"] == 2048
