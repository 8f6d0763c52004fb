"""The kernels of packed attention (workers/models/packed_kernels.py, ``model.packed_attention``).

On the CPU: FlexAttention's forward (torch has no FlexAttention backward on the CPU) against one call per
sequence and per shared-prompt branch, its block mask against torch's own `create_block_mask` of the same rule,
the engine's forward-only passes with flex against the sdpa kernel's, the varlen FlashAttention adapter against a
CPU stand-in of the CUDA kernel, and the refusals. On CUDA (``gpu``-marked): values and gradients of flex and
flash against the sdpa kernel, and one engine update with each."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.workers.engine import engine_testlib as T
from tests.workers.engine.test_attention import (
    CausalModule,
    packed_inputs,
    per_branch,
    per_sequence,
)
from workers.engine import EngineConfig, FSDPEngine, OptimConfig
from workers.models.attention import varlen_sdpa_attention_forward
from workers.models.packed_kernels import attends, flex_layout, packed_block_mask, resolve_packed_kernel

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/workers/conftest.py

R = 10  # engine_testlib's response length


def attend(kernel, q, k, v, bounds, window=None, branches=()):
    out, _ = varlen_sdpa_attention_forward(
        CausalModule(), q, k, v, None, sliding_window=window, cu_seq_lens_q=torch.tensor(bounds),
        hyflow_branches=branches, hyflow_kernel=kernel,
    )  # fmt: skip
    return out


def detached(inputs):
    """packed_inputs without gradients: torch has no FlexAttention backward on the CPU."""
    q, k, v, bounds = inputs
    return q.detach(), k.detach(), v.detach(), bounds


@pytest.fixture(autouse=True)
def quiet_eager_flex():
    # eager FlexAttention (the CPU's) warns that it is unfused: expected here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize(
    "lengths, window",
    [
        ([20, 25, 28, 13, 27, 22, 3, 1], None),  # many short sequences: several in one 128-token block
        ([200, 7, 9, 180, 12, 1, 150], None),  # sequences across block edges, 559 tokens: padded to 640
        ([30, 12, 25, 6], 8),  # a sliding window shorter than some sequences
        ([256], None),  # one sequence, a multiple of the block: no padding
    ],
)
def test_flex_equals_one_call_per_sequence(lengths, window):
    q, k, v, bounds = detached(packed_inputs(lengths))
    torch.testing.assert_close(
        attend("flex", q, k, v, bounds, window), per_sequence(q, k, v, bounds, window), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize(
    "segments",
    [
        [(6, [3, 1, 4]), (9, []), (4, [2, 2]), (1, [])],
        [(150, [5, 9]), (7, [3]), (200, [])],  # a long shared prompt across block edges
    ],
)
def test_flex_shared_prompt_branches_equal_each_branch_after_its_own_prompt(segments):
    lengths = [p + sum(b) for p, b in segments]
    q, k, v, bounds = detached(packed_inputs(lengths, seed=3))
    branches = tuple(tuple(b) for _, b in segments)
    ref = torch.cat(
        [per_branch(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], p, b) for (p, b), s, e in
         zip(segments, bounds[:-1], bounds[1:])], dim=1,
    )  # fmt: skip
    torch.testing.assert_close(attend("flex", q, k, v, bounds, branches=branches), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize(
    "bounds, branches, window",
    [
        ((0, 20, 45, 73, 86, 113, 135, 138, 139), (), None),
        ((0, 130, 600, 613), ((20, 30), (100, 200, 100), ()), None),
        ((0, 200, 457), (), 64),
    ],
)
def test_block_mask_equals_torchs_own_of_the_same_rule(bounds, branches, window, block):
    """The block tables built a chunk of query rows at a time (never the whole [T, T] mask) equal what torch's
    `create_block_mask` makes of `attends`: the same key blocks skipped, partial and full per query block."""
    from torch.nn.attention.flex_attention import create_block_mask

    mine = packed_block_mask(bounds, branches, window, "cpu", block)
    width = mine.seq_lengths[0]
    assert width % block == 0 and width - block < bounds[-1] <= width
    layout = flex_layout(bounds, branches, width)
    theirs = create_block_mask(
        lambda b, h, q, k: attends(layout, window, q, k),
        None,
        None,
        width,
        width,
        device="cpu",
        BLOCK_SIZE=block,
    )
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert torch.equal(mine.to_dense(), theirs.to_dense())
    # padding tokens see themselves only (no empty query row, and no scores among the padding)
    pads, keys = torch.arange(bounds[-1], width), torch.arange(width)
    assert torch.equal(attends(layout, window, pads[:, None], keys[None, :]), pads[:, None] == keys[None, :])
    # skipping is real: a packed row of many sequences leaves most blocks out
    if block == 16 and not branches and window is None:
        assert int(mine.kv_num_blocks.sum() + mine.full_kv_num_blocks.sum()) < (width // block) ** 2 // 2


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **extra):
    """Stands in for torch's varlen FlashAttention, which exists on CUDA only: [T, heads, hd] in and out, one
    causal call per sequence, key k seen by query q when q - left <= k <= q + right as FlashAttention reads
    window_size; no grouped KV heads unless ``enable_gqa`` (torch 2.11's kernel has none)."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert window_size[1] == 0  # causal
    gqa = extra.pop("enable_gqa", False)
    assert not extra
    assert gqa or q.shape[1] == k.shape[1]
    bounds = cu_q.tolist()
    assert max_q == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        i = torch.arange(e - s)
        seen = i[None, :] <= i[:, None]
        if window_size[0] >= 0:
            seen &= i[None, :] >= i[:, None] - window_size[0]
        qs, ks, vs = (x[s:e].transpose(0, 1).float() for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=1).transpose(0, 1).to(q.dtype)  # computed in fp32, rounded once


@pytest.mark.parametrize("has_gqa", [True, False], ids=["torch-2.13", "torch-2.11"])
@pytest.mark.parametrize("window", [None, 8])
def test_flash_adapter_passes_the_row_as_varlen_flash_attention_reads_it(monkeypatch, has_gqa, window):
    """The layout, cumulative lengths, causal window and grouped KV heads handed to ``varlen_attn`` (a CPU stand-in
    of the CUDA kernel, in bf16 as the kernel requires) give one call per sequence's outputs."""
    import torch.nn.attention.varlen as varlen

    if has_gqa:
        monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    else:  # torch 2.11's signature: no enable_gqa, so the adapter repeats the KV heads itself

        def without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

        monkeypatch.setattr(varlen, "varlen_attn", without_gqa)
    q, k, v, bounds = detached(packed_inputs([30, 12, 25, 6]))
    q, k, v = (x.bfloat16() for x in (q, k, v))
    ref = per_sequence(q.float(), k.float(), v.float(), bounds, window)
    # only the output's rounding to bf16 apart (a key too many or too few moves outputs by far more)
    torch.testing.assert_close(attend("flash", q, k, v, bounds, window).float(), ref, atol=1e-6, rtol=2**-8)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        attend("flash", q.float(), k.float(), v.float(), bounds)
    with pytest.raises(ValueError, match="cannot attend shared-prompt"):
        attend("flash", q, k, v, bounds, branches=((), (), (20, 5), ()))


def test_kernel_choice_by_device_and_refusals():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_packed_kernel("auto", cpu, trains=True) == "sdpa"
    assert resolve_packed_kernel("auto", cuda, trains=True) == "flex"
    assert resolve_packed_kernel("flex", cpu, trains=False) == "flex"  # forward-only passes run eagerly
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_packed_kernel("flex", cpu, trains=True)
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_packed_kernel("flash", cpu, trains=False)
    with pytest.raises(ValueError, match=r"model.packed_attention='paged'; choose one of"):
        resolve_packed_kernel("paged", cpu, trains=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.make_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


def test_engine_forward_passes_with_flex_equal_the_sdpa_kernels(model_dir):
    """A forward-only engine (a reference model) with packed_attention=flex gives the sdpa kernel's log-probs,
    entropy and a critic's values, with shared prompts as branches of one segment and without them."""
    b = T.make_group_batch(groups=3, samples=4, seed=12)

    def engine(kernel, **kw):
        return FSDPEngine(EngineConfig(model_path=model_dir, optim=None, packed_attention=kernel, **kw))

    for share in (True, False):
        flex, sdpa = engine("flex", share_prompts=share), engine("sdpa", share_prompts=share)
        assert flex.packed_attention == "flex" and flex.share_prompts == share
        got = flex.compute_log_prob(b, calculate_entropy=True, max_token_len=40)
        want = sdpa.compute_log_prob(b, calculate_entropy=True, max_token_len=40)
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(
                got[key], want[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}"
            )
    values = engine("flex", value_head=True).compute_values(b)["values"]
    torch.testing.assert_close(
        values, engine("sdpa", value_head=True).compute_values(b)["values"], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_every_layer_reads_the_rows_bounds_from_the_host(model_dir, monkeypatch, kernel):
    """The engine hands attention the packed row's bounds as host data (``hyflow_bounds``), so no layer reads
    them back from the device (on a GPU, a sync per layer that stalls the kernel queue)."""
    import workers.models.attention as attention

    real, hosts = attention._segment_bounds, []

    def recording(kwargs, total, host=None):
        hosts.append(host)
        return real(kwargs, total, host)

    monkeypatch.setattr(attention, "_segment_bounds", recording)
    b = T.make_group_batch(groups=3, samples=4, seed=12)
    engine = FSDPEngine(EngineConfig(model_path=model_dir, optim=None, packed_attention=kernel))
    engine.compute_log_prob(b, max_token_len=40)
    assert hosts and all(h is not None for h in hosts), hosts


def test_engine_refuses_kernels_the_cpu_cannot_train_with(model_dir):
    with pytest.raises(ValueError, match="no CPU backward"):
        FSDPEngine(EngineConfig(model_path=model_dir, optim=OptimConfig(), packed_attention="flex"))
    with pytest.raises(ValueError, match="CUDA only"):
        FSDPEngine(EngineConfig(model_path=model_dir, optim=None, packed_attention="flash"))


# ----------------------------------------------------------------------------------------------------------------
# CUDA: the kernels' gradients, and an update through the engine
# ----------------------------------------------------------------------------------------------------------------


def _cuda_inputs(lengths, dtype, seed=0):
    q, k, v, bounds = packed_inputs(lengths, seed)
    return *(x.detach().to("cuda", dtype).requires_grad_() for x in (q, k, v)), bounds


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dtype", [("flex", torch.float32), ("flex", torch.bfloat16),
                                           ("flash", torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("window", [None, 8])
def test_cuda_kernels_give_the_sdpa_kernels_outputs_and_gradients(kernel, dtype, window):
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    lengths = [200, 7, 9, 180, 12, 1, 150, 300]
    q, k, v, bounds = _cuda_inputs(lengths, dtype)
    out = attend(kernel, q, k, v, bounds, window)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attend("sdpa", q32, k32, v32, bounds, window)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    grad = torch.randn_like(ref)
    mine = torch.autograd.grad((out.float() * grad).sum(), (q, k, v))
    theirs = torch.autograd.grad((ref * grad).sum(), (q32, k32, v32))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.float(), b, **tol)


@pytest.mark.gpu
def test_cuda_flex_shared_prompt_gradients_equal_the_sdpa_kernels():
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    segments = [(150, [5, 9]), (7, [3]), (200, []), (40, [60, 70, 80])]
    q, k, v, bounds = _cuda_inputs([p + sum(b) for p, b in segments], torch.float32, seed=3)
    branches = tuple(tuple(b) for _, b in segments)
    out = attend("flex", q, k, v, bounds, branches=branches)
    ref = attend("sdpa", q, k, v, bounds, branches=branches)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * grad).sum(), (q, k, v)),
                    torch.autograd.grad((ref * grad).sum(), (q, k, v))):  # fmt: skip
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "flash"])
def test_cuda_engine_update_with_each_kernel_equals_the_sdpa_kernels(model_dir, kernel):
    """One GRPO-shaped batch in bf16 mixed precision: the loss of its forward/backward and its log-probs close
    to the sdpa kernel's (flash with share_prompts turned off, as the engine does for it)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    b = T.make_group_batch(groups=3, samples=4, seed=12)
    results = {}
    for name in ("sdpa", kernel):
        engine = FSDPEngine(T.engine_config(model_dir, packed_attention=name))
        assert engine.share_prompts == (name != "flash")
        log_probs = engine.compute_log_prob(b)["log_probs"]
        loss, _ = T.accumulate_grads(engine, b, T.pg_loss)
        results[name] = (loss, log_probs.cpu())
    assert results[kernel][0] == pytest.approx(results["sdpa"][0], rel=2e-2, abs=1e-3)
    torch.testing.assert_close(results[kernel][1], results["sdpa"][1], atol=5e-2, rtol=0)
