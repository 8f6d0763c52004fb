"""Variable-length ("packed") causal attention for Hugging Face models on any device.

The engine removes padding and packs the sequences of a micro-batch into one row of shape [1, T] whose
`position_ids` restart at 0 for every sequence. Attention must then stay inside each sequence.

Hugging Face transformers (5.x) notices packed `position_ids` when `attention_mask is None` and builds a
dense block-diagonal [T, T] mask for `sdpa`/`eager`: correct, but the attention scores between *different*
sequences are still computed and then thrown away (for 8 sequences of 256 tokens, 7/8 of the score
matrix). `flash_attention_2` uses the varlen kernel, with no waste, but exists on CUDA only.

This module registers one more implementation, ``"hyflow_varlen"``, that runs
`scaled_dot_product_attention(is_causal=True)` on each sequence's slice: no score between two sequences is
ever computed and no [T, T] mask is built. Sequence boundaries come from the FlashAttention-style kwargs
``cu_seq_lens_q`` that the engine passes through the model forward, or else from the positions where
``position_ids == 0``. Anything else (a 2D padding mask, a KV cache, batch > 1) falls back to `sdpa`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

VARLEN_ATTENTION = "hyflow_varlen"


def _segment_bounds(kwargs: dict, total_len: int) -> list[int]:
    """Cumulative sequence boundaries [0, l0, l0+l1, ..., T] of the packed row."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = [int(x) for x in cu.tolist()]
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            return [0, total_len]
        starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist()
        bounds = sorted(set([0, *starts]))
        bounds.append(total_len)
    if bounds[0] != 0 or bounds[-1] != total_len:
        raise ValueError(
            f"workers/engine/attention.py: packed sequence boundaries {bounds[:3]}...{bounds[-2:]} do not cover "
            f"the {total_len} packed tokens"
        )
    return bounds


def varlen_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed row [1, heads, T, head_dim]; returns [1, T, heads, head_dim] like HF's sdpa."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    packed = (
        attention_mask is None
        and causal
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]
        and kwargs.get("output_attentions") is not True
    )
    if not packed:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    total = query.shape[2]
    bounds = _segment_bounds(kwargs, total)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        length = end - start
        if sliding_window is not None and length > sliding_window:
            idx = torch.arange(length, device=q.device)
            diff = idx[:, None] - idx[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
            )
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask is needed for packed rows without padding; with a padding mask, defer to sdpa's mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Register ``"hyflow_varlen"`` with transformers (idempotent); returns its name."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, varlen_mask)
    return VARLEN_ATTENTION


register_varlen_attention()
