"""Masked reductions over response tokens.

``mask`` is a bool or numeric tensor broadcastable to ``values``; non-zero entries select elements
(numeric masks act as weights in sums and counts). Values outside the mask never leak into the
result, not even NaN or inf (they are replaced by 0 before multiplying). Means over an empty
selection are 0 rather than NaN.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]

Axis = int | tuple[int, ...] | None


def _sum(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``axis`` (all elements when None)."""
    weight = mask.to(values.dtype)
    selected = torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return _sum(selected * weight, axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """``masked_sum / sum(mask)`` over ``axis``; 0 where the mask selects nothing."""
    total = masked_sum(values, mask, axis)
    count = _sum(mask.to(total.dtype).expand_as(values), axis)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements (a scalar).

    ``unbiased=True`` (the default, as verl) applies Bessel's correction n/(n-1), n = sum(mask); it
    needs n > 1 and raises ``ValueError`` otherwise. ``unbiased=False`` divides by n.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = float(mask.to(torch.float64).sum())
        if n <= 1:
            raise ValueError(
                f"masked_var(unbiased=True) needs more than one selected element, mask sums to {n:g}; "
                "use a larger batch or unbiased=False"
            )
        var = var * (n / (n - 1))
    return var


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with mean and variance over the selected elements.

    Variance is unbiased (Bessel-corrected) by default, as verl's. With ``shift_mean=False`` the
    mean is added back after scaling. Every element of ``values`` is transformed (callers multiply
    by the mask to zero padding).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
