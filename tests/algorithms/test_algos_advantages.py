"""Advantage estimators against hand-worked examples, loop references and invariants."""

import math

import numpy as np
import pytest
import torch

from algorithms import (
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    masked_whiten,
    register_adv_est,
    run_adv_estimator,
)
from algorithms.advantages import group_normalize
from algorithms.registry import ADV_ESTIMATOR_REGISTRY

# Six responses: group "a" scores 1, 2, 3; group "b" scores 0, 4; group "c" a single score 5.
UIDS = np.array(["a", "b", "a", "c", "b", "a"], dtype=object)
SCORES = [1.0, 0.0, 2.0, 5.0, 4.0, 3.0]
LENGTHS = [3, 1, 2, 4, 4, 3]
R = 4


def _outcome_batch():
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    rewards = torch.zeros(len(SCORES), R)
    for i, (s, n) in enumerate(zip(SCORES, LENGTHS)):
        rewards[i, n - 1] = s  # outcome score on the last response token
    return rewards, mask


def _per_row(adv, mask):
    """The one scalar each row broadcasts (and check it is broadcast over exactly the valid tokens)."""
    scalars = adv[:, 0]
    torch.testing.assert_close(adv, scalars[:, None] * mask)
    return scalars.tolist()


def test_grpo_by_hand():
    rewards, mask = _outcome_batch()
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, UIDS)
    assert torch.equal(adv, ret)
    # a: mean 2, unbiased std 1 -> -1, 0, 1; b: mean 2, std sqrt(8) -> -/+ 2/sqrt(8); c: single -> 0
    s8 = 2 / math.sqrt(8)
    expected = [
        -1 / (1 + 1e-6),
        -2 / (math.sqrt(8) + 1e-6),
        0.0,
        0.0,
        2 / (math.sqrt(8) + 1e-6),
        1 / (1 + 1e-6),
    ]
    assert _per_row(adv, mask) == pytest.approx(expected, rel=1e-6)
    assert expected[1] == pytest.approx(-s8, rel=1e-5)


def test_dr_grpo_by_hand():
    rewards, mask = _outcome_batch()
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, UIDS, norm_adv_by_std_in_grpo=False)
    assert _per_row(adv, mask) == pytest.approx([-1.0, -2.0, 0.0, 0.0, 2.0, 1.0])


def _grpo_loop_reference(scores, uids, eps, norm):
    out = []
    for i, u in enumerate(uids):
        group = [scores[j] for j in range(len(uids)) if uids[j] == u]
        if len(group) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((scores[i] - mean) / (std + eps) if norm else scores[i] - mean)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_random_matches_loop_and_invariants(norm):
    gen = torch.Generator().manual_seed(3)
    batch = 24
    uids = [f"p{int(k)}" for k in torch.randint(0, 6, (batch,), generator=gen)]
    uids[0] = "constant"
    uids[1] = "constant"
    uids[2] = "constant"
    rewards = torch.zeros(batch, 5)
    rewards[:, -1] = torch.randint(0, 3, (batch,), generator=gen).float()
    rewards[:3, -1] = 1.0  # constant-reward group
    rewards[:, 2] = torch.rand(batch, generator=gen)  # also a mid-sequence reward: scores sum all tokens
    rewards[:3, 2] = 0.25
    mask = torch.ones(batch, 5)
    adv, _ = compute_grpo_outcome_advantage(
        rewards, mask, np.array(uids, dtype=object), norm_adv_by_std_in_grpo=norm
    )
    scalars = adv[:, 0]
    expected = _grpo_loop_reference(rewards.sum(-1).tolist(), uids, 1e-6, norm)
    assert scalars.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for u in set(uids):
        rows = [i for i, x in enumerate(uids) if x == u]
        assert scalars[rows].sum().item() == pytest.approx(0.0, abs=1e-5)
    assert scalars[:3].tolist() == [0.0, 0.0, 0.0]


def test_grpo_index_types_agree():
    rewards, mask = _outcome_batch()
    as_array, _ = compute_grpo_outcome_advantage(rewards, mask, UIDS)
    as_list, _ = compute_grpo_outcome_advantage(rewards, mask, list(UIDS))
    as_tensor, _ = compute_grpo_outcome_advantage(rewards, mask, torch.tensor([0, 1, 0, 2, 1, 0]))
    assert torch.equal(as_array, as_list) and torch.equal(as_array, as_tensor)
    with pytest.raises(ValueError, match="index has 5 entries but the batch has 6"):
        compute_grpo_outcome_advantage(rewards, mask, UIDS[:5])


def test_rloo_by_hand():
    rewards, mask = _outcome_batch()
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, UIDS)
    # a: 1 - 2.5, 2 - 2, 3 - 1.5; b: 0 - 4, 4 - 0; c: single, baseline 0 -> 5
    assert _per_row(adv, mask) == pytest.approx([-1.5, -4.0, 0.0, 5.0, 4.0, 1.5])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_baseline_by_hand():
    rewards, mask = _outcome_batch()
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, UIDS)
    centred = torch.tensor([-1.0, -2.0, 0.0, 5.0, 2.0, 1.0])  # c keeps its raw score (baseline 0)
    tokens = [centred[i].item() for i in range(6) for _ in range(LENGTHS[i])]  # 17 valid tokens
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1))
    expected = (centred[:, None] - mean) / std * mask
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]]))
    valid = [0.25, 0.5, 1.0, 1.0, 0.0]
    mean = sum(valid) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 4)
    expected = torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, mean]]).sub(mean).div(std) * mask
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    # gamma from a verl-style config when not given
    _, ret_cfg = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    torch.testing.assert_close(ret_cfg, ret)


