"""The kernels that attend within the sequences of one packed row [1, heads, T, head_dim] (`attention.py` decides
the row is packed and reads its bounds; this module only attends).

* ``sdpa``: `attention_plan`'s calls of `scaled_dot_product_attention`, a sequence alone or short ones padded
  together. Fastest on the CPU (BENCHMARKS.md); on a GPU its many small calls were the slowest of the measured
  forms (the first H200 check: MFU 0.096 against 0.151 for a padded HF step).
* ``flex``: one FlexAttention call over the whole row with a block mask of its segments, compiled on CUDA. Blocks
  of 128 x 128 scores that no query may see are skipped, so the work is about the real scores; it takes every
  layout the engine packs: shared-prompt branches, sliding windows, grouped KV heads, fp32 or bf16. Torch has no
  FlexAttention backward on the CPU, so there it serves forward-only passes (and the tests).
* ``flash``: torch's variable-length FlashAttention (`torch.nn.attention.varlen.varlen_attn`), CUDA, bf16/fp16,
  plain segments only (no shared-prompt branches).

One rule says which key a query sees (`attends`), for the block mask here and the masks of `attention_plan`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

PACKED_KERNELS = ("auto", "sdpa", "flex", "flash")
FLEX_BLOCK = 128  # FlexAttention's default tile: the block mask's granularity


def resolve_packed_kernel(kernel: str, device: torch.device, trains: bool) -> str:
    """``model.packed_attention`` for an engine on ``device``: auto is sdpa on the CPU and flex on CUDA (the only
    CUDA form that takes shared prompts; which CUDA form is fastest is the GPU check's ``train_mfu`` step to
    measure). An explicit kernel the device cannot run is an error naming the key."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"model.packed_attention={kernel!r}; choose one of {list(PACKED_KERNELS)}")
    if kernel == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if kernel == "flash" and device.type != "cuda":
        raise ValueError(
            f"model.packed_attention='flash' trains on CUDA only: torch's varlen FlashAttention is CUDA only "
            f"(the engine is on {device.type}); use auto or sdpa"
        )
    if kernel == "flex" and device.type != "cuda" and trains:
        raise ValueError(
            "model.packed_attention='flex' trains on CUDA only: torch's FlexAttention has no CPU backward; use "
            "auto or sdpa"
        )
    return kernel


@dataclass(frozen=True)
class TokenLayout:
    """Per packed token: ``doc`` its segment, ``prompt_end`` where its segment's shared prompt ends (its own
    segment start when the segment shares nothing: it sees nothing by that clause) and ``branch_start`` where
    its own branch starts (the segment start for a prompt token or a plain sequence)."""

    doc: torch.Tensor
    prompt_end: torch.Tensor
    branch_start: torch.Tensor


def token_layout(
    bounds: tuple[int, ...], branches: tuple[tuple[int, ...], ...], width: int, pad_doc: int = -1
) -> TokenLayout:
    """The layout of a packed row of ``bounds`` (cumulative, [0, ..., T]) with per-segment ``branches`` (the
    lengths of a shared prompt's branches; empty or missing: a plain sequence), padded to ``width`` tokens
    whose segment is ``pad_doc`` and that see every key of it before them."""
    doc = torch.full((width,), pad_doc, dtype=torch.long)
    prompt_end = torch.zeros(width, dtype=torch.long)
    branch_start = torch.zeros(width, dtype=torch.long)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc[start:end] = i
        branch_start[start:end] = start
        prompt_end[start:end] = start
        lengths = branches[i] if i < len(branches) else ()
        if not lengths:
            continue
        prompt = end - start - sum(lengths)
        if prompt < 1 or min(lengths) < 1:
            raise ValueError(
                f"a shared-prompt segment of {end - start} tokens cannot hold branches {lengths}"
            )
        prompt_end[start:end] = start + prompt
        first = start + prompt
        for n in lengths:
            branch_start[first : first + n] = first
            first += n
    return TokenLayout(doc, prompt_end, branch_start)


