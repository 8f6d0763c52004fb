"""Off-policy corrections for asynchronous RL, registered by name in ``ROLLOUT_CORRECTION_REGISTRY``.

With asynchronous rollouts the tokens were sampled by a *behaviour* policy (the rollout engine's
weights, possibly several versions old, whose log-probs are ``rollout_log_prob``) while the PPO
ratio is taken against the *proximal* policy (the trainer's log-probs recomputed before the update,
``old_log_prob``). Even synchronous training has a small gap (engine vs trainer numerics). A
correction turns the gap into per-token weights for the policy loss's ``rollout_is_weights``::

    weights, metrics = get_rollout_correction_fn(name)(old_log_prob, rollout_log_prob, response_mask, cap=2.0)

All tensors are [B, R]. ``weights`` is detached, 0 on masked tokens, or None (no correction);
``metrics`` are detached scalar tensors named in ``OFF_POLICY_METRICS``, computed over valid tokens
(an empty selection gives 0):

* ``off_policy/is_weight_mean`` / ``_max`` / ``_min``: the weights applied (for ``none``, the raw ratio)
* ``off_policy/is_clipped_frac``: share of valid tokens (rows for ``seq_tis``) whose weight the cap changed
* ``off_policy/behaviour_kl``: mean of (rollout - old), the k1 estimate of KL(behaviour || proximal)
* ``off_policy/log_ratio_abs_max``: max |old - rollout|

Log-ratios are clamped to [-20, 20] before ``exp`` (as the PPO ratio in ``policy_loss``), so an
extreme token cannot overflow; the metrics of the log-ratio itself are unclamped.
"""

from __future__ import annotations

import torch

from algorithms.masked import masked_mean
from algorithms.registry import register_rollout_correction

__all__ = [
    "OFF_POLICY_METRICS",
    "compute_rollout_correction_none",
    "compute_rollout_correction_tis",
    "compute_rollout_correction_seq_tis",
    "compute_rollout_correction_decoupled_ppo",
]

OFF_POLICY_METRICS = (
    "off_policy/is_weight_mean",
    "off_policy/is_weight_max",
    "off_policy/is_weight_min",
    "off_policy/is_clipped_frac",
    "off_policy/behaviour_kl",
    "off_policy/log_ratio_abs_max",
)

_LOG_RATIO_LIMIT = 20.0

Correction = tuple[torch.Tensor | None, dict[str, torch.Tensor]]


def _log_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs as (log(pi_prox / pi_behav) with 0 on masked tokens, bool mask of valid tokens)."""
    shapes = {
        "old_log_prob": tuple(old_log_prob.shape),
        "rollout_log_prob": tuple(rollout_log_prob.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if len(shapes["old_log_prob"]) != 2 or len(set(shapes.values())) != 1:
        raise ValueError(f"rollout correction inputs must share one [B, R] shape, got {shapes}")
    for name, tensor in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0 (or None for no cap), got {cap!r}")
    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    valid = response_mask != 0
    diff = old_log_prob.detach().to(dtype) - rollout_log_prob.detach().to(dtype)
    # padding may hold anything (even NaN): zero it so it cannot reach a weight or a metric
    return torch.where(valid, diff, torch.zeros((), dtype=dtype, device=diff.device)), valid


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))


def _metrics(
    weights: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor, clipped_frac: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The ``OFF_POLICY_METRICS`` over valid tokens (0 when none is valid; clipped_frac None = 0)."""
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    any_valid = bool(valid.any())
    return {
        "off_policy/is_weight_mean": masked_mean(weights, valid),
        "off_policy/is_weight_max": weights[valid].max() if any_valid else zero,
        "off_policy/is_weight_min": weights[valid].min() if any_valid else zero,
        "off_policy/is_clipped_frac": zero if clipped_frac is None else clipped_frac.to(weights.dtype),
        "off_policy/behaviour_kl": masked_mean(-log_ratio, valid),
        "off_policy/log_ratio_abs_max": log_ratio.abs().max() if any_valid else zero,
    }


@register_rollout_correction("none")
def compute_rollout_correction_none(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float | None = None,
) -> Correction:
    """No correction (weights None); the metrics still report the raw ratio pi_prox / pi_behav, so a run
    without correction shows how off-policy it is. ``cap`` is validated and otherwise unused."""
    log_ratio, valid = _log_ratio(old_log_prob, rollout_log_prob, response_mask, cap)
    ratio = _ratio(log_ratio)
    return None, _metrics(ratio, log_ratio, valid, None)


@register_rollout_correction("tis")
def compute_rollout_correction_tis(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float | None = 2.0,
) -> Correction:
    """Token-level truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): w_t = min(pi_prox(y_t) / pi_behav(y_t), cap).
    ``cap`` None = untruncated IS. is_clipped_frac = share of valid tokens with ratio > cap."""
    log_ratio, valid = _log_ratio(old_log_prob, rollout_log_prob, response_mask, cap)
    ratio = _ratio(log_ratio)
    weights = ratio if cap is None else torch.clamp(ratio, max=cap)
    clipped = masked_mean((ratio > cap).float(), valid) if cap is not None else None
    return weights * valid, _metrics(weights * valid, log_ratio, valid, clipped)


@register_rollout_correction("seq_tis")
def compute_rollout_correction_seq_tis(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float | None = 2.0,
) -> Correction:
    """Sequence-level truncated importance sampling: w_i = min(prod_t pi_prox(y_t) / pi_behav(y_t), cap)
    over the row's valid tokens (the log-ratio sum is clamped before ``exp``), put on every valid token
    of row i. ``cap`` None = untruncated. is_clipped_frac = share of rows with a valid token whose
    product exceeds cap."""
    log_ratio, valid = _log_ratio(old_log_prob, rollout_log_prob, response_mask, cap)
    seq_ratio = _ratio(log_ratio.sum(dim=-1))  # [B]; masked tokens are 0 in log_ratio
    seq_weights = seq_ratio if cap is None else torch.clamp(seq_ratio, max=cap)
    rows = valid.any(dim=-1)
    clipped = masked_mean((seq_ratio > cap).float(), rows) if cap is not None else None
    weights = seq_weights.unsqueeze(-1) * valid
    return weights, _metrics(weights, log_ratio, valid, clipped)


@register_rollout_correction("decoupled_ppo")
def compute_rollout_correction_decoupled_ppo(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float | None = 2.0,
) -> Correction:
    """Behaviour weight of AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: a large-scale
    asynchronous reinforcement learning system for language reasoning").

    w_t = pi_prox(y_t) / pi_behav(y_t), untruncated; tokens with w_t > cap get weight 0 (masked out, as
    AReaL's behaviour-importance-weight cap; they still count in the loss's token total), ``cap`` None
    masks nothing. Passed to the vanilla clipped loss, whose ``old_log_prob`` is the proximal policy,
    this gives J = E_behav[pi_prox / pi_behav * min(r A, clip(r, 1 - eps, 1 + eps) A)] with
    r = pi_theta / pi_prox: the clip is centred on the proximal policy, not the stale behaviour one.
    is_clipped_frac = share of valid tokens masked out by the cap.
    """
    log_ratio, valid = _log_ratio(old_log_prob, rollout_log_prob, response_mask, cap)
    ratio = _ratio(log_ratio)
    kept = valid if cap is None else valid & (ratio <= cap)
    weights = ratio * kept
    dropped = masked_mean((valid & ~kept).float(), valid)
    return weights, _metrics(weights, log_ratio, valid, dropped)
