"""Variable-length ("packed") causal attention for Hugging Face models on any device.

The engine removes padding and packs the sequences of a micro-batch into one row of shape [1, T] whose
`position_ids` restart at 0 for every sequence. Attention must then stay inside each sequence.

Hugging Face transformers (5.x) notices packed `position_ids` when `attention_mask is None` and builds a
dense block-diagonal [T, T] mask for `sdpa`/`eager`: correct, but the attention scores between *different*
sequences are still computed and then thrown away (for 8 sequences of 256 tokens, 7/8 of the score
matrix). `flash_attention_2` uses the varlen kernel, with no waste, but exists on CUDA only.

This module registers one more implementation, ``"hyflow_varlen"``, in which no score between two sequences
is ever computed and no [T, T] mask is built: a long sequence gets `scaled_dot_product_attention(is_causal=True)`
on its own slice; short ones (a call per sequence would cost more than its math, forward and backward) are
gathered into one padded [n, heads, L, head_dim] call with a causal mask over each one's real keys, as long as
the padding stays small (`attention_plan`). Sequence boundaries come from the FlashAttention-style kwargs
``cu_seq_lens_q`` that the engine passes through the model forward, or else from the positions where
``position_ids == 0``. Anything else (a 2D padding mask, a KV cache, batch > 1) falls back to `sdpa`.

Shared prompts (``hyflow_branches``, from `workers.engine.packing.pack_sequences(share_prompts=True)`): a segment
may hold one prompt followed by several responses to it (a GRPO group), each response a *branch* that sees the
prompt and itself but no other branch, so the prompt is computed once for the whole group. ``hyflow_branches``
holds, per segment, the lengths of its branches (empty for a plain sequence).

Which kernel attends a packed row is the engine's ``model.packed_attention``, passed as ``hyflow_kernel``:
``sdpa`` (the calls above; the CPU's), ``flex`` (one FlexAttention call over a block mask, CUDA's default) or
``flash`` (torch's varlen FlashAttention); `workers/models/packed_kernels.py` says what each takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from workers.models.packed_kernels import attends, flash_packed, flex_packed, token_layout

VARLEN_ATTENTION = "hyflow_varlen"


def _segment_bounds(kwargs: dict, total_len: int, host: tuple[int, ...] | None = None) -> list[int]:
    """Cumulative sequence boundaries [0, l0, l0+l1, ..., T] of the packed row: ``host``, the engine's copy
    (``hyflow_bounds``), else read back from ``cu_seq_lens_q`` or the positions (a device sync on a GPU)."""
    cu = kwargs.get("cu_seq_lens_q")
    if host is not None:
        bounds = list(host)
    elif cu is not None:
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
            f"workers/models/attention.py: packed sequence boundaries {bounds[:3]}...{bounds[-2:]} do not cover "
            f"the {total_len} packed tokens"
        )
    return bounds


# Compiled layers (model.compile) run it eagerly: its plan is read from the packed sequences' bounds (host data,
# cached by value), which a traced graph could not follow.
@torch.compiler.disable
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
    branches = kwargs.pop("hyflow_branches", None) or ()
    # one of packed_kernels.PACKED_KERNELS, resolved by the engine (model.packed_attention)
    kernel = kwargs.pop("hyflow_kernel", None) or "sdpa"
    host_bounds = kwargs.pop("hyflow_bounds", None)
    packed = (
        attention_mask is None
        and causal
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]
        and kwargs.get("output_attentions") is not True
    )
    if not packed:
        if any(branches):  # sdpa would let each response see its siblings: wrong, so refuse
            raise ValueError(
                "workers/models/attention.py: shared-prompt segments (hyflow_branches) need a packed row "
                "without a padding mask or KV cache"
            )
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
    bounds = tuple(_segment_bounds(kwargs, total, host_bounds))
    if kernel != "sdpa" and dropout:
        raise ValueError(
            f"model.packed_attention={kernel!r} has no attention dropout (the model asks {dropout})"
        )
    if kernel == "flex":
        out = flex_packed(query, key, value, bounds, tuple(branches), sliding_window, scaling)
        return out.transpose(1, 2).contiguous(), None
    if kernel == "flash":
        if any(branches):
            raise ValueError(
                "workers/models/attention.py: model.packed_attention='flash' cannot attend shared-prompt "
                "branches (the engine turns share_prompts off for it)"
            )
        out = flash_packed(query, key, value, bounds, sliding_window, scaling)
        return out.transpose(1, 2).contiguous(), None
    plan = attention_plan(bounds, sliding_window, tuple(branches))
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for group in plan.groups:
        if group.index is None:  # one sequence: its slice, plain causal attention
            start, end = group.span
            o = F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                dropout_p=dropout,
                scale=scaling,
                is_causal=True,
                enable_gqa=gqa,
            )
            outs.append(o[0])
            continue
        # several sequences padded to the longest: [n, heads, L, head_dim], one call, then the real tokens
        assert group.valid is not None and group.mask is not None  # attention_plan sets them with index
        index, valid, mask = (t.to(query.device) for t in (group.index, group.valid, group.mask))
        q, k, v = (x[0][:, index].transpose(0, 1) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
        outs.append(o.transpose(0, 1)[:, valid])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if plan.restore is not None:
        out = out.index_select(1, plan.restore.to(out.device))
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


# A group's padded score matrix (count x longest^2) may be at most this many times its real one (sum of
# length^2), and hold at most this many entries per head beyond a single sequence's own.
MAX_PADDING_RATIO = 2.0
MAX_GROUP_SCORES = 1 << 22


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one call: ``span`` (start, end) of a single plain sequence (``index`` None), or
    ``index`` [n, L] packed positions of n segments padded to the longest L (padding repeats a segment's
    first position), ``valid`` [n, L] the real ones and ``mask`` [n, 1, L, L] over real keys: causal, and for
    a segment of shared-prompt branches, each branch's tokens see the prompt and their own branch only."""

    span: tuple[int, int]
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionPlan:
    groups: list[AttentionGroup]
    restore: torch.Tensor | None  # packed order of the groups' concatenated outputs; None: already in order


