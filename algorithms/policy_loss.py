"""Policy-gradient losses, registered by name in ``POLICY_LOSS_REGISTRY``.

Every registered policy loss has one call signature, so the actor can call any of them::

    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = get_policy_loss_fn(name)(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
        clip_ratio=..., clip_ratio_low=..., clip_ratio_high=..., clip_ratio_c=...,
        global_batch_info=..., rollout_is_weights=...,
    )

All tensors are [B, R]; ``log_prob`` carries the gradient. ``pg_loss`` is aggregated with
``agg_loss`` (see ``algorithms.aggregation`` for the micro-batch / DP convention;
``global_batch_info`` is passed through). The three metrics are detached scalar tensors computed
over this call's valid tokens (verl's ``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``). ``rollout_is_weights`` (optional [B, R]) multiplies the per-token loss
(rollout importance-sampling correction). A new loss registered with ``@register_policy_loss``
should accept the same arguments.

The actor's full loss is typically ``pg_loss - entropy_coeff * entropy_loss + kl_coef * kl_loss``
(``compute_entropy_loss``, ``compute_kl_loss``), each aggregated with the same ``global_batch_info``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from algorithms.aggregation import agg_loss
from algorithms.masked import masked_mean
from algorithms.registry import register_policy_loss

__all__ = [
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "GSPO_CLIP_RATIO_LOW",
    "GSPO_CLIP_RATIO_HIGH",
]

# GSPO clips a sequence-level ratio, whose deviation from 1 is orders of magnitude smaller than a
# token ratio's; the GSPO paper (Zheng et al. 2025) uses these ranges.
GSPO_CLIP_RATIO_LOW = 3e-4
GSPO_CLIP_RATIO_HIGH = 4e-4


def _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights) -> None:
    shapes = {
        "old_log_prob": tuple(old_log_prob.shape),
        "log_prob": tuple(log_prob.shape),
        "advantages": tuple(advantages.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if rollout_is_weights is not None:
        shapes["rollout_is_weights"] = tuple(rollout_is_weights.shape)
    first = shapes["log_prob"]
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"policy loss inputs must share one [B, R] shape, got {shapes}")


def _clip_range(name: str, value: float | None, fallback: float | None) -> float:
    chosen = value if value is not None else fallback
    if chosen is None:
        raise ValueError(f"{name} is None and no clip_ratio to fall back on")
    if chosen < 0:
        raise ValueError(f"{name} must be >= 0, got {chosen}")
    return float(chosen)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float | None = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clipping and dual-clip.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)) and per token
        L1 = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L  = min(L1, -A * clip_ratio_c)   where A < 0   (dual-clip, Ye et al. 2020)
        L  = L1                           where A >= 0
    so for a negative advantage the loss never exceeds |A| * clip_ratio_c. ``clip_ratio_low`` /
    ``clip_ratio_high`` default to ``clip_ratio``; ``clip_ratio_c`` must be > 1.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower): pg_clipfrac = fraction of valid
    tokens where the clipped term is the larger one; ppo_kl = mean(old_log_prob - log_prob);
    pg_clipfrac_lower = fraction of valid tokens with A < 0 where the dual clip binds.
    """
    _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low = _clip_range("clip_ratio_low", clip_ratio_low, clip_ratio)
    high = _clip_range("clip_ratio_high", clip_ratio_high, clip_ratio)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)
    negative = advantages < 0
    pg_losses = torch.where(negative, loss_dual, loss_ppo)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_batch_info=global_batch_info)
    with torch.no_grad():
        pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
        dual_binds = (loss_ppo > -advantages * clip_ratio_c) & negative
        pg_clipfrac_lower = masked_mean(dual_binds.float(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level importance ratio.

    s_i = exp(mean over valid tokens of (log_prob - old_log_prob)) per sequence. Each token uses
    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], i.e. log s_{i,t} = sg[log s_i] + log_prob - sg[log_prob]
    (clamped at 10): its value is s_i on every token, and its gradient is s_i * grad log pi(y_t), so
    the token-mean of the gradients equals the gradient of s_i. Loss per token
    max(-A s, -A clip(s, 1 - clip_ratio_low, 1 + clip_ratio_high)).

    Clip ranges: ``clip_ratio_low`` / ``clip_ratio_high``, else ``clip_ratio``, else the paper's
    3e-4 / 4e-4 (GSPO_CLIP_RATIO_LOW / _HIGH). The objective is a mean over sequences, so (as in
    verl) the loss is always aggregated with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says;
    ``clip_ratio_c`` is accepted for the common signature and unused (GSPO has no dual clip), and
    pg_clipfrac_lower is 0.
    """
    del loss_agg_mode, clip_ratio_c
    _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low = _clip_range(
        "clip_ratio_low", clip_ratio_low, clip_ratio if clip_ratio is not None else GSPO_CLIP_RATIO_LOW
    )
    high = _clip_range(
        "clip_ratio_high", clip_ratio_high, clip_ratio if clip_ratio is not None else GSPO_CLIP_RATIO_HIGH
    )

    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1)  # [B]
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", global_batch_info=global_batch_info)
    with torch.no_grad():
        pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
        pg_clipfrac_lower = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower
