"""The ``hybrid`` advantage: outcome GRPO + step-level process rewards + hindsight on-policy distillation.

For response token t of row i (a multi-turn tool trajectory; ``response_mask`` is 1 on the policy's own
tokens and 0 on observations and padding)::

    A_t = w_rl * (A_grpo(i) + A_prm(i, step(t)))
        + w_opd * hint(i) * (log pi_teacher(a_t | x, hint, a_<t) - log pi_old(a_t | x, a_<t))

and 0 wherever ``response_mask`` is 0.

* ``A_grpo``: the GRPO outcome advantage of the row (``compute_grpo_outcome_advantage``).
* ``step(t)``: the policy turn holding token t -- the k-th contiguous run of ``response_mask`` ones is
  step k (:func:`step_index_from_mask`).
* ``A_prm``: the process reward model's score of step k, normalised within the bucket (group, k): the
  rows of one prompt (same ``index``) that have a step k (:func:`normalize_step_rewards`). A bucket of
  one entry has no baseline and gives 0, as a GRPO group of one does.
* ``hint(i)``: 1 when the PRM wrote a bridge thought for row i, 0 for its "no intervention" marker, so
  rows without a hint get only the RL term. The teacher is the reference model conditioned on
  [prompt + hint + response]; its log-probs are aligned token for token with the policy's response.

Pure torch; no Ray, no model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from algorithms.advantages import _cfg_get, compute_grpo_outcome_advantage, group_ids, group_normalize
from algorithms.registry import register_adv_est

__all__ = [
    "HybridTerms",
    "compute_hybrid_advantage",
    "hybrid_advantage_terms",
    "normalize_step_rewards",
    "step_index_from_mask",
    "step_rewards_per_token",
]


def step_index_from_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] long: k on the tokens of the k-th contiguous run of nonzero ``response_mask`` (0-based), -1 on
    masked positions. Each model turn of a multi-turn trajectory is one run (observations separate them)."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(response_mask.shape)}")
    on = response_mask != 0
    before = torch.zeros_like(on)
    before[:, 1:] = on[:, :-1]
    starts = on & ~before
    idx = starts.long().cumsum(dim=-1) - 1
    return torch.where(on, idx, torch.full_like(idx, -1))


@torch.no_grad()
def normalize_step_rewards(
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Step rewards [B, S] normalised within (group, step index) buckets: (r - bucket mean) / (bucket std +
    eps) (unbiased std; without ``norm_by_std`` only centred). Entries with ``step_mask`` 0 and buckets of a
    single entry give 0."""
    if step_rewards.shape != step_mask.shape or step_rewards.dim() != 2:
        raise ValueError(
            f"step_rewards and step_mask must both be [B, S], got {tuple(step_rewards.shape)} and "
            f"{tuple(step_mask.shape)}"
        )
    B, S = step_rewards.shape
    ids, n_groups = group_ids(index, B)
    valid = step_mask != 0
    r = step_rewards.to(torch.float64)
    bucket = (ids.to(r.device)[:, None] * S + torch.arange(S, device=r.device)[None, :])[valid]
    out = torch.zeros_like(r)
    out[valid] = group_normalize(r[valid], bucket, n_groups * S, epsilon, norm_by_std)
    return out.to(step_rewards.dtype)


def step_rewards_per_token(per_step: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast [B, S] per-step values onto the tokens of each step ([B, R]); tokens of steps >= S (turns
    the PRM did not score) and masked positions get 0."""
    step = step_index_from_mask(response_mask)
    S = per_step.shape[1]
    inside = (step >= 0) & (step < S)
    gathered = (
        per_step.gather(1, step.clamp(0, max(S - 1, 0)))
        if S > 0
        else torch.zeros_like(step, dtype=per_step.dtype)
    )
    return torch.where(inside, gathered, torch.zeros_like(gathered)).to(torch.float32)


@dataclass
class HybridTerms:
    """The three [B, R] parts of the hybrid advantage (each 0 off the response mask) and their weights."""

    grpo: torch.Tensor
    prm: torch.Tensor
    opd: torch.Tensor
    w_rl: float = 1.0
    w_opd: float = 1.0

    @property
    def advantages(self) -> torch.Tensor:
        """``w_rl * (grpo + prm) + w_opd * opd`` (module docstring)."""
        return self.w_rl * (self.grpo + self.prm) + self.w_opd * self.opd


@torch.no_grad()
def hybrid_advantage_terms(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    step_rewards: torch.Tensor | None = None,
    step_mask: torch.Tensor | None = None,
    teacher_log_prob: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    hint_mask: torch.Tensor | None = None,
    w_rl: float | None = None,
    w_opd: float | None = None,
    opd_clip: float | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> HybridTerms:
    """GRPO, PRM and OPD terms and their weights. Without ``step_rewards`` the PRM term is 0; without
    ``teacher_log_prob`` / ``old_log_probs`` / ``hint_mask`` the OPD term is 0 (so the advantage is ``w_rl``
    times GRPO's). ``opd_clip`` bounds |log-ratio| per token. ``w_rl`` / ``w_opd`` / ``opd_clip``: the
    arguments, else the same-named fields of ``config``, else 1, 1, None."""
    w_rl = float(w_rl if w_rl is not None else _cfg_get(config, "w_rl", 1.0))
    w_opd = float(w_opd if w_opd is not None else _cfg_get(config, "w_opd", 1.0))
    opd_clip = opd_clip if opd_clip is not None else _cfg_get(config, "opd_clip", None)
    mask = response_mask.to(torch.float32)
    grpo, _ = compute_grpo_outcome_advantage(
        token_level_rewards,
        response_mask,
        index,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    grpo = grpo.to(torch.float32)
    prm = torch.zeros_like(mask)
    if step_rewards is not None:
        if step_mask is None:
            step_mask = torch.ones_like(step_rewards)
        if step_rewards.shape[0] != mask.shape[0]:
            raise ValueError(f"step_rewards has {step_rewards.shape[0]} rows for a batch of {mask.shape[0]}")
        normed = normalize_step_rewards(step_rewards, step_mask, index, epsilon, norm_adv_by_std_in_grpo)
        prm = step_rewards_per_token(normed.to(torch.float32), response_mask) * mask
    opd = torch.zeros_like(mask)
    if teacher_log_prob is not None and old_log_probs is not None and hint_mask is not None:
        for name, t in (("teacher_log_prob", teacher_log_prob), ("old_log_probs", old_log_probs)):
            if t.shape != mask.shape:
                raise ValueError(f"{name} must be [B, R]={tuple(mask.shape)}, got {tuple(t.shape)}")
        diff = teacher_log_prob.to(torch.float32) - old_log_probs.to(torch.float32)
        if opd_clip is not None:
            diff = diff.clamp(-opd_clip, opd_clip)
        hint = hint_mask.to(torch.float32).reshape(-1, 1)
        opd = diff * hint * mask
    elif teacher_log_prob is not None or old_log_probs is not None or hint_mask is not None:
        raise ValueError("the OPD term needs teacher_log_prob, old_log_probs and hint_mask together")
    return HybridTerms(grpo=grpo * mask, prm=prm, opd=opd, w_rl=w_rl, w_opd=w_opd)


@register_adv_est("hybrid")
@functools.wraps(hybrid_advantage_terms, assigned=())  # its parameters are what run_adv_estimator passes
def compute_hybrid_advantage(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_rl * (A_grpo + A_prm) + w_opd * OPD`` (module docstring) from the arguments of
    ``hybrid_advantage_terms``; returns (advantages, advantages)."""
    adv = hybrid_advantage_terms(*args, **kwargs).advantages
    return adv, adv
