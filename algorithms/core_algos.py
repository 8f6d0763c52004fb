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

# hyflow's names are verl's: re-export all of them; this module adds verl's two older call forms.
from algorithms import *  # noqa: F403
from algorithms import __all__ as _hyflow_names
from algorithms.aggregation import agg_loss as _agg_loss
from algorithms.policy_loss import compute_policy_loss_vanilla

__all__ = [*_hyflow_names, "compute_policy_loss"]


def agg_loss(  # type: ignore[no-redef]  # replaces the star-imported one with verl's keyword form
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
