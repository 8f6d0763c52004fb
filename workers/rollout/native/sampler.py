"""Batched token sampling with per-row settings and per-request random streams.

One call samples a token for every row of a ``[B, vocab]`` float32 logits matrix, each row with its own
temperature, top-k, top-p and uniform random number:

* temperature 0 rows take ``argmax(logits)`` (first index on ties, as HF greedy search does);
* other rows sample by inverse CDF (in vocabulary order) from ``p = softmax(logits / T)`` restricted to
  the tokens with ``p >= kth largest p`` (top-k; ties at the k-th value are kept, as in HF's
  ``TopKLogitsWarper``) and then to the tokens with ``p >=`` the smallest probability of the nucleus (the
  shortest highest-first prefix whose mass reaches ``top_p`` of what top-k left; ties kept). Both cuts
  are thresholds on values, so a row's result never depends on the other rows or on tie ordering.

The uniform number of a row comes from its request's own ``random.Random`` stream, so a seeded request
draws the same tokens whatever else is in the batch (one Python float per row per step, no per-row torch
calls).

Reported log-prob of a sampled token: ``log_softmax(logits / T)[token]`` over the **full** vocabulary,
i.e. the temperature-scaled distribution *before* top-k/top-p truncation, the quantity the trainer
recomputes; greedy rows (T = 0) report ``log_softmax(logits)[token]`` (temperature 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Top-p without top-k first looks for the nucleus among this many most likely tokens (one topk call) and
# sorts the whole vocabulary only for rows whose nucleus is larger.
NUCLEUS_CANDIDATES = 256
_U_MAX = 1.0 - 1e-6  # keeps u * total strictly below the total mass in float32


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` -> (argmax tokens [B], their log_softmax [B]) in two passes over the logits: ``max``
    returns the first index on ties, as ``argmax`` does (and is ~3x faster on CPU), and the log-prob of the
    maximum is ``-log(sum(exp(logits - max)))``, so no ``[B, V]`` log-softmax is materialised."""
    top, tokens = logits.max(dim=-1, keepdim=True)
    return tokens[:, 0], (logits - top).exp_().sum(dim=-1).log_().neg_()


def clip_uniforms(uniforms: list[float]) -> list[float]:
    return [min(x, _U_MAX) for x in uniforms]


def temperature_sample(
    logits: torch.Tensor,
    temps: torch.Tensor,
    u: torch.Tensor,
    greedy_mask: torch.Tensor | None,
    truncate: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` float32, per-row ``temps [B, 1]`` (greedy rows 1), uniforms ``u [B, 1]`` in [0, 1) ->
    (tokens [B], log-probs [B]): the inverse CDF of ``softmax(logits / T)`` (after ``truncate``, which zeroes the
    probabilities top-k/top-p cut) at ``u``, in one pass over the vocabulary for the cumulative sum and no sort;
    rows set in ``greedy_mask`` take the argmax. Fixed shapes and no host reads: the decode step's CUDA graph
    captures it as it is (``graphs.py``)."""
    logp = torch.log_softmax(logits / temps, dim=-1)
    probs = logp.exp()
    if truncate is not None:
        probs = truncate(probs)
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    if greedy_mask is not None:
        tokens = torch.where(greedy_mask, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


class BatchSampler:
    """Holds the per-row settings of one batch; build once per batch composition, call ``sample`` per step."""

    def __init__(self, temperatures: list[float], top_ks: list[int], top_ps: list[float], device):
        self.n = len(temperatures)
        greedy = [t == 0 for t in temperatures]
        self.greedy_rows = greedy
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        if self.all_greedy:
            return
        self.temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device)[:, None]
        self.greedy_mask = torch.tensor(greedy, device=device) if self.any_greedy else None
        ks = [k if k > 0 and not g else 0 for k, g in zip(top_ks, greedy)]
        ps = [p if not g else 1.0 for p, g in zip(top_ps, greedy)]
        self.max_k = max(ks)
        self.use_top_p = any(p < 1.0 for p in ps)
        if self.max_k:
            self.k_index = torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None]
            self.k_rows = torch.tensor([k > 0 for k in ks], device=device)[:, None]
        if self.use_top_p:
            self.top_p = torch.tensor(ps, device=device)[:, None]
            self.p_rows = torch.tensor([p < 1.0 for p in ps], device=device)[:, None]
            # Rows that are top-p without top-k may need more than the top-k candidates.
            self.p_only = any(p < 1.0 and k == 0 for p, k in zip(ps, ks))

    def sample(self, logits: torch.Tensor, uniforms: list[float] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [B, V]`` float32 -> (tokens [B] int64, log-probs [B] float32)."""
        if self.all_greedy:
            return greedy_sample(logits)
        assert uniforms is not None, "a batch with sampled rows needs one uniform number per row"
        u = torch.tensor(clip_uniforms(uniforms), device=logits.device)[:, None]
        truncate = self._truncate if self.max_k or self.use_top_p else None
        return temperature_sample(logits, self.temps, u, self.greedy_mask, truncate)

    @property
    def truncates(self) -> bool:
        """Whether some row is cut by top-k or top-p (its candidate count depends on the batch's settings)."""
        return not self.all_greedy and bool(self.max_k or self.use_top_p)

    def _truncate(self, probs: torch.Tensor) -> torch.Tensor:
        """Zero the tokens each row's top-k and top-p cut (rows without them untouched)."""
        n_cand = max(self.max_k, NUCLEUS_CANDIDATES if self.use_top_p and self.p_only else 0)
        cand = probs.topk(min(n_cand, probs.shape[-1]), dim=-1).values  # sorted, highest first
        if self.max_k:
            kth = cand.gather(1, self.k_index.clamp(max=cand.shape[-1] - 1))
            kth = torch.where(self.k_rows, kth, 0.0)
            probs = torch.where(probs >= kth, probs, 0.0)
            cand = torch.where(cand >= kth, cand, 0.0)
        if self.use_top_p:
            probs = self._nucleus(probs, cand)
        return probs

    def _nucleus(self, probs: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """Zero every token below its row's nucleus threshold (rows with top_p = 1 untouched)."""
        target = self.top_p * probs.sum(dim=-1, keepdim=True)
        cum = cand.cumsum(dim=-1)
        idx = torch.searchsorted(cum, target)  # first candidate at which the mass reaches top_p
        short = (idx >= cand.shape[-1]) & self.p_rows
        if bool(short.any()):  # nucleus wider than the candidates: sort those rows' whole vocabulary
            rows = short[:, 0].nonzero()[:, 0]
            full = probs[rows].sort(dim=-1, descending=True).values
            full_idx = torch.searchsorted(full.cumsum(dim=-1), target[rows]).clamp_(max=full.shape[-1] - 1)
            thr_short = full.gather(1, full_idx)
        thr = cand.gather(1, idx.clamp(max=cand.shape[-1] - 1))
        if bool(short.any()):
            thr = thr.index_put((rows,), thr_short)
        thr = torch.where(self.p_rows, thr, 0.0)
        return torch.where(probs >= thr, probs, 0.0)
