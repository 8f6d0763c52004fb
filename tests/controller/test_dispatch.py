"""Dispatch modes on a plain 3-rank group: ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE_PROTO (with
padding), RANK_ZERO, a user-registered mode and non-blocking calls."""

import os
import sys

import numpy as np
import pytest
import ray
import torch

from controller import (
    Dispatch,
    DispatchError,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    register,
    register_dispatch_mode,
)
from dataproto import DataProto
from resource_pools import ResourcePool

# Test modules are not importable inside Ray workers; ship the worker classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# A user mode: rank r gets every world_size-th value starting at r; outputs are merged and sorted.
def _strided_dispatch(wg, values):
    return [[values[r :: wg.world_size] for r in range(wg.world_size)]], {}


def _sorted_merge(wg, outputs):
    return sorted(v for out in outputs for v in out)


STRIDED = register_dispatch_mode("test_strided_shards", _strided_dispatch, _sorted_merge)


class EchoWorker(Worker):
    def __init__(self, tag):
        self.tag = tag
        self.calls: dict[str, int] = {}
        self.seen: dict[str, list] = {}

    def _count(self, method):
        self.calls[method] = self.calls.get(method, 0) + 1

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, x=None):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "tag": self.tag,
            "x": x,
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "pg": ray.get_runtime_context().get_placement_group_id(),
        }

    @register(Dispatch.ALL_TO_ALL)
    def add(self, x, y=0):
        return x + y + 100 * self.rank

    @register(Dispatch.ALL_TO_ALL)
    def square(self, x):
        return self.rank, x * x

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data):
        self.seen["double"] = data.batch["ids"].tolist()
        return DataProto.from_dict(
            {
                "ids": data.batch["ids"],
                "y": data.batch["x"] * 2,
                "rank": torch.full((len(data),), self.rank),
            },
            {"tag": np.array([f"{self.tag}{i}" for i in data.batch["ids"].tolist()], dtype=object)},
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rows_seen(self, data):
        """Metrics only, no rows (like an update step): collected even when the input was padded."""
        return DataProto(meta_info={"metrics": {"rows": len(data)}})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data):
        return self.double(data)

    @register(Dispatch.RANK_ZERO)
    def rank_zero_only(self, x):
        self._count("rank_zero_only")
        return self.rank, x

    @register(STRIDED)
    def shard_squares(self, values):
        self.seen["shard_squares"] = list(values)
        return [v * v for v in values]

    @register(Dispatch.ONE_TO_ALL)
    def report(self, method):
        return {"calls": self.calls.get(method, 0), "seen": self.seen.get(method)}


@pytest.fixture(scope="module")
def group3(ray_session):
    pool = ResourcePool([3], name="test_dispatch_pool")
    wg = RayWorkerGroup(  # chunks put once each (the by-value path: tests/controller/test_chunks_by_value.py)
        pool, RayClassWithInitArgs(EchoWorker, tag="e"), name_prefix="echo", chunks_by_value=False
    )
    yield wg
    wg.shutdown()
    pool.remove()


def _batch(n):
    return DataProto.from_dict({"ids": torch.arange(n), "x": torch.arange(n, dtype=torch.float32) + 0.5})


def test_one_to_all_and_worker_env(group3):
    out = group3.whoami(torch.arange(4))
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world_size"] == 3 and o["tag"] == "e" for o in out)
    assert [o["local_rank"] for o in out] == [0, 1, 2]  # one node: local rank == bundle index
    assert len({o["pid"] for o in out}) == 3
    assert all(torch.equal(o["x"], torch.arange(4)) for o in out)
    assert group3.master_port is not None and group3.master_port > 0
    master = (group3.master_addr, str(group3.master_port))
    assert [(o["env"]["MASTER_ADDR"], o["env"]["MASTER_PORT"]) for o in out] == [master] * 3
    assert [o["env"]["RANK"] for o in out] == ["0", "1", "2"] and out[2]["env"]["WORLD_SIZE"] == "3"
    # every actor sits in the pool's placement group
    assert {o["pg"] for o in out} == {group3.resource_pool.get_placement_groups()[0].id.hex()}