def segment_mask(length: int, branch_lengths: tuple[int, ...], width: int) -> torch.Tensor:
    """[width, width] bool: query q may attend key k of a segment of ``length`` tokens (padded to ``width``, the
    padding seeing every key before it) -- k <= q, and with ``branch_lengths`` (a shared prompt then its
    branches) k is in the prompt or in q's own branch (`packed_kernels.attends`)."""
    layout = token_layout((0, length), (branch_lengths,), width, pad_doc=0)
    steps = torch.arange(width)
    return attends(layout, None, steps[:, None], steps[None, :])


@functools.lru_cache(maxsize=16)
def attention_plan(
    bounds: tuple[int, ...], sliding_window: int | None = None, branches: tuple[tuple[int, ...], ...] = ()
) -> AttentionPlan:
    """How to attend within the sequences of one packed row: one call per sequence costs a kernel launch and
    its autograd node each, which dominates for many short sequences (RL responses of a few dozen tokens), so
    sequences are batched, longest first, into padded calls while the padding stays within
    ``MAX_PADDING_RATIO``. ``branches``: per segment, the lengths of its shared-prompt branches (empty or
    missing: a plain causal sequence). Cached: every layer of a forward (and its backward) sees the same
    boundaries."""
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    branches = branches + ((),) * (len(lengths) - len(branches))
    if sliding_window is not None and any(branches):
        raise ValueError("workers/models/attention.py: shared-prompt segments with sliding-window attention")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    members: list[list[int]] = []
    for i in order:
        if members:
            group = members[-1]
            longest, count = lengths[group[0]], len(group) + 1
            real = sum(lengths[j] ** 2 for j in group) + lengths[i] ** 2
            if count * longest**2 <= MAX_PADDING_RATIO * real and count * longest**2 <= MAX_GROUP_SCORES:
                group.append(i)
                continue
        members.append([i])
    groups, positions = [], []
    for group in members:
        starts = torch.tensor([bounds[i] for i in group])
        lens = torch.tensor([lengths[i] for i in group])
        plain = not branches[group[0]]
        if len(group) == 1 and plain and (sliding_window is None or lengths[group[0]] <= sliding_window):
            groups.append(AttentionGroup(span=(bounds[group[0]], bounds[group[0] + 1])))
            positions.append(torch.arange(bounds[group[0]], bounds[group[0] + 1]))
            continue
        longest = int(lens[0])
        steps = torch.arange(longest)
        valid = steps[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + steps[None, :], starts[:, None])
        allowed = torch.stack([segment_mask(lengths[i], branches[i], longest) for i in group])
        if sliding_window is not None:
            allowed &= (steps[:, None] - steps[None, :] < sliding_window)[None]
        mask = (allowed & valid[:, None, :]).unsqueeze(1)
        groups.append(AttentionGroup(span=(0, 0), index=index, valid=valid, mask=mask))
        positions.append(index[valid])
    order_out = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    in_order = bool((order_out == torch.arange(len(order_out))).all())
    return AttentionPlan(groups, None if in_order else torch.argsort(order_out))


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask is needed for packed rows without padding; with a padding mask, defer to sdpa's mask."""
    if attention_mask is None:
        return None
    kwargs["attention_mask"] = attention_mask  # still by keyword; mypy cannot tell *args stops short of it
    return sdpa_mask(*args, **kwargs)


def register_varlen_attention() -> str:
    """Register ``"hyflow_varlen"`` with transformers (idempotent); returns its name."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, varlen_mask)
    return VARLEN_ATTENTION


register_varlen_attention()
