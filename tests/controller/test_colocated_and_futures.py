"""Colocated roles (one process per bundle, one group per role), futures chained between groups of equal
and unequal size, and torch.distributed through Worker.init_distributed."""

import os
import sys

import pytest
import ray
import torch

from controller import (
    DataProtoFuture,
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    create_colocated_worker_cls,
    register,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StageWorker(Worker):
    """Adds a column named after its role holding the rank that processed each row."""

    def __init__(self, tag, join_dist_in_ctor=False):
        self.tag = tag
        self.seen: dict[str, list] = {}
        if join_dist_in_ctor:  # every rank blocks here until all ranks joined: needs parallel start
            self.init_distributed()

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, x=None):
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "tag": self.tag,
            "x_len": None if x is None else len(x),
        }

    def _stage(self, data):
        self.seen.setdefault("stage", []).append(data.batch["ids"].tolist())
        return DataProto.from_dict({**data.batch, self.tag: torch.full((len(data),), self.rank)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stage(self, data):
        return self._stage(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def stage_sync(self, data):
        return self._stage(data)

    @register(Dispatch.ONE_TO_ALL)
    def take_seen(self):
        seen, self.seen = self.seen, {}
        return seen.get("stage", [])

    @register(Dispatch.ONE_TO_ALL)
    def init_dist(self):
        import torch.distributed as dist

        self.init_distributed()
        return dist.get_rank(), dist.get_world_size(), dist.get_backend()

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_sum(self):
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1.0, 10.0 * (self.rank + 1)])
        dist.all_reduce(t)
        return t.tolist()


@pytest.fixture(scope="module")
def groups(ray_session):
    pool2 = ResourcePool([2], name="test_coloc_pool")
    pool3 = ResourcePool([3], name="test_critic_pool")
    fused = create_colocated_worker_cls(
        {
            "actor": RayClassWithInitArgs(StageWorker, "actor"),
            "ref": RayClassWithInitArgs(StageWorker, tag="ref"),
        }
    )
    colocated = RayWorkerGroup(pool2, fused, name_prefix="actor_ref", chunks_by_value=False)  # counts puts
    critic = RayWorkerGroup(
        pool3,
        RayClassWithInitArgs(StageWorker, "critic", join_dist_in_ctor=True),
        name_prefix="critic",
        chunks_by_value=False,
    )
    roles = colocated.spawn(prefix_set={"actor", "ref"})
    yield {"colocated": colocated, "actor": roles["actor"], "ref": roles["ref"], "critic": critic}
    colocated.shutdown()
    critic.shutdown()
    pool2.remove()
    pool3.remove()


def _batch(n):
    return DataProto.from_dict({"ids": torch.arange(n)})


@pytest.fixture
def count_puts(monkeypatch):
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    return puts


def test_colocated_roles_share_one_process_per_rank(groups):
    actor, ref = groups["actor"], groups["ref"]
    a, r = actor.whoami(), ref.whoami()
    assert [x["pid"] for x in a] == [x["pid"] for x in r]  # same process per rank
    assert len({x["pid"] for x in a}) == 2  # but one process per bundle
    assert [x["tag"] for x in a] == ["actor", "actor"] and [x["tag"] for x in r] == ["ref", "ref"]
    assert (actor.name, ref.name) == ("actor", "ref")
    assert "stage" in actor.method_names() and not hasattr(groups["colocated"], "stage")


def test_spawn_errors_name_the_problem(groups):
    with pytest.raises(KeyError, match=r"no role\(s\) \['critic'\]; roles: \['actor', 'ref'\]"):
        groups["colocated"].spawn(prefix_set={"critic"})
    with pytest.raises(TypeError, match="not a colocated class"):
        groups["critic"].spawn(prefix_set={"critic"})


def test_future_chained_to_equal_size_group_passes_chunk_refs(groups, count_puts):
    actor, ref = groups["actor"], groups["ref"]
    fut = actor.stage(_batch(7))  # 7 rows on 2 ranks: padded to 8, chunks of 4
    assert isinstance(fut, DataProtoFuture) and fut.num_chunks == 2 and fut.pad_size == 1
    assert len(count_puts) == 2
    out = ref.stage_sync(fut)
    assert len(count_puts) == 2  # no new put: each ref worker got the actor's output chunk ref
    assert not fut.resolved  # and the controller never fetched it
    assert ref.take_seen() == [[[0, 1, 2, 3]], [[4, 5, 6, 0]]]  # each worker only its own chunk
    assert out.batch["ids"].tolist() == list(range(7))
    assert out.batch["actor"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out.batch["ref"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    actor.take_seen()


def test_future_chained_to_unequal_size_group_rechunks_once(groups, count_puts):
    actor, critic = groups["actor"], groups["critic"]
    fut = actor.stage(_batch(7))
    count_puts.clear()
    out = critic.stage_sync(fut)
    assert fut.resolved  # resolved on the controller, then re-chunked for 3 ranks
    assert len(count_puts) == 3 and [len(p) for p in count_puts] == [3, 3, 3]
    assert critic.take_seen() == [[[0, 1, 2]], [[3, 4, 5]], [[6, 0, 1]]]
    assert out.batch["ids"].tolist() == list(range(7))
    assert out.batch["actor"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out.batch["critic"].tolist() == [0, 0, 0, 1, 1, 1, 2]
    actor.take_seen()


def test_future_into_broadcast_mode_is_resolved(groups):
    fut = groups["critic"].stage(_batch(4))
    assert [x["x_len"] for x in groups["actor"].whoami(fut)] == [4, 4]
    assert fut.resolved
    groups["critic"].take_seen()


def test_torch_distributed_across_two_workers(groups):
    actor, ref = groups["actor"], groups["ref"]
    assert actor.init_dist() == [(0, 2, "gloo"), (1, 2, "gloo")]
    # the ref role lives in the same processes: init_distributed is a no-op there
    assert ref.init_dist() == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert ref.all_reduce_sum() == [[3.0, 30.0], [3.0, 30.0]]


def test_torch_distributed_joined_in_constructor(groups):
    critic = groups["critic"]  # its workers called init_distributed() in __init__ (3 ranks)
    assert critic.init_dist() == [(0, 3, "gloo"), (1, 3, "gloo"), (2, 3, "gloo")]
    assert critic.all_reduce_sum() == [[6.0, 60.0]] * 3
