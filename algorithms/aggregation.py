"""Loss aggregation: a [B, R] per-token loss matrix to one scalar, invariant to micro-batch layout.

Convention the training engine must follow (read this before calling ``agg_loss``)
----------------------------------------------------------------------------------
A *global batch* is everything that contributes to one optimizer step: one PPO mini-batch, across
all of its gradient-accumulation micro-batches and all data-parallel (DP) ranks.

1. Before the first micro-batch of a step, build ``global_batch_info`` once::

       info = make_global_batch_info(this_ranks_micro_batch_masks, dp_size=dp_size)
       # DP > 1: SUM-all-reduce info["global_tokens"] and info["global_seqs"] over the DP group
       # (each rank counted only its own rows), so that every rank holds the global counts.

   ``global_tokens`` = sum of the loss mask over the global batch (the number of valid tokens),
   ``global_seqs`` = number of rows of the global batch with at least one valid token,
   ``dp_size`` = size of the DP group that the gradients are reduced over.

2. For every micro-batch call ``agg_loss(loss_mat, loss_mask, mode, global_batch_info=info)`` and
   **sum** the results over micro-batches (``loss.backward()`` per micro-batch accumulates by
   summation; do *not* divide by the number of micro-batches).

3. Reduce gradients over DP with **AVG** (mean), which is what FSDP2 ``fully_shard``, DDP and
   Megatron do by default. ``agg_loss`` multiplies by ``dp_size`` so that the average over ranks
   is exactly the gradient of the loss over the global batch. An engine that SUMs gradients instead
   must pass ``dp_size=1``. The same rule holds for the logged loss value: the per-rank sum over
   micro-batches, AVG-reduced over DP, equals the full-batch loss.

   Megatron's pipeline schedule divides each micro-batch loss by ``num_microbatches`` (unless
   ``calculate_per_token_loss``); an engine using it must multiply that back. ``dp_size`` is the size
   of the group gradients are averaged over (DP x CP with context parallelism, where ``token-mean``
   stays exact but the ``seq-mean-*`` modes need each sequence's tokens on one rank).

With this convention, the summed value and the gradient equal those of a single call
``agg_loss(full_loss_mat, full_mask, mode)`` (no ``global_batch_info``, local normalisation) over
the whole global batch on one process, for every mode and every split of rows into micro-batches
and ranks. Without ``global_batch_info`` the counts are the local (this call's) ones, ``dp_size``
is 1, and the result is the plain mean for this call alone.

Modes (m = mask, l = loss, T = global_tokens, S = global_seqs, d = dp_size, L = loss_scale_factor)
    ``token-mean``               d * sum_{i,t} m l / T
    ``seq-mean-token-sum``       d * sum_i (sum_t m l) / S
    ``seq-mean-token-mean``      d * sum_{i: sum_t m > 0} (sum_t m l / sum_t m) / S
    ``seq-mean-token-sum-norm``  d * sum_{i,t} m l / (S * L)   (Dr. GRPO); L defaults to R =
                                 ``loss_mask.shape[-1]``, which must then be the same in every
                                 micro-batch (row splits of one [B, R] batch are); pass a constant
                                 ``loss_scale_factor`` (e.g. the max response length) otherwise.
Rows whose mask is all zero contribute nothing and are not counted in S. A zero count gives 0.

Note on ``seq-mean-token-sum-norm``: verl's current ``agg_loss`` returns sum/L without dividing by
the number of sequences (its legacy actor then scaled by micro/mini batch size); hyflow divides by
S inside, which equals verl's legacy effective loss and keeps the learning rate independent of the
batch size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from algorithms.masked import masked_sum

__all__ = ["LOSS_AGG_MODES", "GLOBAL_BATCH_INFO_KEYS", "agg_loss", "make_global_batch_info"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GLOBAL_BATCH_INFO_KEYS = ("global_tokens", "global_seqs", "dp_size", "loss_scale_factor")
# verl's names for the same quantities, accepted so ported configs keep working.
_ALIASES = {"batch_num_tokens": "global_tokens", "global_batch_size": "global_seqs"}


def _normalise_info(info: Mapping[str, Any] | None) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise TypeError(f"global_batch_info must be a mapping or None, got {type(info).__name__}")
    out: dict[str, Any] = {}
    for key, value in info.items():
        name = _ALIASES.get(key, key)
        if name not in GLOBAL_BATCH_INFO_KEYS:
            raise ValueError(
                f"global_batch_info has unknown key {key!r}; accepted: {list(GLOBAL_BATCH_INFO_KEYS)} "
                f"(aliases: {_ALIASES})"
            )
        if value is None:
            continue
        if name in out:
            raise ValueError(f"global_batch_info gives {name!r} twice (directly and through an alias)")
        out[name] = value
    dp = out.get("dp_size", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"global_batch_info['dp_size'] must be an int >= 1, got {dp!r}")
    return out


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return num / torch.where(den > 0, den, torch.ones_like(den))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, R] under ``loss_mask`` [B, R] into a scalar tensor.

    See the module docstring for the formulas and for the micro-batch / data-parallel convention:
    pass the same ``global_batch_info`` (``global_tokens``, ``global_seqs``, ``dp_size``, optional
    ``loss_scale_factor``; verl's ``batch_num_tokens`` / ``global_batch_size`` are aliases) to every
    micro-batch call, SUM the results over micro-batches and AVG gradients over DP ranks.
    When ``global_batch_info`` is given it must hold the count the mode needs (``global_tokens``
    for ``token-mean``, ``global_seqs`` for the ``seq-mean-*`` modes); it is never silently
    replaced by a local count. ``loss_scale_factor`` (argument or key) is used by
    ``seq-mean-token-sum-norm`` only.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")
    if loss_mat.dim() != 2 or loss_mask.shape != loss_mat.shape:
        raise ValueError(
            f"loss_mat and loss_mask must both be [B, R]; got {tuple(loss_mat.shape)} and {tuple(loss_mask.shape)}"
        )
    info = _normalise_info(global_batch_info)
    is_global = global_batch_info is not None
    dp_size = info.get("dp_size", 1)
    if loss_scale_factor is not None and "loss_scale_factor" in info:
        raise ValueError("loss_scale_factor given both as an argument and in global_batch_info")
    scale = loss_scale_factor if loss_scale_factor is not None else info.get("loss_scale_factor")

    def count(key: str, local: torch.Tensor) -> torch.Tensor:
        if not is_global:
            return local
        if key not in info:
            raise ValueError(
                f"global_batch_info lacks {key!r}, needed by loss_agg_mode={loss_agg_mode!r} "
                f"(has {sorted(info)})"
            )
        return torch.as_tensor(info[key], dtype=loss_mat.dtype, device=loss_mat.device)

    weight = loss_mask.to(loss_mat.dtype)
    seq_tokens = weight.sum(dim=-1)  # [B]
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)  # [B]
    if loss_agg_mode == "token-mean":
        loss = _safe_div(seq_sums.sum(), count("global_tokens", seq_tokens.sum()))
    else:
        n_seqs = count("global_seqs", (seq_tokens > 0).to(loss_mat.dtype).sum())
        if loss_agg_mode == "seq-mean-token-sum":
            loss = _safe_div(seq_sums.sum(), n_seqs)
        elif loss_agg_mode == "seq-mean-token-mean":
            loss = _safe_div(_safe_div(seq_sums, seq_tokens).sum(), n_seqs)
        else:  # seq-mean-token-sum-norm
            norm = float(loss_mask.shape[-1]) if scale is None else float(scale)
            if norm <= 0:
                raise ValueError(f"loss_scale_factor must be > 0, got {scale!r}")
            loss = _safe_div(seq_sums.sum(), n_seqs) / norm
    return loss * dp_size


def make_global_batch_info(
    loss_masks: torch.Tensor | Iterable[torch.Tensor], dp_size: int = 1
) -> dict[str, float | int]:
    """Counts for ``agg_loss`` from the loss masks of the micro-batches this process holds.

    Returns ``{"global_tokens": float, "global_seqs": int, "dp_size": dp_size}``. With one process
    the masks are the whole global batch and the dict is ready to use. With ``dp_size > 1`` each rank
    counts only its own rows: SUM-all-reduce ``global_tokens`` and ``global_seqs`` over the DP group
    before passing the dict to ``agg_loss``.
    """
    if isinstance(loss_masks, torch.Tensor):
        loss_masks = [loss_masks]
    tokens = 0.0
    seqs = 0
    for mask in loss_masks:
        if mask.dim() != 2:
            raise ValueError(f"each loss mask must be [B, R], got shape {tuple(mask.shape)}")
        w = mask.to(torch.float64)
        tokens += float(w.sum())
        seqs += int((w.sum(dim=-1) > 0).sum())
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    return {"global_tokens": tokens, "global_seqs": seqs, "dp_size": dp_size}
