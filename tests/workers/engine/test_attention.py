"""The packed attention ``hyflow_varlen`` (workers/models/attention.py): batching several sequences into one
padded call gives the outputs and gradients of one causal call per sequence; a shared prompt's branches give
those of each branch attended after its own copy of the prompt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.attention import MAX_PADDING_RATIO, attention_plan, varlen_sdpa_attention_forward

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


class CausalModule:
    is_causal = True


def per_sequence(q, k, v, bounds, window=None):
    """The reference: one call per sequence (a banded mask for a sliding window)."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        mask = None
        if window is not None:
            i = torch.arange(n)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        qs, ks, vs = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2)


def packed_inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, HEADS, total, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=g, requires_grad=True)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return q, k, v, bounds


def assert_same_outputs_and_gradients(out, ref, inputs):
    """``out`` equals ``ref``, and so do the gradients of one random projection of each through ``inputs``."""
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    mine = torch.autograd.grad((out * grad).sum(), inputs)
    theirs = torch.autograd.grad((ref * grad).sum(), inputs)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lengths, window",
    [
        ([20, 25, 28, 13, 27, 22, 3, 1], None),  # RL-like: many short sequences, one padded call
        ([200, 7, 9, 180, 12, 1, 150], None),  # long ones apart from short ones; order restored
        ([30, 12, 25, 6], 8),  # a sliding window shorter than some sequences
    ],
)
def test_batched_attention_equals_one_call_per_sequence(lengths, window):
    q, k, v, bounds = packed_inputs(lengths)
    cu = torch.tensor(bounds)
    out, _ = varlen_sdpa_attention_forward(
        CausalModule(), q, k, v, None, sliding_window=window, cu_seq_lens_q=cu
    )
    ref = per_sequence(q, k, v, bounds, window)
    assert_same_outputs_and_gradients(out, ref, (q, k, v))


def test_plan_batches_short_sequences_and_keeps_padding_bounded():
    lengths = [200, 7, 9, 180, 12, 1, 150]
    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    plan = attention_plan(bounds)
    batched = [g for g in plan.groups if g.index is not None]
    members = sorted(int(g.index.shape[0]) for g in batched)
    assert sum(members) + len(plan.groups) - len(batched) == len(lengths)
    for g in batched:
        real = (g.valid.sum(1) ** 2).sum()
        assert g.valid.numel() * g.valid.shape[1] <= MAX_PADDING_RATIO * real  # padded scores vs real ones
    assert plan.restore is not None  # longest first: the outputs are put back in packed order
    # equal short lengths: a single call with no padding, outputs already in order
    same = attention_plan((0, 10, 20, 30, 40))
    assert len(same.groups) == 1 and bool(same.groups[0].valid.all()) and same.restore is None


def per_branch(q, k, v, prompt: int, branches: list[int]):
    """The reference of one shared-prompt segment: the prompt alone, and each branch after its own copy of the
    prompt (one causal call each), the prompt's outputs taken from its own call."""
    outs = [F.scaled_dot_product_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], is_causal=True,
                                           enable_gqa=True)]  # fmt: skip
    start = prompt
    for n in branches:
        seq = torch.cat([torch.arange(prompt), torch.arange(start, start + n)])
        o = F.scaled_dot_product_attention(
            q[:, :, seq], k[:, :, seq], v[:, :, seq], is_causal=True, enable_gqa=True
        )
        outs.append(o[:, :, prompt:])
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize(
    "segments",
    [
        [(6, [3, 1, 4])],  # one group alone: a padded call of one segment
        [(6, [3, 1, 4]), (9, []), (4, [2, 2]), (1, [])],  # groups beside plain sequences, one padded call
        [(150, [5, 9]), (7, [3]), (200, [])],  # a long shared prompt apart from the short ones
    ],
)
def test_shared_prompt_branches_equal_each_branch_after_its_own_prompt(segments):
    lengths = [p + sum(b) for p, b in segments]
    q, k, v, bounds = packed_inputs(lengths, seed=3)
    branches = tuple(tuple(b) for _, b in segments)
    out, _ = varlen_sdpa_attention_forward(
        CausalModule(), q, k, v, None, cu_seq_lens_q=torch.tensor(bounds), hyflow_branches=branches
    )
    ref = torch.cat(
        [per_branch(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], p, b) for (p, b), s, e in
         zip(segments, bounds[:-1], bounds[1:])], dim=1,
    )  # fmt: skip
    assert_same_outputs_and_gradients(out, ref, (q, k, v))


def test_shared_prompts_are_refused_where_they_cannot_be_honoured():
    q, k, v, bounds = packed_inputs([8])
    branches = ((3, 2),)
    with pytest.raises(ValueError, match="need a packed row"):  # a padding mask: sdpa would mix the branches
        varlen_sdpa_attention_forward(
            CausalModule(), q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool), hyflow_branches=branches
        )
    with pytest.raises(ValueError, match="sliding-window"):
        attention_plan(tuple(bounds), 4, branches)
    with pytest.raises(ValueError, match="cannot hold branches"):
        attention_plan(tuple(bounds), None, ((5, 3),))  # no prompt token left
