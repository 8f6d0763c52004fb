"""``actor.ppo_max_token_len_per_gpu: auto``: the micro-batch token budget from the memory model
(`workers/models/memory.py`), resolved by the driver before Ray starts, so every actor rank gets one number and
the run's console says what it was and why.

On a GPU, auto is the largest budget whose colocated update the memory model fits on the device less its margin
(`size_colocated_run`); a run where nothing fits is refused with the stage and terms that do not. On the CPU
memory is not what limits a run, and auto is `CPU_TOKEN_BUDGET`. The saved run config keeps ``auto``, so a
resumed run sizes itself again on whatever device it resumes on.
"""

from __future__ import annotations

import torch

from recipes.config import ConfigError
from recipes.sections import RecipeConfig, device_counts, needs_reference, reference_is_actor
from recipes.worker_sections import model_is_moe
from workers.models import resolve_dtype
from workers.models.memory import GIB, RunSettings, size_colocated_run

AUTO = "auto"
CPU_TOKEN_BUDGET = 4096  # auto on the CPU: the budget the recipes' schema had before auto


def run_settings(cfg: RecipeConfig) -> RunSettings:
    """The memory model's settings of this run, key by key (`RunSettings` names the key of each field)."""
    tp = cfg.rollout.tensor_model_parallel_size
    graphs = cfg.rollout.engine_cuda_graphs
    if graphs is None:  # auto: the native engine captures where it can (workers/rollout/native/graphs.py)
        graphs = tp == 1 and not model_is_moe(cfg)
    return RunSettings(
        devices=device_counts(cfg)["train"],
        param_dtype=resolve_dtype(cfg.model.dtype),
        compute_dtype=torch.bfloat16,  # the FSDP engine's mixed precision on CUDA
        # rollout.dtype auto is bfloat16 on CUDA (workers.rollout.base.rollout_dtype), and this is a GPU run
        rollout_dtype=resolve_dtype("bfloat16" if cfg.rollout.dtype == "auto" else cfg.rollout.dtype),
        reference=needs_reference(cfg) and not reference_is_actor(cfg),
        max_num_seqs=cfg.rollout.max_num_seqs,
        prompt_length=cfg.rollout.prompt_length,
        response_length=cfg.rollout.response_length,
        activation_checkpointing=cfg.model.activation_checkpointing,
        rollout_tp=tp,
        free_cache_engine=cfg.rollout.free_cache_engine,
        cuda_graphs=bool(graphs),
    )


def device_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / GIB


def resolve_token_budget(
    cfg: RecipeConfig, model_path: str, use_gpu: bool, gib: float | None = None
) -> str | None:
    """Turn ``actor.ppo_max_token_len_per_gpu: auto`` into a token count in ``cfg`` (``gib``: the device's memory,
    default the first CUDA device's); returns the console line that says so, None when the budget was a
    number already. Raises ConfigError when not even one sequence's update fits."""
    if cfg.actor.ppo_max_token_len_per_gpu != AUTO:
        return None
    if not use_gpu:
        cfg.actor.ppo_max_token_len_per_gpu = CPU_TOKEN_BUDGET
        return f"actor.ppo_max_token_len_per_gpu=auto: {CPU_TOKEN_BUDGET} tokens (the CPU's)"
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    gib = gib if gib is not None else device_gib()
    sizing = size_colocated_run(hf_config, gib, run_settings(cfg))
    if sizing.max_token_len is None:
        raise ConfigError(
            f"actor.ppo_max_token_len_per_gpu=auto: the memory model fits no micro-batch on a {gib:.1f} GiB "
            f"device: {sizing.reason}. Shorten rollout.prompt_length/response_length, lower "
            "rollout.max_num_seqs, turn on model.activation_checkpointing or use more GPUs (docs/sizing.md)"
        )
    cfg.actor.ppo_max_token_len_per_gpu = sizing.max_token_len
    return (
        f"actor.ppo_max_token_len_per_gpu=auto: {sizing.max_token_len} tokens, where the memory model puts the "
        f"update at {sizing.estimate.update_actor / GIB:.1f} GiB of {sizing.limit_bytes / GIB:.1f} GiB usable "
        f"({gib:.1f} GiB per device less {sizing.margin:.0%}; generation {sizing.estimate.gen / GIB:.1f} GiB)"
    )
