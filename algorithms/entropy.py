"""Token entropy and the entropy-bonus loss term."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from algorithms.aggregation import agg_loss

__all__ = ["entropy_from_logits", "compute_entropy_loss"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) * z). [..., V] -> [...]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor | None,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregated entropy of the policy over response tokens (to be *subtracted*, times a coefficient).

    Give either ``logits`` [B, R, V] or precomputed per-token ``entropy`` [B, R] (the ``entropys``
    batch key), not both. The actor's loss is ``pg_loss - entropy_coeff * entropy_loss``; aggregate
    with the same ``loss_agg_mode`` / ``global_batch_info`` as ``pg_loss`` so the bonus obeys the
    same micro-batch convention.
    """
    if logits is not None and entropy is None:
        entropy = entropy_from_logits(logits)
    elif logits is not None or entropy is None:
        raise ValueError("compute_entropy_loss needs exactly one of logits [B, R, V] or entropy [B, R]")
    return agg_loss(entropy, response_mask, loss_agg_mode, global_batch_info=global_batch_info)
