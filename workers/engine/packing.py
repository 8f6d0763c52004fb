"""Padding removal, sequence packing, token-budget micro-batching and log-prob math.

Pure tensor code (no model, no process group), so each piece has a direct unit test.

Layout (dataproto/BATCH_LAYOUT.md): ``input_ids``/``attention_mask`` are [B, P+R] with prompts left-padded and
responses right-padded; ``responses`` is [B, R]. The token at padded position ``P + j`` (response token j) is
predicted by the logits at position ``P + j - 1``. A packed micro-batch is one row holding only the real tokens of
its sequences, one after another, with ``position_ids`` restarting at 0 for each sequence.

With ``share_prompts`` the rows of a micro-batch that share a prompt (a GRPO group's samples) become one segment:
the prompt once, then each row's response as a branch that attends to the prompt and to itself only
(``workers/models/attention.py``), at the positions it has in its own row. Each row's log-probs are the same
numbers, and the prompt's forward and backward run once for the group instead of once per sample. A token
budget (``plan_micro_batches(prompt_groups=...)``) then keeps a group in one micro-batch and counts its prompt
once.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# Balanced partitioning
# ----------------------------------------------------------------------------------------------------------------


def karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Split item indices into ``k`` groups with nearly equal weight sums (largest differencing method).

    Each item starts as a k-tuple of groups (itself in one group, the others empty). Repeatedly the two tuples
    with the largest spread (max sum - min sum) are merged by pairing the heaviest group of one with the
    lightest group of the other, which cancels their differences. Returns k lists of indices (some may be
    empty when there are fewer items than groups), each sorted ascending.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    if not weights:
        return [[] for _ in range(k)]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, (i, w) in enumerate(sorted(enumerate(weights), key=lambda x: (-x[1], x[0]))):
        groups = [(w, [i])] + [(0, []) for _ in range(k - 1)]
        # heap key: -spread (largest first); counter breaks ties deterministically
        heapq.heappush(heap, (-w, counter, groups))
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a_sorted = sorted(a, key=lambda g: -g[0])  # heaviest first
        b_sorted = sorted(b, key=lambda g: g[0])  # lightest first
        merged = [(ga[0] + gb[0], ga[1] + gb[1]) for ga, gb in zip(a_sorted, b_sorted)]
        sums = [g[0] for g in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), counter, merged))
        counter += 1
    groups = heap[0][2]
    parts = [sorted(g[1]) for g in groups]
    # deterministic order: heaviest group first, ties by first index
    parts.sort(key=lambda p: (-sum(weights[i] for i in p), p[0] if p else math.inf))
    return parts


def plan_micro_batches(
    lengths: list[int],
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    min_num_micro_batches: int = 1,
    prompt_groups: list[tuple[int, list[int]]] | None = None,
) -> list[list[int]]:
    """Row indices of each micro-batch.

    - ``max_token_len`` (dynamic batch size): the fewest micro-batches (at least ``min_num_micro_batches``)
      such that a Karmarkar-Karp split of the rows by token count keeps every micro-batch within
      ``max_token_len`` tokens. A single row longer than the budget is an error.
      With ``prompt_groups`` (``[(prompt tokens, rows)]``, from ``group_rows_by_prompt``: rows that
      ``pack_sequences(share_prompts=True)`` packs with one copy of their prompt) the split is of groups: a
      group stays in one micro-batch and its prompt counts once against the budget. A group that does not
      fit is cut into as few pieces as fit, each paying for the prompt. (Splitting rows instead would
      scatter a GRPO group over the micro-batches and recompute its prompt in each.)
    - else ``micro_batch_size`` rows per micro-batch in order (the last may be smaller); with
      ``min_num_micro_batches`` larger than that count, the rows are spread over that many groups.
    - neither: one micro-batch with every row.

    Micro-batches may be empty only when ``min_num_micro_batches`` exceeds the number of rows (DP ranks
    must run the same number of forward passes; the engine runs an empty micro-batch as a dummy pass).
    """
    n = len(lengths)
    if max_token_len is not None:
        if max_token_len < 1:
            raise ValueError(f"max_token_len must be >= 1, got {max_token_len}")
        longest = max(lengths, default=0)
        if longest > max_token_len:
            raise ValueError(
                f"max_token_len={max_token_len} is smaller than the longest sequence ({longest} tokens); "
                "raise max_token_len (it must be >= prompt + response length)"
            )
        items = [[i] for i in range(n)]
        weights = list(lengths)
        if prompt_groups is not None:
            items, weights = _group_pieces(lengths, prompt_groups, max_token_len)
        k = max(min_num_micro_batches, math.ceil(sum(weights) / max_token_len), 1)
        if k > len(items):  # more micro-batches than pieces (DP ranks in step): split the rows instead
            items, weights = [[i] for i in range(n)], list(lengths)
        while True:
            parts = karmarkar_karp(weights, k)
            if all(sum(weights[j] for j in p) <= max_token_len for p in parts) or k >= len(items):
                break
            k += 1
        return [sorted(i for j in p for i in items[j]) for p in parts]
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        k = max(math.ceil(n / micro_batch_size), 1)
        if k >= min_num_micro_batches:
            return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)] or [
                []
            ]
        k = min_num_micro_batches
    else:
        k = min_num_micro_batches
    # spread n rows over k groups in order, sizes differing by at most one
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def _group_pieces(
    lengths: list[int], prompt_groups: list[tuple[int, list[int]]], max_token_len: int
) -> tuple[list[list[int]], list[int]]:
    """The groups cut into pieces within ``max_token_len`` (rows in order), and each piece's packed tokens:
    the prompt once plus its rows' responses."""
    if sorted(i for _, rows in prompt_groups for i in rows) != list(range(len(lengths))):
        raise ValueError(f"prompt_groups must hold each of the {len(lengths)} rows exactly once")
    pieces: list[list[int]] = []
    weights: list[int] = []
    for prompt, rows in prompt_groups:
        piece: list[int] = []
        tokens = prompt
        for i in rows:
            response = lengths[i] - prompt
            if piece and tokens + response > max_token_len:
                pieces.append(piece)
                weights.append(tokens)
                piece, tokens = [], prompt
            piece.append(i)
            tokens += response
        pieces.append(piece)
        weights.append(tokens)
    return pieces, weights