def attends(layout: TokenLayout, window: int | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Whether query position ``q`` sees key position ``k`` (broadcasting index tensors): same segment, not in
    the future, in the shared prompt or the query's own branch, and within the sliding window if any."""
    seen = (layout.doc[q] == layout.doc[k]) & (k <= q)
    seen = seen & ((k < layout.prompt_end[q]) | (k >= layout.branch_start[q]))
    if window is not None:
        seen = seen & (q - k < window)
    return seen


def flex_layout(bounds: tuple[int, ...], branches: tuple[tuple[int, ...], ...], width: int) -> TokenLayout:
    """`token_layout` for FlexAttention's padded row: each padding token a segment of its own, so padding costs
    one diagonal block per block of it (and no query row is empty)."""
    layout = token_layout(bounds, branches, width)
    pad = width - bounds[-1]
    layout.doc[bounds[-1] :] = -1 - torch.arange(pad)
    return layout


# Rows of the mask evaluated at once while the block mask is built: bounded so a 32k-token row never holds its
# whole [T, T] mask.
_MASK_ELEMENTS_PER_CHUNK = 1 << 24


@functools.lru_cache(maxsize=8)
def packed_block_mask(
    bounds: tuple[int, ...],
    branches: tuple[tuple[int, ...], ...],
    window: int | None,
    device: str,
    block: int = FLEX_BLOCK,
):
    """FlexAttention's BlockMask of a packed row padded to a multiple of ``block``: per block of queries, the
    key blocks some query sees (partial: `attends` is applied in the kernel) and those every query sees (full:
    no mask work). Cached by value: every layer of a forward, and its backward, share the row's bounds."""
    from torch.nn.attention.flex_attention import BlockMask

    width = -(-bounds[-1] // block) * block
    layout = flex_layout(bounds, branches, width)
    layout = TokenLayout(*(t.to(device) for t in (layout.doc, layout.prompt_end, layout.branch_start)))
    positions = torch.arange(width, device=device)
    n = width // block
    rows = max(block, _MASK_ELEMENTS_PER_CHUNK // width // block * block)
    partial, full = [], []
    for start in range(0, width, rows):
        q = positions[start : start + rows]
        seen = attends(layout, window, q[:, None], positions[None, :]).view(-1, block, n, block)
        some, every = seen.any(3).any(1), seen.all(3).all(1)
        partial.append(some & ~every)
        full.append(every)

    def kv_tables(marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = marked.sum(1, dtype=torch.int32)
        order = torch.argsort((~marked).to(torch.int8), dim=1, stable=True).to(torch.int32)  # marked first
        return counts[None, None], order[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return attends(layout, window, q_idx, kv_idx)

    return BlockMask.from_kv_blocks(
        *kv_tables(torch.cat(partial)),
        *kv_tables(torch.cat(full)),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(width, width),
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # FlexAttention is only fused (and memory-light) when compiled; eager, it materialises the scores
    return torch.compile(flex_attention)


def flex_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[int, ...],
    branches: tuple[tuple[int, ...], ...],
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention over a packed row [1, heads, T, head_dim] as one FlexAttention call; [1, heads, T, head_dim]."""
    from torch.nn.attention.flex_attention import flex_attention

    total = query.shape[2]
    mask = packed_block_mask(bounds, branches, window, str(query.device))
    pad = mask.seq_lengths[0] - total
    if pad:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    attend = _compiled_flex() if query.is_cuda else flex_attention
    try:
        out = attend(
            query, key, value, block_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
    except Exception as e:  # a compile failure fails every micro-batch: say which setting to change
        raise RuntimeError(
            f"model.packed_attention=flex: FlexAttention failed on {query.device} ({type(e).__name__}: "
            f"{str(e)[:500]}); set model.packed_attention=sdpa (or flash on CUDA in bf16)"
        ) from e
    assert isinstance(out, torch.Tensor)  # no lse asked for
    return out[:, :, :total]


@functools.lru_cache(maxsize=8)
def _device_bounds(bounds: tuple[int, ...], device: str) -> torch.Tensor:
    """``bounds`` as int32 on ``device``: copied once per packed row, not once per layer."""
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def flash_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[int, ...],
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention over a packed row [1, heads, T, head_dim] by torch's varlen FlashAttention; [1, heads, T, hd]."""
    from torch.nn.attention.varlen import varlen_attn

    if query.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"model.packed_attention='flash' needs bf16 or fp16 attention inputs, got {query.dtype} (train with "
            "mixed precision, or use model.packed_attention=flex)"
        )
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim]
    extra: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:  # torch >= 2.13
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    cu = _device_bounds(bounds, str(q.device))
    longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
    # (left, right) keys each query sees: HF's window w admits q - k < w, i.e. w - 1 to the left; -1: all
    left = window - 1 if window is not None else -1
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(left, 0), **extra)
    assert isinstance(out, torch.Tensor)  # no aux asked for
    return out.transpose(0, 1).unsqueeze(0)
