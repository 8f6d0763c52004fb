"""Rules of the batch layout (dataproto/BATCH_LAYOUT.md) that more than one builder applies, written once."""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of each token among its row's real tokens (``clamp(cumsum(mask) - 1, 0)``): 0 at the first
    real token whatever the left padding, and 0 on the padding before it."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