def restore_order(chunks: list[torch.Tensor], parts: list[list[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch results (rows in ``parts`` order) back into the original row order."""
    order = [i for p in parts for i in p]
    cat = torch.cat([c for c, p in zip(chunks, parts) if p], dim=0)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return cat[inverse.to(cat.device)]


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """One micro-batch with padding removed, ready for ``model(input_ids, position_ids, ...)``."""

    input_ids: torch.Tensor  # [1, T] real tokens of all sequences, back to back
    position_ids: torch.Tensor  # [1, T] 0..len-1 for each sequence
    # (0, l0, l0+l1, ..., T): the segments' cumulative lengths, on the host, so attention never reads them back from
    # the device (a device sync in every layer)
    bounds: tuple[int, ...]
    keep_index: torch.Tensor  # [n] packed positions whose logits predict a real response token
    labels: torch.Tensor  # [n] the response tokens those logits predict
    response_valid: torch.Tensor  # [b, R] bool, True on real response tokens (attention_mask of the response)
    # per segment, the lengths of its shared-prompt branches (() for a plain sequence); None: no shared prompts
    branches: tuple[tuple[int, ...], ...] | None = None
    # [T] each packed token's place in the micro-batch's [b, P+R] tensors, flattened (row * (P+R) + column): a
    # per-token column (the rollout's expert routes) packs as column.flatten(0, 1)[source_index]
    source_index: torch.Tensor | None = None
    # [b, P+R] the packed index of each real token of the micro-batch (a shared prompt's rows all point at its one
    # copy), -1 on padding: the way back from packed order
    packed_index: torch.Tensor | None = None

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[segments + 1] int32 ``bounds`` on the batch's device (FlashAttention's varlen metadata)."""
        return torch.tensor(self.bounds, dtype=torch.int32, device=self.input_ids.device)

    @property
    def max_seqlen(self) -> int:
        return max((e - s for s, e in zip(self.bounds[:-1], self.bounds[1:])), default=0)

    def pack_column(self, column: torch.Tensor) -> torch.Tensor:
        """A per-token ``[b, P+R, ...]`` column of the micro-batch in packed order, ``[T, ...]``."""
        assert self.source_index is not None
        return column.flatten(0, 1).index_select(0, self.source_index.to(column.device))

    def unpack_column(self, values: torch.Tensor, fill: float | int) -> torch.Tensor:
        """Packed ``[T, ...]`` values back to the micro-batch's ``[b, P+R, ...]`` layout, ``fill`` on padding."""
        assert self.packed_index is not None
        index = self.packed_index.to(values.device)
        real = index >= 0
        out = values.new_full((*index.shape, *values.shape[1:]), fill)
        out[real] = values.index_select(0, index[real])
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self, kernel: str | None = None) -> dict:
        """Keyword arguments for an HF forward: no 2D mask, no cache, FlashAttention-style varlen metadata (and
        the shared-prompt branches and the packed-attention ``kernel``, which only ``hyflow_varlen`` reads)."""
        cu, longest = self.cu_seqlens, self.max_seqlen
        kwargs: dict[str, Any] = dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
        if self.branches is not None:
            kwargs["hyflow_branches"] = self.branches
        if kernel is not None:
            kwargs["hyflow_kernel"] = kernel
            kwargs["hyflow_bounds"] = self.bounds
        return kwargs


def group_rows_by_prompt(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
) -> dict[tuple[int, ...], list[int]]:
    """Rows with the same real prompt tokens (the first ``prompt_len`` columns, padding left out), in order of
    first appearance: prompt tokens -> row indices."""
    groups: dict[tuple[int, ...], list[int]] = {}
    real = attention_mask[:, :prompt_len].bool().tolist()
    for i, (ids, keep) in enumerate(zip(input_ids[:, :prompt_len].tolist(), real)):
        groups.setdefault(tuple(t for t, m in zip(ids, keep) if m), []).append(i)
    return groups


def pack_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, share_prompts: bool = False
) -> PackedBatch:
    """Remove padding from [b, P+R] ``input_ids`` and pack the b sequences into one row.

    Every response token j of row i with ``attention_mask[i, P+j] == 1`` must be preceded by a real token
    (a non-empty prompt), since its log-prob comes from the logits at ``P + j - 1``. ``share_prompts``: rows
    with the same prompt tokens share one copy of them (see the module docstring).
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    b, total = input_ids.shape
    prompt_len = total - response_length
    if prompt_len < 1:
        raise ValueError(f"response length {response_length} leaves no prompt in input_ids of width {total}")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    if b and int(lengths.min()) == 0:
        raise ValueError("a row of the micro-batch has no real token (attention_mask all zero)")
    cum = mask.long().cumsum(dim=1)  # 1-based index of each real token within its row
    offsets = torch.zeros(b, dtype=torch.long, device=input_ids.device)
    if b > 1:
        offsets[1:] = lengths.cumsum(0)[:-1]
    flat_ids = input_ids[mask]
    positions = (cum - 1)[mask]
    response_valid = mask[:, prompt_len:]
    pred_pos = (
        cum[:, prompt_len - 1 : total - 1] - 1 + offsets[:, None]
    )  # packed index of the predicting token
    if bool((response_valid & ~mask[:, prompt_len - 1 : total - 1]).any()):
        raise ValueError(
            "a response token follows a padding position (empty prompt, or a response that is not right-padded); "
            "cannot compute its log-prob"
        )
    keep_index = pred_pos[response_valid]
    labels = input_ids[:, prompt_len:][response_valid]
    if share_prompts:
        shared = _share_prompts(input_ids, mask, prompt_len, response_valid, labels, total)
        if shared is not None:
            return shared
    return PackedBatch(
        input_ids=flat_ids[None],
        position_ids=positions[None],
        bounds=(0, *lengths.cumsum(0).tolist()),
        keep_index=keep_index,
        labels=labels,
        response_valid=response_valid,
        source_index=mask.flatten().nonzero()[:, 0],
        packed_index=torch.where(mask, cum - 1 + offsets[:, None], -1),
    )


def _share_prompts(
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt_len: int,
    response_valid: torch.Tensor,
    labels: torch.Tensor,
    width: int,
) -> PackedBatch | None:
    """``pack_sequences`` with one segment per distinct prompt: its tokens, then each of its rows' responses as
    branches. None when no two rows share a prompt (the plain packing is the same then)."""
    groups = group_rows_by_prompt(input_ids, mask, prompt_len)
    if len(groups) == len(input_ids):
        return None
    # a row's real response tokens are a prefix of its response (pack_sequences checked that each follows a real
    # token): its branch
    device = input_ids.device
    lens = response_valid.sum(dim=1).tolist()
    responses = input_ids[:, prompt_len:]
    pieces, positions, bounds, branches, sources = [], [], [0], [], []
    packed_index = torch.full(mask.shape, -1, dtype=torch.long, device=device)
    first_pred = [0] * len(input_ids)  # packed position predicting each row's first response token
    branch_at = [0] * len(input_ids)  # packed position of each row's first response token
    for prompt, rows in groups.items():
        p, start = len(prompt), bounds[-1]
        pieces.append(torch.tensor(prompt, dtype=input_ids.dtype, device=device))
        positions.append(torch.arange(p, device=device))
        prompt_cols = mask[rows[0], :prompt_len].nonzero()[:, 0]
        sources.append(rows[0] * width + prompt_cols)
        offset = start + p
        for i in rows:
            packed_index[i, prompt_cols] = torch.arange(start, start + p, device=device)
            packed_index[i, prompt_len : prompt_len + lens[i]] = torch.arange(
                offset, offset + lens[i], device=device
            )
            first_pred[i], branch_at[i] = start + p - 1, offset
            pieces.append(responses[i, : lens[i]])
            positions.append(torch.arange(p, p + lens[i], device=device))
            sources.append(i * width + torch.arange(prompt_len, prompt_len + lens[i], device=device))
            offset += lens[i]
        bounds.append(offset)
        # a branch of no tokens is no branch; a lone row is a plain sequence
        branches.append(tuple(lens[i] for i in rows if lens[i]) if len(rows) > 1 else ())
    # response token j of row i is predicted by the token before it: the prompt's last for j = 0
    keep = [
        first_pred[i] if j == 0 else branch_at[i] + j - 1
        for i in range(len(input_ids))
        for j in range(lens[i])
    ]
    return PackedBatch(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None],
        bounds=tuple(bounds),
        keep_index=torch.tensor(keep, dtype=torch.long, device=device),
        labels=labels,
        response_valid=response_valid,
        branches=tuple(branches),
        source_index=torch.cat(sources),
        packed_index=packed_index,
    )


def scatter_response(values: torch.Tensor, response_valid: torch.Tensor) -> torch.Tensor:
    """Place [n] values of the real response tokens into a zero [b, R] tensor (differentiable)."""
    out = values.new_zeros(response_valid.shape)
    return out.masked_scatter(response_valid, values)


# ----------------------------------------------------------------------------------------------------------------
# Log-probs and entropy
# ----------------------------------------------------------------------------------------------------------------


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] in fp32; logits [..., V], labels [...]. The unfused reference of the tests: the
    engines compute log-probs with workers/engine/vocab_head.py, never from a whole [tokens x vocab] tensor."""
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) in fp32: logsumexp(l) - sum(p * l). The tests' reference (and the Megatron
    engine's, over its gathered logits)."""
    logits = logits.float()
    p = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def padded_response_log_probs(
    logits: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference path: log-probs of ``responses`` [B, R] from the logits of a padded forward [B, P+R, V]."""
    r = responses.shape[1]
    resp_logits = logits[:, -r - 1 : -1].float() / temperature
    return log_probs_from_logits(resp_logits, responses)
