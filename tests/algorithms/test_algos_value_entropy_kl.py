"""Value loss, entropy, KL estimators, KL controllers and the in-reward KL penalty."""

import math

import pytest
import torch

from algorithms import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_entropy_loss,
    compute_kl_loss,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
)


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0, 1.5, 7.0]])
    values = torch.tensor([[0.5, 2.0, 1.0, 0.0]])
    returns = torch.tensor([[0.0, 3.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # token 1: max((1-0)^2, (0.7-0)^2) = 1; token 2: both (2-3)^2 = 1; token 3: max(2.25, (1.2-3)^2 = 3.24)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 1 + 3.24) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    vf_sum, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, loss_agg_mode="seq-mean-token-sum")
    assert vf_sum.item() == pytest.approx(0.5 * 5.24, rel=1e-6)


def test_value_loss_gradient_and_errors():
    vpreds = torch.tensor([[1.0, 1.5]], requires_grad=True)
    values = torch.tensor([[0.9, 1.0]])
    returns = torch.tensor([[0.0, 3.0]])
    vf_loss, _ = compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.2)
    (grad,) = torch.autograd.grad(vf_loss, vpreds)
    # token 1 unclipped wins: d 0.5 * mean (v - G)^2 = (v - G) / 2; token 2 clipped wins: 0
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.0]]))
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=-1.0)


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # probs (0.25, 0.75) and (0.5, 0.5)
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[h1, math.log(2.0)]]))
    mask = torch.tensor([[1.0, 1.0]])
    assert compute_entropy_loss(logits, mask).item() == pytest.approx((h1 + math.log(2)) / 2, rel=1e-6)
    from_entropy = compute_entropy_loss(None, mask, entropy=entropy_from_logits(logits))
    assert from_entropy.item() == pytest.approx((h1 + math.log(2)) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="exactly one"):
        compute_entropy_loss(logits, mask, entropy=torch.zeros(1, 2))


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -1.5, 0.0])
    ref = torch.tensor([-1.5, -1.0, -30.0])  # d = 0.5, -0.5, 30
    assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx([0.5, -0.5, 30.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.5, 30.0])
    assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([0.5, 0.5, 30.0])
    assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.125, 450.0])
    # k3 = exp(-d) - 1 + d; for d = 30 -d is clamped to -20 and the value stays 10.0 after clamping to [-10, 10]
    k3 = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 10.0]
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(k3, rel=1e-6)
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3, rel=1e-6)
    # -d = 30 clamps to 20: exp(20) - 21 clamps to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_kl_estimators_zero_when_equal_and_k3_nonnegative():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(50, generator=gen) * 5
    for name in ("kl", "abs", "mse", "low_var_kl", "k3+"):
        assert torch.equal(kl_penalty(logp, logp, name), torch.zeros(50))
    ref = -torch.rand(50, generator=gen) * 5
    assert (kl_penalty(logp, ref, "low_var_kl") >= 0).all()
    assert (kl_penalty(logp, ref, "mse") >= 0).all()


def test_straight_through_kl_value_and_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    out = kl_penalty(logp, ref, "low_var_kl+")
    torch.testing.assert_close(out, kl_penalty(logp, ref, "low_var_kl"))
    (grad,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([0.5, -1.0]))  # gradient of 0.5 d^2 is d


def test_kl_errors():
    logp = torch.zeros(3)
    with pytest.raises(NotImplementedError, match="full-vocabulary"):
        kl_penalty(logp, logp, "full")
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k4'.*'low_var_kl'"):
        kl_penalty(logp, logp, "k4")
    with pytest.raises(ValueError, match="unknown kl_penalty 'mse\\+'"):
        kl_penalty(logp, logp, "mse+")
    assert "full" in KL_PENALTY_NAMES and "k3+" in KL_PENALTY_NAMES


def test_kl_loss():
    logp = torch.tensor([[-1.0, -1.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -30.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    expected = (math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5) / 2
    assert compute_kl_loss(logp, ref, mask).item() == pytest.approx(expected, rel=1e-6)
    assert compute_kl_loss(logp, ref, mask, "kl", "seq-mean-token-sum").item() == pytest.approx(0.0)


def test_adaptive_kl_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error clip(0.5) = 0.2 -> * (1 + 0.2 * 256 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.00512)
    ctrl.update(current_kl=5.4, n_steps=1000)  # error -0.1 -> * (1 - 0.01)
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99)
    ctrl.update(current_kl=0.0, n_steps=1000)  # error clipped to -0.2 -> * 0.98
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99 * 0.98)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6.0, 0)


def test_fixed_controller_and_factory():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    assert isinstance(get_kl_controller({"type": "fixed", "kl_coef": 0.02}), FixedKLController)
    adaptive = get_kl_controller({"type": "adaptive", "kl_coef": 0.02, "target_kl": 0.1, "horizon": 100})
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.02
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'pid'.*'fixed'"):
        get_kl_controller({"type": "pid", "kl_coef": 0.02})
    with pytest.raises(ValueError, match="lacks 'horizon'"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.02, "target_kl": 0.1})


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -3.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # k1 = [[0.5, 0, -0.5], [0, 1, (5 masked)]]; rewards = scores - 0.1 * k1 * mask
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, FixedKLController(0.1), kl_penalty="kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [0.0, 1.9, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.0 + 0.5) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    ctrl = AdaptiveKLController(0.1, target_kl=0.125, horizon=10)
    _, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the coefficient used, before the update
    assert ctrl.value == pytest.approx(
        0.1 * (1 + 0.2 * 2 / 10)
    )  # error clip(0.25/0.125 - 1) = 0.2, n_steps = B
