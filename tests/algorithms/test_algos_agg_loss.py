"""agg_loss: hand-worked values, and micro-batch / data-parallel invariance of value and gradient."""

import pytest
import torch

from algorithms import LOSS_AGG_MODES, agg_loss, make_global_batch_info

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # row sums 3 and 26; row 3 empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 29 / 6),
        ("seq-mean-token-sum", (3 + 26) / 2),
        ("seq-mean-token-mean", (1.5 + 6.5) / 2),
        ("seq-mean-token-sum-norm", 29 / (2 * 4)),
    ],
)
def test_local_normalisation_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 29 / 12 * 3),
        ("seq-mean-token-sum", 29 / 4 * 3),
        ("seq-mean-token-mean", 8 / 4 * 3),
        ("seq-mean-token-sum-norm", 29 / (4 * 4) * 3),
    ],
)
def test_global_normalisation_by_hand(mode, expected):
    info = {"global_tokens": 12, "global_seqs": 4, "dp_size": 3}
    assert agg_loss(LOSS, MASK, mode, global_batch_info=info).item() == pytest.approx(expected)


def test_loss_scale_factor_and_verl_aliases():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=2).item() == pytest.approx(
        29 / 4
    )
    info = {"global_seqs": 4, "loss_scale_factor": 2}
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", info).item() == pytest.approx(29 / 8)
    verl = {"batch_num_tokens": 12, "global_batch_size": 4, "dp_size": 3}
    assert agg_loss(LOSS, MASK, "token-mean", verl).item() == pytest.approx(29 / 12 * 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", verl).item() == pytest.approx(29 / 4 * 3)


def test_all_masked_gives_zero_not_nan():
    loss = LOSS.clone().requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        out = agg_loss(loss, torch.zeros_like(MASK), mode)
        assert out.item() == 0.0
        (grad,) = torch.autograd.grad(out, loss)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_errors_name_the_bad_argument():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-mean'.*token-mean"):
        agg_loss(LOSS, MASK, "seq-mean")
    with pytest.raises(ValueError, match="unknown key 'tokens'.*global_tokens"):
        agg_loss(LOSS, MASK, "token-mean", {"tokens": 3})
    with pytest.raises(ValueError, match="lacks 'global_tokens'"):
        agg_loss(LOSS, MASK, "token-mean", {"global_seqs": 2})
    with pytest.raises(ValueError, match="lacks 'global_seqs'"):
        agg_loss(LOSS, MASK, "seq-mean-token-mean", {"global_tokens": 2})
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(LOSS, MASK, "token-mean", {"global_tokens": 2, "dp_size": 0})
    with pytest.raises(ValueError, match="twice"):
        agg_loss(LOSS, MASK, "token-mean", {"global_tokens": 2, "batch_num_tokens": 2})
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        agg_loss(LOSS, MASK[:, :3], "token-mean")


def test_make_global_batch_info_counts():
    info = make_global_batch_info([MASK[:2], MASK[2:]], dp_size=2)
    assert info == {"global_tokens": 6.0, "global_seqs": 2, "dp_size": 2}
    assert make_global_batch_info(MASK) == {"global_tokens": 6.0, "global_seqs": 2, "dp_size": 1}


def _random_split(n: int, parts: int, gen: torch.Generator) -> list[int]:
    """Split n items into `parts` non-empty consecutive chunk sizes."""
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: parts - 1].add(1).tolist())
    bounds = [0, *cuts, n]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_micro_batch_and_dp_sum_equals_full_batch(mode, dp_size, seed):
    """Per rank: sum agg_loss over micro-batches; across ranks: AVG. Must equal one full-batch call."""
    gen = torch.Generator().manual_seed(seed)
    batch, length = 12, 7
    base = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[3] = 0  # at least one fully masked row
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    mask[0, 1] = 0  # a hole (observation token) inside a response
    w = torch.randn(length, generator=gen, dtype=torch.float64, requires_grad=True)

    def loss_mat(rows):
        return torch.sin(base[rows] * w) + base[rows] ** 2 * w

    all_rows = torch.arange(batch)
    full = agg_loss(loss_mat(all_rows), mask, mode)
    (full_grad,) = torch.autograd.grad(full, w)

    perm = torch.randperm(batch, generator=gen)
    rank_rows, start = [], 0
    for size in _random_split(batch, dp_size, gen):
        rank_rows.append(perm[start : start + size])
        start += size
    rank_micro = []
    for rows in rank_rows:
        n_micro = min(len(rows), 1 + seed + 1)
        sizes = _random_split(len(rows), n_micro, gen)
        rank_micro.append(list(torch.split(rows, sizes)))

    # each rank counts its own masks; the engine SUM-all-reduces the two counts
    per_rank = [make_global_batch_info([mask[m] for m in micros], dp_size) for micros in rank_micro]
    info = {
        "global_tokens": sum(p["global_tokens"] for p in per_rank),
        "global_seqs": sum(p["global_seqs"] for p in per_rank),
        "dp_size": dp_size,
    }
    values, grads = [], []
    for micros in rank_micro:
        rank_total = sum(agg_loss(loss_mat(m), mask[m], mode, global_batch_info=info) for m in micros)
        (g,) = torch.autograd.grad(rank_total, w)
        values.append(rank_total.detach())
        grads.append(g)
    avg_value = torch.stack(values).mean()  # DP AVG all-reduce
    avg_grad = torch.stack(grads).mean(dim=0)
    torch.testing.assert_close(avg_value, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(avg_grad, full_grad, rtol=1e-12, atol=1e-12)


def test_local_normalisation_is_not_layout_invariant():
    """Guards the test above: summing locally normalised micro-batch losses does differ."""
    full = agg_loss(LOSS, MASK, "token-mean")
    split = agg_loss(LOSS[:1], MASK[:1], "token-mean") + agg_loss(LOSS[1:], MASK[1:], "token-mean")
    assert abs(split.item() - full.item()) > 0.1
    info = make_global_batch_info(MASK)
    split_global = sum(agg_loss(LOSS[s], MASK[s], "token-mean", info) for s in (slice(0, 1), slice(1, 3)))
    assert split_global.item() == pytest.approx(full.item())
