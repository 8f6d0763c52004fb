"""KL estimators between the actor and the reference policy, and the two ways to use them.

Per-token estimators of KL(pi || pi_ref) from the sampled token's log-probs (Schulman,
"Approximating KL divergence", 2020), d = logprob - ref_logprob:

    ``kl`` / ``k1``          d                                  (unbiased, can be negative)
    ``abs``                  |d|
    ``mse`` / ``k2``         0.5 * d^2
    ``low_var_kl`` / ``k3``  exp(-d) - 1 + d, with -d clamped to [-20, 20] and the result to
                             [-10, 10] as verl does (>= 0, unbiased, low variance)
    ``full``                 needs full-vocabulary distributions; not supported (raises
                             ``NotImplementedError``)

A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ...) keeps the estimator's value but takes the
gradient of k2 (straight-through), whose expected gradient is the true KL gradient.

Use either *in the reward* (``apply_kl_penalty``: rewards = scores - beta * KL, beta from a
``FixedKLController`` or ``AdaptiveKLController``) or *as a loss term* (``compute_kl_loss``,
added to the actor loss times ``kl_loss_coef``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from algorithms.aggregation import agg_loss
from algorithms.masked import masked_mean

__all__ = [
    "KL_PENALTY_NAMES",
    "kl_penalty",
    "compute_kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
]

_BASE = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
KL_PENALTY_NAMES = (*_BASE, *(f"{n}+" for n in _BASE if _BASE[n] != "k2"), "full")


def _forward(kind: str, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    diff = logprob - ref_logprob
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)  # log(pi_ref / pi)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate named ``kl_penalty`` (see the module docstring), same shape as inputs."""
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' needs the full-vocabulary distributions of both policies, which the "
            "per-token log-prob interface does not carry; use 'low_var_kl' (k3), 'kl' (k1) or 'mse' (k2)"
        )
    if not isinstance(kl_penalty, str):
        raise ValueError(f"kl_penalty must be a name (str); valid: {list(KL_PENALTY_NAMES)}")
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base not in _BASE or (straight_through and _BASE[base] == "k2"):
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {list(KL_PENALTY_NAMES)}")
    value = _forward(_BASE[base], logprob, ref_logprob)
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def compute_kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """KL as a loss term: ``agg_loss(kl_penalty(logprob, ref_logprob, kl_loss_type), mask, ...)``.

    Add ``kl_loss_coef * kl_loss`` to the actor loss; same micro-batch convention as ``agg_loss``.
    """
    kld = kl_penalty(logprob, ref_logprob, kl_loss_type)
    return agg_loss(kld, response_mask, loss_agg_mode, global_batch_info=global_batch_info)


class FixedKLController:
    """Constant KL coefficient ``value``; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), as in verl and TRL.

    ``update(current_kl, n_steps)``: e = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Controller from a config (mapping or object) with ``type`` ('fixed' | 'adaptive'), ``kl_coef``,
    and for 'adaptive' ``target_kl`` and ``horizon``."""

    def get(key: str) -> Any:
        if isinstance(kl_ctrl, Mapping):
            if key not in kl_ctrl:
                raise ValueError(f"kl_ctrl config lacks {key!r}")
            return kl_ctrl[key]
        if not hasattr(kl_ctrl, key):
            raise ValueError(f"kl_ctrl config lacks {key!r}")
        return getattr(kl_ctrl, key)

    kind = get("type")
    if kind == "fixed":
        return FixedKLController(kl_coef=get("kl_coef"))
    if kind == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=get("kl_coef"), target_kl=get("target_kl"), horizon=get("horizon")
        )
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; valid: ['adaptive', 'fixed']")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``token_level_rewards = token_level_scores - beta * KL * mask``, beta = kl_ctrl.value.

    ``current_kl`` = batch mean of each row's masked token-mean KL. After computing the rewards the
    controller is updated with ``kl_ctrl.update(current_kl, n_steps=B)`` (as verl). Returns
    (token_level_rewards, metrics) with verl's metric names ``actor/reward_kl_penalty`` (current_kl)
    and ``actor/reward_kl_penalty_coeff`` (the beta used, i.e. before the update).
    """
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * response_mask.to(old_log_prob.dtype)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, axis=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


_kl_estimate = kl_penalty  # the parameter named kl_penalty shadows the function inside apply_kl_penalty
