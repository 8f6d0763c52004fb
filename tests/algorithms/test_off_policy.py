"""Off-policy rollout corrections (algorithms.off_policy) against hand-worked examples and invariants."""

import math

import pytest
import torch

from algorithms import (
    OFF_POLICY_METRICS,
    compute_rollout_correction_decoupled_ppo,
    compute_rollout_correction_none,
    compute_rollout_correction_seq_tis,
    compute_rollout_correction_tis,
    get_policy_loss_fn,
    get_rollout_correction_fn,
    list_rollout_corrections,
    register_rollout_correction,
)

LN2 = math.log(2.0)


def probs(*values: float) -> torch.Tensor:
    """log of a 1 x R row of probabilities (float64 so hand-worked numbers compare tightly)."""
    return torch.tensor([values], dtype=torch.float64).log()


# proximal (old) and behaviour (rollout) probabilities of one 3-token row:
#   ratio = old / rollout = [0.5 / 0.25, 0.2 / 0.4, 0.3 / 0.3] = [2, 0.5, 1]
OLD = probs(0.5, 0.2, 0.3)
ROLLOUT = probs(0.25, 0.4, 0.3)
ONES = torch.ones(1, 3)


def metric(metrics: dict, name: str) -> float:
    return metrics[f"off_policy/{name}"].item()


def test_registry_names_and_unknown_name():
    assert list_rollout_corrections() == ["decoupled_ppo", "none", "seq_tis", "tis"]
    assert get_rollout_correction_fn("tis") is compute_rollout_correction_tis
    assert get_rollout_correction_fn("seq_tis") is compute_rollout_correction_seq_tis
    assert get_rollout_correction_fn("decoupled_ppo") is compute_rollout_correction_decoupled_ppo
    assert get_rollout_correction_fn("none") is compute_rollout_correction_none
    with pytest.raises(ValueError, match=r"unknown rollout correction 'icepop'.*'decoupled_ppo', 'none'"):
        get_rollout_correction_fn("icepop")
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_correction("tis")(compute_rollout_correction_none)


def test_tis_by_hand():
    # cap 1.5: min([2, 0.5, 1], 1.5) = [1.5, 0.5, 1]; one of three tokens changed by the cap
    weights, metrics = compute_rollout_correction_tis(OLD, ROLLOUT, ONES, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))
    assert set(metrics) == set(OFF_POLICY_METRICS)
    assert metric(metrics, "is_weight_mean") == pytest.approx((1.5 + 0.5 + 1.0) / 3)
    assert metric(metrics, "is_weight_max") == pytest.approx(1.5)
    assert metric(metrics, "is_weight_min") == pytest.approx(0.5)
    assert metric(metrics, "is_clipped_frac") == pytest.approx(1 / 3)
    # rollout - old = [-ln 2, ln 2, 0]: the k1 KL estimate averages to 0; the largest |log-ratio| is ln 2
    assert metric(metrics, "behaviour_kl") == pytest.approx(0.0, abs=1e-12)
    assert metric(metrics, "log_ratio_abs_max") == pytest.approx(LN2)
    # no cap: plain token IS, the raw ratios
    weights, metrics = compute_rollout_correction_tis(OLD, ROLLOUT, ONES, cap=None)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64))
    assert metric(metrics, "is_clipped_frac") == 0.0


def test_masked_token_gets_weight_zero_and_leaves_the_metrics():
    # mask [1, 0, 1]: the 0.5 token is padding (and holds NaN, which must not leak)
    old = OLD.clone()
    old[0, 1] = float("nan")
    mask = torch.tensor([[1, 0, 1]])
    weights, metrics = compute_rollout_correction_tis(old, ROLLOUT, mask, cap=1.5)
    # valid ratios [2, 1] -> [1.5, 1]; padding 0
    assert torch.equal(weights, torch.tensor([[1.5, 0.0, 1.0]], dtype=torch.float64))
    assert metric(metrics, "is_weight_mean") == pytest.approx((1.5 + 1.0) / 2)
    assert metric(metrics, "is_weight_min") == pytest.approx(1.0)  # not the padding's 0
    assert metric(metrics, "is_clipped_frac") == pytest.approx(1 / 2)
    # rollout - old on valid tokens = [-ln 2, 0] -> mean -ln 2 / 2
    assert metric(metrics, "behaviour_kl") == pytest.approx(-LN2 / 2)
    assert metric(metrics, "log_ratio_abs_max") == pytest.approx(LN2)
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_behaviour_kl_by_hand_is_the_same_for_every_correction():
    # ratio old / rollout = [0.2 / 0.4, 0.3 / 0.3, 0.1 / 0.4] = [0.5, 1, 0.25]
    # rollout - old = [ln 2, 0, ln 4] -> mean = (ln 2 + 2 ln 2) / 3 = ln 2; max |.| = ln 4
    old, rollout = probs(0.2, 0.3, 0.1), probs(0.4, 0.3, 0.4)
    for name in list_rollout_corrections():
        _, metrics = get_rollout_correction_fn(name)(old, rollout, ONES, cap=2.0)
        assert metric(metrics, "behaviour_kl") == pytest.approx(LN2), name
        assert metric(metrics, "log_ratio_abs_max") == pytest.approx(2 * LN2), name


