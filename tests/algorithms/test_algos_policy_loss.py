"""PPO-clip (vanilla) and GSPO policy losses against hand-worked examples and invariants."""

import math

import pytest
import torch

from algorithms import (
    GSPO_CLIP_RATIO_HIGH,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    make_global_batch_info,
)

# Six tokens in one row: (advantage, ratio) chosen to hit every branch with clip 0.2 and clip_ratio_c 3.
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 1.0]])
RATIO = torch.tensor([[1.5, 0.5, 1.5, 0.5, 5.0, 5.0]])
OLD = torch.full_like(ADV, -1.0)
NEW = OLD + RATIO.log()
ONES = torch.ones_like(ADV)


def test_vanilla_by_hand():
    # per-token losses: max(-A r, -A clip(r, 0.8, 1.2)), then for A < 0 min(., -3 A):
    #   -1.2 (clipped), -0.5, 1.5, 0.8 (clipped), min(10, 6) = 6 (dual clip), -1.2 (clipped)
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss_vanilla(OLD, NEW, ADV, ONES, clip_ratio=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 + 6.0 - 1.2) / 6, rel=1e-6)
    assert clipfrac.item() == pytest.approx(3 / 6)
    assert clipfrac_lower.item() == pytest.approx(1 / 6)
    expected_kl = -(2 * math.log(1.5) + 2 * math.log(0.5) + 2 * math.log(5.0)) / 6
    assert ppo_kl.item() == pytest.approx(expected_kl, rel=1e-6)


def test_vanilla_asymmetric_clip_by_hand():
    # clip_ratio_high 0.28 changes the two A > 0, r > 1 tokens from -1.2 to -1.28
    loss, *_ = compute_policy_loss_vanilla(OLD, NEW, ADV, ONES, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8 + 6.0 - 1.28) / 6, rel=1e-6)
    # clip_ratio_low 0.6: clip(0.5, 0.4, 1.2) = 0.5, so the A = -1, r = 0.5 token is no longer clipped: 0.5
    loss, *_ = compute_policy_loss_vanilla(OLD, NEW, ADV, ONES, clip_ratio_low=0.6, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.5 + 6.0 - 1.2) / 6, rel=1e-6)


def test_vanilla_mask_and_weights():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0]])
    poisoned = NEW.clone()
    poisoned[0, 3] = float("nan")  # a masked token must not leak
    loss, clipfrac, _, _ = compute_policy_loss_vanilla(OLD, poisoned, ADV, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.2) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    weights = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.5]])
    loss, *_ = compute_policy_loss_vanilla(OLD, NEW, ADV, mask, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-2.4 - 0.5 - 0.6) / 3, rel=1e-6)


def test_vanilla_ratio_one_is_minus_advantage():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 5, generator=gen)
    logp = torch.randn(4, 5, generator=gen).requires_grad_(True)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    loss, clipfrac, ppo_kl, lower = compute_policy_loss_vanilla(logp.detach(), logp, adv, mask)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert clipfrac.item() == 0.0 and ppo_kl.item() == 0.0 and lower.item() == 0.0
    # gradient of -A * ratio at ratio 1 is -A per token, divided by the token count
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv * mask / mask.sum())


def test_vanilla_gradient_is_zero_where_clipped():
    new = NEW.clone().requires_grad_(True)
    loss, *_ = compute_policy_loss_vanilla(OLD, new, ADV, ONES)
    (grad,) = torch.autograd.grad(loss, new)
    # unclipped tokens: d(-A r)/d log r = -A r; clipped or dual-clipped tokens: 0
    expected = torch.tensor([[0.0, -0.5, 1.5, 0.0, 0.0, 0.0]]) / 6
    torch.testing.assert_close(grad, expected)


def test_dual_clip_bounds_negative_advantage_loss():
    gen = torch.Generator().manual_seed(1)
    n, c = 40, 3.0
    adv = -torch.rand(n, 1, generator=gen) * 3 - 0.01
    old = torch.zeros(n, 1)
    new = torch.randn(n, 1, generator=gen) * 2.5  # ratios from ~e^-7 to ~e^7
    for i in range(n):
        one = torch.zeros(n, 1)
        one[i] = 1.0
        loss, *_ = compute_policy_loss_vanilla(old, new, adv, one, clip_ratio_c=c)
        assert loss.item() <= -adv[i].item() * c + 1e-6
    # with huge ratios every token is bounded exactly at -A * c
    loss, _, _, lower = compute_policy_loss_vanilla(old, old + 6.0, adv, torch.ones(n, 1), clip_ratio_c=c)
    assert loss.item() == pytest.approx((-adv * c).mean().item(), rel=1e-6)
    assert lower.item() == 1.0


def test_vanilla_bad_arguments():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(OLD, NEW, ADV, ONES, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        compute_policy_loss_vanilla(OLD, NEW, ADV, ONES, clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="share one"):
        compute_policy_loss_vanilla(OLD, NEW, ADV[:, :3], ONES)


def test_vanilla_micro_batches_with_global_info_equal_full_batch():
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    new = (old + 0.3 * torch.randn(6, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).double()
    for mode in ("token-mean", "seq-mean-token-mean"):
        full, *_ = compute_policy_loss_vanilla(old, new, adv, mask, mode)
        (g_full,) = torch.autograd.grad(full, new)
        info = make_global_batch_info([mask[:2], mask[2:]])
        parts = [
            compute_policy_loss_vanilla(old[s], new[s], adv[s], mask[s], mode, global_batch_info=info)[0]
            for s in (slice(0, 2), slice(2, 6))
        ]
        (g_split,) = torch.autograd.grad(sum(parts), new)
        torch.testing.assert_close(sum(parts), full)
        torch.testing.assert_close(g_split, g_full)


def test_gspo_by_hand():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, 0.0], [-1e-4, 1e-4, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    loss, clipfrac, ppo_kl, lower = compute_policy_loss_gspo(old, new, adv, mask)
    # row 0: s = exp(mean(0.1, 0.3)) = e^0.2 > 1 + 4e-4 -> clipped: loss -1.0004 per token
    # row 1: s = exp(0) = 1 -> loss -2 per token; the masked 5.0 log-ratio is ignored
    assert loss.item() == pytest.approx((-(1 + GSPO_CLIP_RATIO_HIGH) - 2.0) / 2, rel=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 4)
    assert ppo_kl.item() == pytest.approx(-(0.1 + 0.3) / 4, rel=1e-5)
    assert lower.item() == 0.0
    # loss_agg_mode is ignored: GSPO is always a sequence mean
    assert compute_policy_loss_gspo(old, new, adv, mask, "token-mean")[0].item() == loss.item()


def test_gspo_gradient_is_sequence_ratio_gradient():
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.3, 0.7], [-0.2, 0.05, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv_row = torch.tensor([1.0, -0.5], dtype=torch.float64)
    adv = adv_row[:, None] * mask
    loss, *_ = compute_policy_loss_gspo(old, new, adv, mask, clip_ratio=10.0)  # no clipping
    (grad,) = torch.autograd.grad(loss, new)
    # d/dlogp_{i,t} of -mean_i A_i exp(mean_t logp_i) = -A_i s_i / |y_i| / 2
    assert grad[0, 0].item() == pytest.approx(-1.0 * math.exp(1.1 / 3) / 3 / 2)
    # independent formulation: the sequence-level objective itself
    seq_ratio = torch.exp((new * mask).sum(-1) / mask.sum(-1))
    (ref_grad,) = torch.autograd.grad(-(adv_row * seq_ratio).mean(), new)
    torch.testing.assert_close(grad, ref_grad)
    assert loss.item() == pytest.approx(-(adv_row * seq_ratio).mean().item())


def test_policy_loss_registry():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*'gspo'.*'vanilla'"):
        get_policy_loss_fn("ppo")
    # both share one keyword signature, so an actor can call either the same way
    kwargs = dict(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        global_batch_info=None,
        rollout_is_weights=None,
    )
    for name in ("vanilla", "gspo"):
        out = get_policy_loss_fn(name)(OLD, NEW, ADV, ONES, "token-mean", **kwargs)
        assert len(out) == 4


def test_gspo_aggregation_uses_agg_loss_convention():
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(4, 3, generator=gen)
    new = old + 0.01 * torch.randn(4, 3, generator=gen)
    adv = torch.randn(4, 1, generator=gen).expand(4, 3).contiguous()
    mask = torch.ones(4, 3)
    info = {"global_seqs": 8, "dp_size": 2}  # this rank holds 4 of 8 sequences
    local, *_ = compute_policy_loss_gspo(old, new, adv, mask)
    scaled, *_ = compute_policy_loss_gspo(old, new, adv, mask, global_batch_info=info)
    assert scaled.item() == pytest.approx(local.item() * 4 / 8 * 2, rel=1e-6)
