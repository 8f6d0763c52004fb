"""Advantage estimators, registered by name in ``ADV_ESTIMATOR_REGISTRY``.

Every estimator takes [B, R] tensors laid out as in dataproto/BATCH_LAYOUT.md
(``token_level_rewards``, ``response_mask``, ``values``) and returns ``(advantages, returns)``,
both [B, R] and 0 wherever ``response_mask`` is 0. Outcome estimators use the sequence score
``token_level_rewards.sum(-1)`` (all positions, as verl) and broadcast one advantage over the
response tokens. ``index`` is the per-row group id (the ``uid`` non-tensor column: numpy array,
list or tensor of hashables; rows with equal ids are the n samples of one prompt).

Estimators are pure functions under ``torch.no_grad``. Call one by name with whatever inputs the
caller has through ``run_adv_estimator(name, **inputs)``, which passes each estimator only the
arguments it declares. Other modules add estimators with ``@register_adv_est("name")``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from algorithms.masked import masked_whiten
from algorithms.registry import AdvantageEstimator, get_adv_estimator_fn, register_adv_est

__all__ = [
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "group_ids",
    "group_normalize",
    "run_adv_estimator",
]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected tensors of one [B, R] shape, got {shapes}")


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def group_ids(index: Any, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map per-row group keys to dense ids 0..G-1 (in order of first appearance); returns (ids, G)."""
    if isinstance(index, torch.Tensor):
        keys = index.tolist()
    elif isinstance(index, np.ndarray):
        keys = index.tolist()
    else:
        keys = list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries but the batch has {batch_size} rows")
    dense: dict[Any, int] = {}
    try:
        ids = [dense.setdefault(k, len(dense)) for k in keys]
    except TypeError as e:
        raise TypeError(f"index entries must be hashable (e.g. uid strings): {e}") from None
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, n_groups: int):
    """Per-row (group count, group mean, unbiased group std) for 1-D ``scores``."""
    ids = ids.to(scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, ids, torch.ones_like(scores))
    mean = zeros.index_add(0, ids, scores) / count
    sq_dev = zeros.index_add(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp_min(1))
    return count[ids], mean[ids], std[ids]


def group_normalize(
    values: torch.Tensor, ids: torch.Tensor, n_groups: int, epsilon: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """1-D ``values`` as (value - group mean) / (group std + epsilon) (unbiased std; without ``norm_by_std``
    only centred), with 0 in a group of one, which has no baseline; ``ids`` are dense group ids."""
    count, mean, std = _group_stats(values, ids, n_groups)
    centred = values - mean
    normed = centred / (std + epsilon) if norm_by_std else centred
    return torch.where(count > 1, normed, torch.zeros_like(normed))


def _outcome_group_stats(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any):
    """Per row: (sequence score, its group's size, its group's mean) for the leave-one-out style estimators."""
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = group_ids(index, scores.shape[0])
    count, mean, _ = _group_stats(scores, ids, n_groups)
    return scores, count, mean


def _per_token(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row [B] broadcast over its response tokens [B, R]."""
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), whitened over valid tokens.

    Backward over t: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next,
    where "next" is the next position with ``response_mask`` 1: masked positions (padding,
    environment observations inside a multi-turn trajectory) are skipped, neither bootstrapping a
    value nor adding a TD error, so A and V flow across observation tokens. ``V`` after the last
    valid token is 0. ``returns = A + V`` (before whitening); ``advantages = masked_whiten(A)``
    (unbiased variance). Both are zeroed where the mask is 0.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    mask = response_mask.to(values.dtype)
    batch, length = values.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in range(length - 1, -1, -1):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        last_adv = m * adv_t + (1 - m) * last_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = last_adv
    returns = (adv + values) * mask
    advantages = masked_whiten(adv, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: (score - group mean) / (group std + epsilon), broadcast over tokens.

    The group std is unbiased (n - 1), as ``torch.std``. ``norm_adv_by_std_in_grpo=False`` gives
    Dr. GRPO (score - group mean, no division). A group of one sample has no baseline and gets
    advantage 0 (verl instead passes its raw score through). Constant-reward groups get 0.
    ``config`` is accepted for verl call compatibility and not read. Returns (advantages, advantages).
    """
    del config
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)
    ids, n_groups = group_ids(index, scores.shape[0])
    adv = _per_token(group_normalize(scores, ids, n_groups, epsilon, norm_adv_by_std_in_grpo), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the other samples.

    For a group of n > 1: A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean).
    A group of one has no other sample; as in verl its baseline is 0 (A = r). ``epsilon`` and
    ``config`` are accepted for verl call compatibility and not used. Returns (advantages, advantages).
    """
    del epsilon, config
    scores, count, mean = _outcome_group_stats(token_level_rewards, response_mask, index)
    loo = (scores - mean) * count / (count - 1).clamp_min(1)
    adv = _per_token(torch.where(count > 1, loo, scores), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | None = None,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's valid tokens.

    G_t = r_t + gamma * G_next, where "next" skips masked positions (as GAE does), so a reward
    after an observation span reaches the earlier turn's tokens; for single-turn right-padded
    responses this equals verl's reset-after-EOS loop. ``gamma``: the argument, else
    ``config.gamma`` (verl passes its AlgoConfig), else 1.0. Returns (whitened G * mask, G * mask).
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if gamma is None:
        gamma = _cfg_get(config, "gamma", 1.0)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in range(token_level_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    returns = returns * mask
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: (score - group mean) broadcast over tokens, then whitened over the batch.

    A group of one has baseline 0 (as verl). ``epsilon`` and ``config`` are accepted for verl call
    compatibility and not used. Returns (advantages, advantages).
    """
    del epsilon, config
    scores, count, mean = _outcome_group_stats(token_level_rewards, response_mask, index)
    mask = response_mask.to(scores.dtype)
    adv = _per_token(torch.where(count > 1, scores - mean, scores), response_mask)
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the greedy rollout's score ``reward_baselines`` [B].

    returns_t = sum_{s >= t} r_s * mask_s; advantages = returns - baseline (on valid tokens).
    ``config`` is accepted for verl call compatibility and not read.
    """
    del config
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must be [B]={tuple(token_level_rewards.shape[:1])}, "
            f"got {tuple(reward_baselines.shape)}"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


def run_adv_estimator(adv_estimator: str | AdvantageEstimator, **inputs: Any):
    """Call the estimator registered as ``adv_estimator`` with the subset of ``inputs`` it declares.

    Lets a trainer offer everything it has (``token_level_rewards``, ``values``, ``response_mask``,
    ``index``, ``gamma``, ``lam``, ``reward_baselines``, ``config``, ...) to any estimator, including
    ones registered later. An estimator with ``**kwargs`` receives all inputs. A required parameter
    absent from ``inputs`` raises ``TypeError`` naming it.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**inputs)
    accepted = {
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    missing = [
        name for name in accepted if params[name].default is inspect.Parameter.empty and name not in inputs
    ]
    if missing:
        raise TypeError(
            f"advantage estimator {getattr(adv_estimator, 'value', adv_estimator)!r} needs "
            f"{sorted(missing)}, which were not given (given: {sorted(inputs)})"
        )
    return fn(**{k: v for k, v in inputs.items() if k in accepted})