def test_seq_tis_by_hand():
    # row 0: ratios [2, 0.5, 1]              -> product 1
    # row 1: ratios [0.8/0.2, 0.1/0.1, 0.6/0.9] = [4, 1, 2/3] -> product 8/3
    # row 2: all padding                       -> weight 0, not a row for is_clipped_frac
    old = torch.cat([OLD, probs(0.8, 0.1, 0.6), probs(0.5, 0.5, 0.5)])
    rollout = torch.cat([ROLLOUT, probs(0.2, 0.1, 0.9), probs(0.1, 0.1, 0.1)])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    weights, metrics = compute_rollout_correction_seq_tis(old, rollout, mask, cap=2.0)
    # cap 2: row 0 keeps 1, row 1 is cut from 8/3 to 2 (1 of 2 rows clipped)
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(weights, expected)
    assert metric(metrics, "is_clipped_frac") == pytest.approx(1 / 2)
    assert metric(metrics, "is_weight_mean") == pytest.approx((3 * 1.0 + 3 * 2.0) / 6)
    assert metric(metrics, "is_weight_max") == pytest.approx(2.0)
    assert metric(metrics, "is_weight_min") == pytest.approx(1.0)
    # cap 3 clips nothing: row 1 keeps 8/3
    weights, metrics = compute_rollout_correction_seq_tis(old, rollout, mask, cap=3.0)
    assert weights[1].tolist() == pytest.approx([8 / 3] * 3)
    assert metric(metrics, "is_clipped_frac") == 0.0
    # padding row 1's last token: the product is over valid tokens only, 4 * 1 = 4
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    weights, _ = compute_rollout_correction_seq_tis(old, rollout, mask, cap=None)
    assert weights[1].tolist() == pytest.approx([4.0, 4.0, 0.0])


def test_seq_tis_does_not_overflow():
    # 50 tokens of log-ratio 10: the sum 500 would overflow exp; it is clamped to 20 first
    old = torch.full((1, 50), -1.0)
    rollout = torch.full((1, 50), -11.0)
    mask = torch.ones(1, 50)
    weights, metrics = compute_rollout_correction_seq_tis(old, rollout, mask, cap=None)
    assert torch.allclose(weights, torch.full((1, 50), math.exp(20.0)))
    assert all(math.isfinite(v.item()) for v in metrics.values())
    weights, _ = compute_rollout_correction_seq_tis(old, rollout, mask, cap=2.0)
    assert torch.equal(weights, torch.full((1, 50), 2.0))


def test_decoupled_ppo_masks_tokens_above_the_cap():
    # ratios [2, 0.5, 1], cap 1.5: the 2 is masked out (weight 0), the others keep their untruncated ratio
    weights, metrics = compute_rollout_correction_decoupled_ppo(OLD, ROLLOUT, ONES, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[0.0, 0.5, 1.0]], dtype=torch.float64))
    assert metric(metrics, "is_clipped_frac") == pytest.approx(1 / 3)
    assert metric(metrics, "is_weight_mean") == pytest.approx((0.0 + 0.5 + 1.0) / 3)
    assert metric(metrics, "is_weight_max") == pytest.approx(1.0)
    assert metric(metrics, "is_weight_min") == 0.0
    # cap 2.5 (or None) masks nothing: the raw ratios, no truncation as tis would do at cap 1.5
    for cap in (2.5, None):
        weights, metrics = compute_rollout_correction_decoupled_ppo(OLD, ROLLOUT, ONES, cap=cap)
        assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64))
        assert metric(metrics, "is_clipped_frac") == 0.0


