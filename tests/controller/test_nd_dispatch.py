"""n-D mesh dispatch on a 2 (dp) x 2 (tp) group: chunks by dp size, every tp replica of a dp rank gets the
same chunk ref, outputs only from tp rank 0, ordered by dp rank."""

import sys

import pytest
import ray
import torch

from controller import (
    DispatchError,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TP = 2
ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn("actor")


class MeshWorker(Worker):
    def __init__(self):
        # rank = dp * TP + tp; tp rank 0 of each dp group holds the result that is collected.
        self.dp, self.tp = divmod(self.rank, TP)
        self.register_dispatch_collect_info("actor", dp_rank=self.dp, is_collect=self.tp == 0)
        self.register_dispatch_collect_info("all_collect", dp_rank=self.dp, is_collect=True)
        self.seen = []

    def _compute(self, data):
        self.seen.append(data.batch["ids"].tolist())
        n = len(data)
        return DataProto.from_dict(
            {
                "ids": data.batch["ids"],
                "tp": torch.full((n,), self.tp),
                "dp": torch.full((n,), self.dp),
                "rank": torch.full((n,), self.rank),
            }
        )

    @register(ACTOR_MESH)
    def compute(self, data):
        return self._compute(data)

    @register(make_nd_compute_dataproto_dispatch_fn("actor"), blocking=False)
    def compute_async(self, data):
        return self._compute(data)

    @register(make_nd_compute_dataproto_dispatch_fn("critic"))
    def on_unregistered_mesh(self, data):
        return data

    @register(make_nd_compute_dataproto_dispatch_fn("all_collect"))
    def on_inconsistent_mesh(self, data):
        return data

    @register(ACTOR_MESH)
    def take_seen(self, data):
        seen, self.seen = self.seen, []
        return DataProto.from_dict(non_tensors={"seen": [seen] * len(data)})


@pytest.fixture(scope="module")
def mesh_group(ray_session):
    pool = ResourcePool([4], name="test_nd_pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(MeshWorker), name_prefix="mesh", chunks_by_value=False)
    yield wg
    wg.shutdown()
    pool.remove()


def _batch(n):
    return DataProto.from_dict({"ids": torch.arange(n)})


def _seen_per_rank(wg):
    # Ask every rank directly (the nd mode itself only returns the collecting ranks' outputs).
    refs = [a.take_seen.remote(_batch(1)) for a in wg.actors]
    return [ray.get(r).non_tensor_batch["seen"][0] for r in refs]


def test_nd_mode_same_chunk_to_tp_replicas_collects_tp0(mesh_group, monkeypatch):
    assert mesh_group.dispatch_info("actor") == [(0, True), (0, False), (1, True), (1, False)]
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    out = mesh_group.compute(_batch(5))  # dp size 2: padded to 6, chunks of 3
    assert [len(p) for p in puts] == [3, 3]  # one put per dp chunk, shared by both tp ranks
    assert out.batch["ids"].tolist() == list(range(5))
    assert out.batch["tp"].tolist() == [0] * 5  # only tp-rank-0 outputs collected
    assert out.batch["dp"].tolist() == [0, 0, 0, 1, 1]
    assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2]
    assert _seen_per_rank(mesh_group) == [[[0, 1, 2]], [[0, 1, 2]], [[3, 4, 0]], [[3, 4, 0]]]


def test_nd_future_chained_by_dp_chunk(mesh_group, monkeypatch):
    fut = mesh_group.compute_async(_batch(4))
    assert fut.num_chunks == 2 and fut.ranks == [0, 1, 2, 3]
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    out = mesh_group.compute(fut)
    assert puts == [] and not fut.resolved  # dp chunk i went straight to both replicas of dp rank i
    assert out.batch["ids"].tolist() == [0, 1, 2, 3] and out.batch["rank"].tolist() == [0, 0, 2, 2]
    assert _seen_per_rank(mesh_group) == [
        [[0, 1], [0, 1]],
        [[0, 1], [0, 1]],
        [[2, 3], [2, 3]],
        [[2, 3], [2, 3]],
    ]


def test_nd_mode_errors_name_mesh_and_ranks(mesh_group):
    with pytest.raises(
        DispatchError, match=r"'on_unregistered_mesh'.*rank\(s\) \[0, 1, 2, 3\].*mesh 'critic'"
    ):
        mesh_group.on_unregistered_mesh(_batch(4))
    with pytest.raises(
        DispatchError, match=r"mesh 'all_collect'.*several collect ranks \{0: \[0, 1\], 1: \[2, 3\]\}"
    ):
        mesh_group.on_inconsistent_mesh(_batch(4))
