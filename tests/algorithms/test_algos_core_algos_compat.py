"""algorithms.core_algos: verl's names and call forms."""

import pytest
import torch

from algorithms import agg_loss as hyflow_agg_loss
from algorithms import compute_policy_loss_vanilla, core_algos


def test_verl_names_present():
    for name in core_algos.__all__:
        assert hasattr(core_algos, name), name
    assert core_algos.get_adv_estimator_fn("grpo") is core_algos.compute_grpo_outcome_advantage


def test_verl_keyword_agg_loss():
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    verl_form = core_algos.agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=6)
    ours = hyflow_agg_loss(loss, mask, "token-mean", {"global_tokens": 6, "dp_size": 2})
    assert verl_form.item() == ours.item() == pytest.approx(8 / 6 * 2)
    assert core_algos.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 3.5) / 2)
    with pytest.raises(ValueError, match="not both"):
        core_algos.agg_loss(loss, mask, "token-mean", {"global_tokens": 6}, dp_size=2)


def test_deprecated_compute_policy_loss_form():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.5, 0.1]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    a = core_algos.compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    b = compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="cliprange"):
        core_algos.compute_policy_loss(old, new, adv, mask)
