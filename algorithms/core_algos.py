"""verl-compatible names (``verl.trainer.ppo.core_algos``) for porting recipes.

``from algorithms import core_algos`` and use the same function names as verl. The functions are
hyflow's own (see the modules under ``algorithms``); the differences from verl are documented in
their docstrings. Two verl call forms are adapted here:

* ``agg_loss(..., dp_size=, batch_num_tokens=, global_batch_size=, loss_scale_factor=)`` keyword form
  (verl spreads ``config.global_batch_info`` into keywords) maps to hyflow's ``global_batch_info``.
* the deprecated ``compute_policy_loss(..., cliprange=, cliprange_low=, cliprange_high=, clip_ratio_c=)``.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from algorithms.aggregation import agg_loss as _agg_loss
from algorithms.entropy import compute_entropy_loss, entropy_from_logits
from algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
)
from algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from algorithms.policy_loss import compute_policy_loss_gspo, compute_policy_loss_vanilla
from algorithms.registry import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdvantageEstimator",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: dict[str, Any] | None = None,
    *,
    dp_size: int | None = None,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """``algorithms.agg_loss`` that also takes verl's keyword form of the global batch info.

    The keywords are gathered into ``global_batch_info`` (they may not be combined with it). As in
    hyflow's ``agg_loss``, once any count is given the mode's count must be among them.
    """
    keywords = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
    }
    given = {k: v for k, v in keywords.items() if v is not None}
    if given:
        if global_batch_info is not None:
            raise ValueError(f"pass either global_batch_info or the keywords {sorted(given)}, not both")
        global_batch_info = given
    return _agg_loss(
        loss_mat, loss_mask, loss_agg_mode, global_batch_info, loss_scale_factor=loss_scale_factor
    )


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
):
    """verl's deprecated PPO-clip signature; forwards to ``compute_policy_loss_vanilla``."""
    if cliprange is None and (cliprange_low is None or cliprange_high is None):
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    return compute_policy_loss_vanilla(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        clip_ratio=cliprange,
        clip_ratio_low=cliprange_low,
        clip_ratio_high=cliprange_high,
        clip_ratio_c=clip_ratio_c,
    )
