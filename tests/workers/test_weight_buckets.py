"""Size-bounded weight buckets, flattened buffers and HF name mapping (workers/weight_sync/buckets.py)."""

import os
import tempfile

import pytest
import torch

from workers.weight_sync import (
    ALIGN_BYTES,
    broadcast_bucket,
    bucket_mb_to_bytes,
    flatten_bucket,
    hf_named_tensors,
    iter_buckets,
    strip_wrapper_prefixes,
    tensor_nbytes,
    unflatten_bucket,
)


def _named(sizes, dtype=torch.float32):
    return [(f"layer.{i}.weight", torch.full((n,), float(i), dtype=dtype)) for i, n in enumerate(sizes)]


def _bucket_bytes(bucket):
    return sum(tensor_nbytes(t) for _, t in bucket)


# ------------------------------------------------------------------------------------ iter_buckets


def test_buckets_respect_bound_preserve_order_and_pack_greedily():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 300, (200,), generator=gen).tolist()
    sizes[17] = 5000  # oversize (bound is 1024 bytes = 256 fp32)
    sizes[18] = 256  # exactly the bound
    named = _named(sizes)
    bound = 1024
    buckets = list(iter_buckets(named, bound))

    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order, nothing lost
    for b in buckets:
        assert b, "no empty buckets"
        if _bucket_bytes(b) > bound:
            assert len(b) == 1 and tensor_nbytes(b[0][1]) > bound  # only a lone oversize tensor
    # greedy: the next bucket's first tensor would not have fitted into the previous bucket
    for prev, nxt in zip(buckets, buckets[1:]):
        assert _bucket_bytes(prev) + tensor_nbytes(nxt[0][1]) > bound
    oversize = [b for b in buckets if any(n == "layer.17.weight" for n, _ in b)]
    assert len(oversize[0]) == 1


def test_oversize_tensor_travels_alone_between_neighbours():
    named = _named([10, 1000, 10, 10])
    buckets = list(iter_buckets(named, bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [
        ["layer.0.weight"],
        ["layer.1.weight"],
        ["layer.2.weight", "layer.3.weight"],
    ]


def test_empty_input_and_bad_bound():
    assert list(iter_buckets([], 10)) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(_named([1]), 0))
    with pytest.raises(ValueError, match="MiB"):
        bucket_mb_to_bytes(0)
    assert bucket_mb_to_bytes(1) == 1 << 20
    assert bucket_mb_to_bytes(0.5) == 1 << 19


def test_buckets_consume_input_lazily():
    pulled = []

    def stream():
        for name, t in _named([64] * 10):  # 256 bytes each
            pulled.append(name)
            yield name, t

    it = iter_buckets(stream(), bucket_bytes=512)
    first = next(it)
    assert len(first) == 2
    assert len(pulled) == 2  # a full bucket is yielded without looking further
    assert sum(len(b) for b in it) == 8


def test_dtype_cast_applies_to_floats_only_and_sizes_after_cast():
    named = [("w", torch.ones(100)), ("steps", torch.arange(10)), ("mask", torch.ones(3, dtype=torch.bool))]
    buckets = list(iter_buckets(named, bucket_bytes=200, dtype=torch.bfloat16))
    flat = [t for b in buckets for _, t in b]
    assert flat[0].dtype == torch.bfloat16 and flat[1].dtype == torch.int64 and flat[2].dtype == torch.bool
    assert len(buckets[0]) == 1  # 200 bytes of bf16 fill the bucket exactly
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        list(iter_buckets([("x", [1, 2])], 10))


# ------------------------------------------------------------------------------------ flatten / rebuild


def _mixed():
    gen = torch.Generator().manual_seed(1)
    return [
        ("fp32", torch.randn(3, 5, generator=gen)),
        ("int8_odd", torch.randint(-100, 100, (7,), dtype=torch.int8, generator=gen)),
        ("bf16", torch.randn(4, 3, generator=gen).to(torch.bfloat16)),
        ("bool", torch.rand(5, generator=gen) > 0.5),
        ("fp16", torch.randn(2, 2, 2, generator=gen).to(torch.float16)),
        ("int64", torch.randint(-(2**40), 2**40, (3,), generator=gen)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 4)),
        ("int32", torch.randint(-5, 5, (2, 3), dtype=torch.int32, generator=gen)),
        ("fp64", torch.randn(2, generator=gen).double()),
    ]


