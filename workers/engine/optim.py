"""The optimizer of a training engine from its `OptimConfig`: AdamW and the LR schedule (linear warm-up, then
constant or cosine decay)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from workers.engine.base import OptimConfig


def lr_lambda_for(cfg: OptimConfig) -> Callable[[int], float]:
    warmup = cfg.warmup_steps
    if warmup == 0 and cfg.warmup_ratio > 0 and cfg.total_steps:
        warmup = int(cfg.warmup_ratio * cfg.total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, (cfg.total_steps or 0) - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig | None
) -> tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LRScheduler | None]:
    """(AdamW over the parameters of ``model``, its LR schedule); (None, None) for a forward-only engine
    (``cfg`` None), whose ``model`` then stops requiring gradients."""
    if cfg is None:
        model.requires_grad_(False)
        return None, None
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters; no state for the base
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # one kernel over all parameters instead of a dozen ops per tensor: 3x faster on a 1M-parameter model
        # on CPU (benchmarks/bench_train.py), the same update to float rounding (tests/workers/engine)
        fused=all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for p in params) or None,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(cfg))
