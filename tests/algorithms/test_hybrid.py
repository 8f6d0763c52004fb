"""The ``hybrid`` advantage (algorithms/hybrid.py) on hand-worked examples."""

import math

import numpy as np
import pytest
import torch

from algorithms import get_adv_estimator_fn, run_adv_estimator
from algorithms.hybrid import (
    compute_hybrid_advantage,
    hybrid_advantage_terms,
    normalize_step_rewards,
    step_index_from_mask,
    step_rewards_per_token,
)

EPS = 1e-6


def test_registered_beside_grpo():
    assert get_adv_estimator_fn("hybrid") is compute_hybrid_advantage
    assert get_adv_estimator_fn("grpo") is not compute_hybrid_advantage


def test_step_index_from_mask_counts_runs_of_model_tokens():
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 1, 0],  # turn 0, observation, turn 1, padding
            [0, 1, 0, 1, 0, 1, 0, 0],  # three one-token turns after a masked position
            [0, 0, 0, 0, 0, 0, 0, 0],  # nothing trained
        ],
        dtype=torch.float32,
    )
    expect = torch.tensor(
        [
            [0, 0, -1, -1, 1, 1, 1, -1],
            [-1, 0, -1, 1, -1, 2, -1, -1],
            [-1] * 8,
        ]
    )
    assert torch.equal(step_index_from_mask(mask), expect)


def test_step_rewards_normalised_within_group_and_step_buckets():
    # rows 0-2: prompt "a"; row 3: prompt "b" (a bucket of one: no baseline -> 0)
    r = torch.tensor([[1.0, -1.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 1.0]])
    m = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])  # row 2 has no step 1
    out = normalize_step_rewards(r, m, np.array(["a", "a", "a", "b"], dtype=object), epsilon=EPS)
    # bucket (a, 0): 1, 0, -1 -> mean 0, unbiased std 1
    assert out[:3, 0].tolist() == pytest.approx([1 / (1 + EPS), 0.0, -1 / (1 + EPS)])
    # bucket (a, 1): -1, 1 (row 2 masked) -> mean 0, std sqrt(2)
    s = math.sqrt(2)
    assert out[0, 1].item() == pytest.approx(-1 / (s + EPS))
    assert out[1, 1].item() == pytest.approx(1 / (s + EPS))
    assert out[2, 1].item() == 0.0  # masked entry
    assert out[3].tolist() == [0.0, 0.0]  # group of one
    # centred only
    c = normalize_step_rewards(r, m, ["a", "a", "a", "b"], norm_by_std=False)
    assert c[:3, 0].tolist() == pytest.approx([1.0, 0.0, -1.0])
    assert c[:2, 1].tolist() == pytest.approx([-1.0, 1.0])


def test_step_values_land_on_their_turns_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 0]], dtype=torch.float32)
    per_step = torch.tensor([[0.5, -2.0]])  # the third turn (step 2) was not scored: 0
    out = step_rewards_per_token(per_step, mask)
    assert out.tolist() == [[0.5, 0.5, 0.0, -2.0, 0.0, 0.0, 0.0]]


def _batch():
    # two samples of one prompt: row 0 correct (score 1 on its last token), row 1 wrong
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    scores = torch.zeros(2, 5)
    scores[0, 3] = 1.0
    index = ["p", "p"]
    return scores, mask, index


