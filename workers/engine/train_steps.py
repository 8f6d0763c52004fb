"""The engine-independent parts of a ``train_step`` (FSDP2 and Megatron engines): the loss mask, the
seeded mini-batch order, the global token/sequence counts a loss normalises by, the checked call of the
user's ``loss_fn``, and the metrics of one call."""

from __future__ import annotations

import math
from typing import Any

import torch


def response_loss_mask(tensors: dict[str, torch.Tensor], key: str, response_length: int) -> torch.Tensor:
    """``tensors[key]`` as float, or the response part of the attention mask when the batch has no such key."""
    if key in tensors:
        return tensors[key].float()
    return tensors["attention_mask"][:, -response_length:].float()


def minibatch_order(n: int, *, shuffle: bool, seed: int, global_step: int, epoch: int) -> torch.Tensor:
    """Row order of one epoch: a permutation seeded by (seed, step, epoch), so resumed runs repeat it."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + global_step * 7919 + epoch)
    return torch.randperm(n, generator=g)


def mask_counts(mask: torch.Tensor) -> torch.Tensor:
    """[tokens, sequences with a token] of a mini-batch's loss mask (float64, to be SUM-reduced over DP)."""
    return torch.tensor([float(mask.sum()), float((mask.sum(dim=1) > 0).sum())], dtype=torch.float64)


def call_loss_fn(loss_fn, outputs, batch, ctx) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss_fn(outputs, batch, ctx)`` -> (scalar loss, metrics as floats); a wrong return type is an error."""
    ret = loss_fn(outputs, batch, ctx)
    loss, m = ret if isinstance(ret, tuple) else (ret, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"loss_fn must return a scalar tensor (or (tensor, metrics)), got {loss!r}")
    return loss, {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in (m or {}).items()}


def step_metrics(
    losses: list[float],
    grad_norms: list[float],
    lrs: list[float],
    skipped_now: int,
    skipped_steps: int,
    global_step: int,
    extra: dict[str, list[float]],
) -> dict[str, Any]:
    """The metrics of one ``train_step`` call: means over its optimizer steps (grad norm over applied ones)."""
    applied = [g for g in grad_norms if math.isfinite(g)]
    metrics: dict[str, Any] = {
        "loss": sum(losses) / len(losses),
        "grad_norm": sum(applied) / len(applied) if applied else float("nan"),
        "lr": lrs[-1],  # the learning rate of the last step of this call
        "skipped": skipped_now,
        "skipped_steps": skipped_steps,
        "global_step": global_step,
        "losses": losses,
        "grad_norms": grad_norms,
    }
    for k, v in extra.items():
        metrics[k] = sum(v) / len(v)
    return metrics
