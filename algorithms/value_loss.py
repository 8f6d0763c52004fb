"""Critic loss: PPO's clipped value loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from algorithms.aggregation import agg_loss
from algorithms.masked import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)).

    ``vpreds`` are the critic's current predictions (with gradient), ``values`` the predictions
    at rollout time, ``returns`` the targets G, all [B, R]; c = ``cliprange_value`` (>= 0).
    Aggregated by ``agg_loss`` (``global_batch_info`` passed through; see ``algorithms.aggregation``).
    Returns (vf_loss, vf_clipfrac), vf_clipfrac = detached fraction of valid tokens where the
    clipped term is the larger one.
    """
    shapes = {
        n: tuple(t.shape)
        for n, t in dict(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask).items()
    }
    if len(set(shapes.values())) != 1 or len(shapes["vpreds"]) != 2:
        raise ValueError(f"value loss inputs must share one [B, R] shape, got {shapes}")
    if cliprange_value is None or cliprange_value < 0:
        raise ValueError(f"cliprange_value must be a number >= 0, got {cliprange_value!r}")
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, global_batch_info=global_batch_info)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