def test_hybrid_hand_worked_all_terms():
    scores, mask, index = _batch()
    # PRM: row 0 steps (+1, +1), row 1 one step (-1). Bucket (p,0): +1,-1 -> +-1/sqrt2; bucket (p,1): single -> 0
    step_r = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    step_m = torch.tensor([[1, 1], [1, 0]])
    teacher = torch.tensor([[-1.0, -2.0, -9.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -9.0, -9.0]])
    old = torch.tensor([[-1.5, -1.0, -3.0, -0.5, -3.0], [-2.0, -2.0, -2.0, -3.0, -3.0]])
    hint = torch.tensor([1.0, 0.0])  # row 1: "no intervention"
    adv, ret = compute_hybrid_advantage(
        scores, mask, index, step_r, step_m, teacher, old, hint, w_rl=0.5, w_opd=2.0, epsilon=EPS
    )
    g = 1 / math.sqrt(2)  # GRPO: scores 1, 0 -> mean .5, unbiased std sqrt(.5) -> +-(.5/sqrt(.5))
    grpo0, grpo1 = 0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)
    p = 1 / (math.sqrt(2) + EPS)
    assert abs(g - p) < 1e-5
    # row 0: tokens 0,1 = step 0 (prm +p), token 3 = step 1 (prm 0); OPD = 2 * (teacher - old) on mask tokens
    expect0 = [
        0.5 * (grpo0 + p) + 2.0 * (-1.0 + 1.5),
        0.5 * (grpo0 + p) + 2.0 * (-2.0 + 1.0),
        0.0,  # observation token: nothing, whatever the teacher says
        0.5 * (grpo0 + 0.0) + 2.0 * 0.0,
        0.0,
    ]
    # row 1: no hint -> only the RL term; its only step gets -p
    expect1 = [0.5 * (grpo1 - p)] * 3 + [0.0, 0.0]
    assert adv[0].tolist() == pytest.approx(expect0, abs=1e-6)
    assert adv[1].tolist() == pytest.approx(expect1, abs=1e-6)
    assert torch.equal(adv, ret)


def test_opd_only_on_policy_tokens_and_hint_rows():
    scores, mask, index = _batch()
    teacher = torch.full((2, 5), -1.0)
    old = torch.full((2, 5), -3.0)
    t = hybrid_advantage_terms(scores, mask, index, None, None, teacher, old, torch.tensor([1, 0]))
    assert t.opd[0].tolist() == [2.0, 2.0, 0.0, 2.0, 0.0]
    assert t.opd[1].tolist() == [0.0] * 5
    assert t.prm.abs().sum() == 0  # no PRM scores given
    # opd_clip bounds the per-token log-ratio
    t = hybrid_advantage_terms(
        scores, mask, index, None, None, teacher, old, torch.tensor([1, 1]), opd_clip=0.5
    )
    assert t.opd.max().item() == 0.5


def test_weights_and_reduction_to_grpo():
    scores, mask, index = _batch()
    grpo = get_adv_estimator_fn("grpo")(scores, mask, index)[0]
    a, _ = compute_hybrid_advantage(scores, mask, index)  # no PRM, no teacher: GRPO
    assert torch.allclose(a, grpo)
    a, _ = compute_hybrid_advantage(scores, mask, index, w_rl=3.0)
    assert torch.allclose(a, 3 * grpo)
    # weights from a config object; w_rl = 0 leaves only OPD
    teacher, old = torch.zeros(2, 5), torch.full((2, 5), -1.0)
    a, _ = compute_hybrid_advantage(
        scores, mask, index, teacher_log_prob=teacher, old_log_probs=old, hint_mask=torch.ones(2),
        config={"w_rl": 0.0, "w_opd": 0.25},
    )  # fmt: skip
    assert torch.allclose(a, 0.25 * mask)
    # by name, with inputs it does not declare ignored
    a2, _ = run_adv_estimator(
        "hybrid", token_level_rewards=scores, response_mask=mask, index=index, values=None, gamma=1.0,
        teacher_log_prob=teacher, old_log_probs=old, hint_mask=torch.ones(2), w_rl=0.0, w_opd=0.25,
    )  # fmt: skip
    assert torch.allclose(a2, a)


def test_bad_inputs_are_named():
    scores, mask, index = _batch()
    with pytest.raises(ValueError, match="together"):
        hybrid_advantage_terms(scores, mask, index, teacher_log_prob=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="teacher_log_prob"):
        hybrid_advantage_terms(
            scores, mask, index, teacher_log_prob=torch.zeros(2, 4), old_log_probs=torch.zeros(2, 5),
            hint_mask=torch.ones(2),
        )  # fmt: skip
    with pytest.raises(ValueError, match="step_rewards and step_mask"):
        normalize_step_rewards(torch.zeros(2, 3), torch.zeros(2, 2), index)
