"""Masked reductions against hand-worked numbers."""

import math

import pytest
import torch

from algorithms import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [0, 1, 1]])  # selects 1, 2, 5, 6


def test_masked_sum_and_mean():
    assert masked_sum(VALUES, MASK).item() == 14.0
    assert masked_sum(VALUES, MASK, axis=-1).tolist() == [3.0, 11.0]
    assert masked_mean(VALUES, MASK).item() == 3.5
    assert masked_mean(VALUES, MASK, axis=-1).tolist() == [1.5, 5.5]
    assert masked_mean(VALUES, MASK.bool()).item() == 3.5


def test_masked_values_outside_mask_do_not_leak():
    poisoned = VALUES.clone()
    poisoned[0, 2] = float("nan")
    poisoned[1, 0] = float("inf")
    assert masked_sum(poisoned, MASK).item() == 14.0
    assert masked_mean(poisoned, MASK).item() == 3.5


def test_masked_mean_of_empty_selection_is_zero():
    mask = torch.tensor([[0, 0, 0], [1, 0, 0]])
    assert masked_mean(VALUES, mask, axis=-1).tolist() == [0.0, 4.0]
    assert masked_mean(VALUES, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_biased_and_unbiased():
    # selected 1, 2, 5, 6: mean 3.5, squared deviations 6.25 + 2.25 + 2.25 + 6.25 = 17
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(17 / 4)
    assert masked_var(VALUES, MASK).item() == pytest.approx(17 / 3)


def test_masked_var_unbiased_needs_two_elements():
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="more than one"):
        masked_var(VALUES, one)
    assert masked_var(VALUES, one, unbiased=False).item() == 0.0


def test_masked_whiten():
    out = masked_whiten(VALUES, MASK)
    std = math.sqrt(17 / 3 + 1e-8)
    assert out[0, 0].item() == pytest.approx(-2.5 / std, rel=1e-6)
    assert out[1, 2].item() == pytest.approx(2.5 / std, rel=1e-6)
    assert masked_mean(out, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(out, MASK).item() == pytest.approx(1.0, rel=1e-5)
    kept_mean = masked_whiten(VALUES, MASK, shift_mean=False)
    assert kept_mean[0, 0].item() == pytest.approx(3.5 - 2.5 / std, rel=1e-6)
    biased = masked_whiten(VALUES, MASK, unbiased=False)
    assert biased[0, 0].item() == pytest.approx(-2.5 / math.sqrt(17 / 4), rel=1e-6)