def test_flatten_round_trip_is_exact_for_mixed_dtypes():
    named = _mixed()
    flat = flatten_bucket(named)
    assert flat.buffer.dtype == torch.uint8 and flat.buffer.dim() == 1
    assert flat.names == [n for n, _ in named]
    for meta in flat.metas:
        assert meta.offset % ALIGN_BYTES == 0
    rebuilt = flat.tensors()
    for (name, original), (rname, tensor) in zip(named, rebuilt):
        assert rname == name
        assert tensor.dtype == original.dtype and tensor.shape == original.shape
        assert torch.equal(tensor, original), name
    # bit-exact, including NaN payloads and negative zero
    special = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)
    ((_, back),) = flatten_bucket([("s", special)]).tensors()
    assert torch.equal(back.view(torch.int16), special.view(torch.int16))


def test_unflatten_views_share_memory_unless_copied():
    flat = flatten_bucket([("a", torch.arange(1.0, 5.0)), ("b", torch.arange(3))])
    (_, view_a), _ = unflatten_bucket(flat.buffer, flat.metas)
    (_, copy_a), _ = unflatten_bucket(flat.buffer, flat.metas, copy=True)
    flat.buffer.zero_()
    assert torch.equal(view_a, torch.zeros(4))  # a view into the buffer
    assert torch.equal(copy_a, torch.arange(1.0, 5.0))  # the copy kept its values


def test_flatten_handles_non_contiguous_and_checks_buffer():
    base = torch.arange(12.0).reshape(3, 4)
    flat = flatten_bucket([("t", base.t()), ("s", base[:, 1])])
    (_, t), (_, s) = flat.tensors()
    assert torch.equal(t, base.t()) and torch.equal(s, base[:, 1])
    with pytest.raises(ValueError, match="spans bytes"):
        unflatten_bucket(flat.buffer[:8], flat.metas)
    with pytest.raises(ValueError, match="uint8"):
        unflatten_bucket(flat.buffer.view(torch.int16), flat.metas)
    empty = flatten_bucket([])
    assert empty.nbytes == 0 and empty.tensors() == []


# ------------------------------------------------------------------------------------ names


def test_strip_wrapper_prefixes():
    assert strip_wrapper_prefixes("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert strip_wrapper_prefixes("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert strip_wrapper_prefixes("module.model.norm.weight") == "model.norm.weight"
    assert (
        strip_wrapper_prefixes(
            "_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight"
        )
        == "model.layers.1.self_attn.q_proj.weight"
    )
    # only a leading "module." is a wrapper; one inside a name is kept
    assert strip_wrapper_prefixes("model.module.weight") == "model.module.weight"


def test_hf_named_tensors_tied_lm_head_and_duplicates():
    emb = torch.randn(8, 4, requires_grad=True)
    named = [("_orig_mod.model.embed_tokens.weight", emb), ("_orig_mod.lm_head.weight", emb)]
    tied = list(hf_named_tensors(named, tie_word_embeddings=True))
    assert [n for n, _ in tied] == ["model.embed_tokens.weight"]
    assert not tied[0][1].requires_grad
    kept = list(hf_named_tensors(named, tie_word_embeddings=True, keep_tied_lm_head=True))
    assert [n for n, _ in kept] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert [n for n, _ in hf_named_tensors(named)] == ["model.embed_tokens.weight", "lm_head.weight"]
    with pytest.raises(ValueError, match="both map to"):
        list(hf_named_tensors([("module.a", emb), ("_orig_mod.a", emb)]))


# ------------------------------------------------------------------------------------ broadcast


def _broadcast_worker(rank, world_size, init_file, result_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked child: stay out of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        flat = flatten_bucket(_mixed()) if rank == 0 else None
        received = broadcast_bucket(flat, src=0)
        torch.save(received.tensors(copy=True), os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_broadcast_bucket_over_gloo_two_ranks():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        # fork: children reuse this process's imports (spawn would re-import torch twice, ~10 s here)
        mp.start_processes(
            _broadcast_worker, args=(2, init_file, tmp), nprocs=2, join=True, start_method="fork"
        )
        got = torch.load(os.path.join(tmp, "rank1.pt"))
    expected = _mixed()
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b), name