def test_all_to_all_splits_lists_per_rank(group3):
    assert group3.add([1, 2, 3], y=[10, 20, 30]) == [11, 122, 233]
    with pytest.raises(DispatchError, match=r"'echo'.*'add'.*one entry per rank \(3\)"):
        group3.add([1, 2])


def test_dp_compute_collects_in_rank_order(group3):
    assert group3.square([2, 3, 4]) == [(0, 4), (1, 9), (2, 16)]


def test_dp_compute_proto_pads_chunks_and_strips(group3, monkeypatch):
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    out = group3.double(_batch(10))  # 10 rows over 3 ranks: padded to 12, chunks of 4
    assert len(puts) == 3 and all(len(p) == 4 for p in puts)  # each chunk put once
    assert out.batch["ids"].tolist() == list(range(10))
    assert torch.equal(out.batch["y"], (torch.arange(10, dtype=torch.float32) + 0.5) * 2)
    assert out.batch["rank"].tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert out.non_tensor_batch["tag"].tolist() == [f"e{i}" for i in range(10)]
    seen = [r["seen"] for r in group3.report("double")]
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]  # padding = copies of leading rows
    out = group3.double(data=_batch(3))  # keyword arguments are chunked the same way
    assert out.batch["ids"].tolist() == [0, 1, 2] and out.batch["rank"].tolist() == [0, 1, 2]


def test_dp_compute_proto_row_less_output_after_padding(group3):
    out = group3.rows_seen(_batch(10))  # padded to 12: 4 rows per rank
    assert len(out) == 0 and out.meta_info == {"metrics": {"rows": 12}}  # a count: summed over the ranks


def test_dp_compute_proto_rejects_non_dataproto(group3):
    with pytest.raises(DispatchError, match=r"'double'.*positional arg 0 must be a DataProto"):
        group3.double([1, 2, 3])


def test_rank_zero_calls_only_rank_zero(group3):
    assert group3.rank_zero_only("hi") == (0, "hi")
    assert [r["calls"] for r in group3.report("rank_zero_only")] == [1, 0, 0]


def test_custom_registered_mode(group3):
    assert group3.shard_squares(list(range(8))) == sorted(v * v for v in range(8))
    assert [r["seen"] for r in group3.report("shard_squares")] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("test_strided_shards", _strided_dispatch, _sorted_merge)


def test_unknown_mode_is_named_when_binding(group3):
    class Bad(Worker):
        @register("no_such_mode")
        def f(self):
            return 1

    with pytest.raises(KeyError, match=r"Bad.f: unknown dispatch mode 'no_such_mode'"):
        RayWorkerGroup(group3.resource_pool, RayClassWithInitArgs(Bad))


def test_non_blocking_future(group3):
    fut = group3.double_async(_batch(5))
    assert fut.num_chunks == 3 and fut.pad_size == 1 and not fut.resolved
    out = fut.get()
    assert fut.resolved and out.batch["ids"].tolist() == list(range(5))
    assert fut.get() is out  # cached


def test_call_rank_runs_one_rank_undispatched(group3):
    """``call_rank``: one rank's call with the arguments as that rank takes them (an async rollout stream keeps
    each rank busy on its own work); other ranks are not called."""
    before = group3.report("double")
    fut = group3.call_rank(2, "double", _batch(3))
    assert not fut.resolved and fut.ranks == [2]
    out = fut.get()
    assert out.batch["rank"].tolist() == [2, 2, 2] and out.batch["y"].tolist() == [1.0, 3.0, 5.0]
    seen = group3.report("double")
    assert seen[2]["seen"] == [0, 1, 2] and [s["seen"] for s in seen[:2]] == [b["seen"] for b in before[:2]]
    with pytest.raises(IndexError, match="ranks 0..2, not 3"):
        group3.call_rank(3, "double", _batch(1))
    with pytest.raises(AttributeError, match="no registered method 'nope'"):
        group3.call_rank(0, "nope")