def test_none_reports_the_gap_without_weights():
    weights, metrics = compute_rollout_correction_none(OLD, ROLLOUT, ONES, cap=2.0)
    assert weights is None
    # raw ratios [2, 0.5, 1]
    assert metric(metrics, "is_weight_mean") == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    assert metric(metrics, "is_weight_max") == pytest.approx(2.0)
    assert metric(metrics, "is_weight_min") == pytest.approx(0.5)
    assert metric(metrics, "is_clipped_frac") == 0.0
    assert metric(metrics, "log_ratio_abs_max") == pytest.approx(LN2)


def test_weights_and_metrics_are_detached():
    old = OLD.clone().requires_grad_(True)
    rollout = ROLLOUT.clone().requires_grad_(True)
    for name in list_rollout_corrections():
        weights, metrics = get_rollout_correction_fn(name)(old, rollout, ONES, cap=1.5)
        if weights is not None:
            assert not weights.requires_grad, name
        assert not any(v.requires_grad for v in metrics.values()), name


def test_on_policy_gives_weight_one_on_valid_tokens():
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(4, 6, generator=gen) - 2.0
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    for name in ("tis", "seq_tis", "decoupled_ppo"):
        for cap in (2.0, None):
            weights, metrics = get_rollout_correction_fn(name)(log_prob, log_prob.clone(), mask, cap=cap)
            assert torch.equal(weights, mask), (name, cap)
            assert metric(metrics, "is_weight_mean") == 1.0
            assert metric(metrics, "is_clipped_frac") == 0.0
            assert metric(metrics, "behaviour_kl") == 0.0
    weights, _ = compute_rollout_correction_none(log_prob, log_prob.clone(), mask, cap=2.0)
    assert weights is None


def test_empty_mask_gives_zero_weights_and_metrics():
    mask = torch.zeros(1, 3)
    for name in ("tis", "seq_tis", "decoupled_ppo"):
        weights, metrics = get_rollout_correction_fn(name)(OLD, ROLLOUT, mask, cap=1.5)
        assert torch.equal(weights, torch.zeros(1, 3, dtype=torch.float64)), name
        assert all(v.item() == 0.0 for v in metrics.values()), name


def test_tis_weights_through_the_vanilla_loss_by_hand():
    # tis cap 1.5 on ratios old/rollout [2, 0.5, 1] -> w = [1.5, 0.5, 1]
    weights, _ = compute_rollout_correction_tis(OLD, ROLLOUT, ONES, cap=1.5)
    # current policy: r = pi_theta / pi_old = [1.1, 1.5, 1.5], A = [1, 1, -1], clip 0.2, dual clip 3
    #   token 0: max(-1.1, -clip(1.1) = -1.1) = -1.1 (inside the clip range, d/dlogp = -A r = -1.1)
    #   token 1: max(-1.5, -1.2) = -1.2                (clipped, no gradient)
    #   token 2: max(1.5, 1.2) = 1.5, min(1.5, 3) = 1.5 (d/dlogp = -A r = 1.5)
    # weighted token-mean: (1.5 * -1.1 + 0.5 * -1.2 + 1 * 1.5) / 3 = (-1.65 - 0.6 + 1.5) / 3 = -0.25
    # gradient: w * d/dlogp / 3 = [1.5 * -1.1 / 3, 0, 1 * 1.5 / 3] = [-0.55, 0, 0.5]
    log_prob = (OLD + torch.tensor([[1.1, 1.5, 1.5]], dtype=torch.float64).log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, *_ = get_policy_loss_fn("vanilla")(
        OLD, log_prob, advantages, ONES, "token-mean", clip_ratio=0.2, rollout_is_weights=weights
    )
    assert loss.item() == pytest.approx(-0.25, rel=1e-9)
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([-0.55, 0.0, 0.5], rel=1e-9)


def test_invalid_inputs_name_the_argument():
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_rollout_correction_tis(OLD, torch.zeros(1, 4), ONES, cap=2.0)
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        compute_rollout_correction_tis(OLD[0], ROLLOUT[0], ONES[0], cap=2.0)
    with pytest.raises(ValueError, match="old_log_prob must be a floating-point"):
        compute_rollout_correction_tis(torch.zeros(1, 3, dtype=torch.long), ROLLOUT, ONES, cap=2.0)
    for name in list_rollout_corrections():
        for cap in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="cap must be > 0"):
                get_rollout_correction_fn(name)(OLD, ROLLOUT, ONES, cap=cap)