def test_reinforce_plus_plus_skips_observation_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # row 0: turn, observation, turn
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0], [0.5, 1.0, 0.0]]))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    mask = torch.ones(1, 2)
    # gamma = lam = 1: A1 = 1 - 0.2 = 0.8; A0 = (0 + 0.2 - 0.5) + 0.8 = 0.5; returns = A + V = 1, 1
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]) / math.sqrt(2), rtol=1e-5, atol=1e-6)
    # gamma 0.9, lam 0.8: A1 = 0.8; A0 = 0.9 * 0.2 - 0.5 + 0.72 * 0.8 = 0.256; returns 0.756, 1.0
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor([[0.756, 1.0]]))


def test_gae_skips_observation_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.2], [0.5, 0.0, 0.2]])  # 9.0 sits on an observation token
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 0: A2 = 0.8; observation skipped; A0 = 0 + 0.2 - 0.5 + 0.8 = 0.5 -> returns 1, (0), 1
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))


def _gae_loop_reference(r, v, m, gamma, lam):
    batch, length = len(r), len(r[0])
    out = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        valid = [t for t in range(length) if m[b][t]]
        running = 0.0
        for k in range(len(valid) - 1, -1, -1):
            t = valid[k]
            next_v = v[b][valid[k + 1]] if k + 1 < len(valid) else 0.0
            running = r[b][t] + gamma * next_v - v[b][t] + gamma * lam * running
            out[b][t] = running
    return out


def test_gae_matches_loop_reference():
    gen = torch.Generator().manual_seed(5)
    batch, length = 5, 6
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 4, 3, 6])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    mask[4, 2] = 0.0  # an observation token
    rewards = rewards * mask
    gamma, lam = 0.97, 0.9
    raw = torch.tensor(
        _gae_loop_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam), dtype=torch.float64
    )
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(ret, (raw + values) * mask)
    torch.testing.assert_close(adv, masked_whiten(raw, mask) * mask)


def test_gae_lambda_one_gamma_one_zero_values_is_reward_to_go():
    gen = torch.Generator().manual_seed(7)
    batch, length = 4, 5
    lengths = torch.tensor([5, 2, 3, 1])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(batch, length, generator=gen) * mask
    adv, ret = compute_gae_advantage_return(rewards, torch.zeros(batch, length), mask, gamma=1.0, lam=1.0)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, masked_whiten(to_go, mask) * mask)


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, torch.tensor([1.5, 0.5]), mask)
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_remax_outcome_advantage(rewards, torch.tensor([1.0]), mask)


def test_registry_names_and_unknown_name_lists_them():
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn(AdvantageEstimator.GAE) is compute_gae_advantage_return
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        assert name in ADV_ESTIMATOR_REGISTRY
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpoo'.*'gae'.*'grpo'"):
        get_adv_estimator_fn("grpoo")


def test_registry_is_open_and_guards_duplicates():
    try:

        @register_adv_est("test_hybrid")
        def hybrid(token_level_rewards, response_mask, index, weight=2.0):
            adv = weight * token_level_rewards.sum(-1, keepdim=True) * response_mask
            return adv, adv

        rewards, mask = _outcome_batch()
        adv, _ = run_adv_estimator(
            "test_hybrid",
            token_level_rewards=rewards,
            response_mask=mask,
            index=UIDS,
            values=torch.zeros_like(rewards),
            gamma=1.0,
        )
        assert _per_row(adv, mask) == [2 * s for s in SCORES]
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_hybrid")(lambda **kw: None)
        register_adv_est("test_hybrid", override=True)(compute_rloo_outcome_advantage)
        assert get_adv_estimator_fn("test_hybrid") is compute_rloo_outcome_advantage
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_hybrid", None)


def test_run_adv_estimator_passes_declared_inputs_only():
    rewards, mask = _outcome_batch()
    inputs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=UIDS,
        values=torch.zeros_like(rewards),
        gamma=1.0,
        lam=1.0,
        norm_adv_by_std_in_grpo=False,
    )
    adv, _ = run_adv_estimator("grpo", **inputs)
    assert _per_row(adv, mask) == pytest.approx([-1.0, -2.0, 0.0, 0.0, 2.0, 1.0])
    _, ret = run_adv_estimator(AdvantageEstimator.GAE, **inputs)
    torch.testing.assert_close(ret, rewards.flip(-1).cumsum(-1).flip(-1) * mask)
    with pytest.raises(TypeError, match=r"'remax' needs \['reward_baselines'\]"):
        run_adv_estimator("remax", **inputs)


def test_group_normalize_is_grpos_and_the_prm_buckets_normalisation():
    values = torch.tensor([1.0, 0.0, 2.0, 5.0, 4.0, 3.0])
    ids = torch.tensor([0, 1, 0, 2, 1, 0])  # group 0: 1, 2, 3 (mean 2, std 1); group 1: 0, 4; group 2 alone
    out = group_normalize(values, ids, 3, epsilon=0.0)
    assert out.tolist() == pytest.approx([-1.0, -2 / math.sqrt(8), 0.0, 0.0, 2 / math.sqrt(8), 1.0])
    assert group_normalize(values, ids, 3, norm_by_std=False).tolist() == [-1.0, -2.0, 0.0, 0.0, 2.0, 1.0]
