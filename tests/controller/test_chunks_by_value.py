"""A group built with ``chunks_by_value=True``: DataProto chunks travel inside the calls (no ``ray.put``), and
every rank still receives exactly its rows (padding for DP_COMPUTE_PROTO, uneven unpadded chunks and a
placeholder row for DP_SPLIT_PROTO, chunks bigger than Ray's inline limit). Also the wait (one ``ray.get`` of
every rank): a failure is still pinned on its rank, and a timeout on the rank still running."""

import sys
import time

import pytest
import ray
import torch

from controller import (
    PAD_ROWS_KEY,
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    WorkerGroupError,
    WorkerGroupTimeoutError,
    register,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RowsWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"ids": data.batch["ids"], "x": data.batch["x"], "rank": torch.full((len(data),), self.rank)}
        )

    @register(Dispatch.DP_SPLIT_PROTO)
    def split_rows(self, data: DataProto) -> DataProto:
        keep = len(data) - data.meta_info[PAD_ROWS_KEY]
        ids = data.batch["ids"][:keep]
        return DataProto.from_dict({"ids": ids, "rank": torch.full_like(ids, self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {self.rank} fails (marker-a41c)")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def by_value(ray_session):
    pool = ResourcePool([3], name="test_chunks_by_value")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(RowsWorker), name_prefix="rows", chunks_by_value=True)
    yield wg
    wg.shutdown()
    pool.remove()


@pytest.fixture
def puts(monkeypatch) -> list:
    recorded: list = []
    real_put = ray.put

    def put(value, **kwargs):
        recorded.append(value)
        return real_put(value, **kwargs)

    monkeypatch.setattr(ray, "put", put)
    return recorded


def _batch(n: int, cols: int = 2) -> DataProto:
    return DataProto.from_dict({"ids": torch.arange(n), "x": torch.arange(n * cols).reshape(n, cols)})


def test_compute_chunks_go_by_value_each_rank_its_padded_rows(by_value, puts):
    data = _batch(10)  # padded to 12: chunks of 4, the last one ending with copies of rows 0 and 1
    out = by_value.tag_rows(data)
    assert puts == []
    assert out.batch["ids"].tolist() == list(range(10))
    assert torch.equal(out.batch["x"], data.batch["x"])
    assert out.batch["rank"].tolist() == [0] * 4 + [1] * 4 + [2] * 2


def test_compute_chunk_over_rays_inline_limit_arrives_whole(by_value, puts):
    data = _batch(30, cols=8192)  # 640 KiB chunks: Ray puts them itself
    out = by_value.tag_rows(data)
    assert puts == []
    assert torch.equal(out.batch["x"], data.batch["x"])
    assert out.batch["rank"].tolist() == [0] * 10 + [1] * 10 + [2] * 10


def test_split_chunks_go_by_value_uneven_and_placeholder(by_value, puts):
    out = by_value.split_rows(_batch(7))  # 3, 2, 2 rows, no padding
    assert puts == []
    assert out.batch["ids"].tolist() == list(range(7))
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    out = by_value.split_rows(_batch(2))  # rank 2 gets a placeholder row whose output is dropped
    assert out.batch["ids"].tolist() == [0, 1] and out.batch["rank"].tolist() == [0, 1]


def test_error_among_finished_ranks_names_the_failing_rank(by_value):
    for rank in (0, 2):
        with pytest.raises(WorkerGroupError, match=rf"rank {rank} failed in 'fail_on'.*marker-a41c") as info:
            by_value.fail_on(rank)
        assert info.value.rank == rank and info.value.role == "rows"


def test_single_pending_call_times_out_naming_its_rank(by_value):
    future = by_value.call_rank(1, "nap", 5.0)
    started = time.perf_counter()
    with pytest.raises(WorkerGroupTimeoutError, match=r"rank\(s\) \[1\]") as info:
        future.get(timeout_s=0.3)
    assert time.perf_counter() - started < 3.0
    assert info.value.pending_ranks == [1] and info.value.method == "nap"
    assert by_value.nap(0.0) == [0, 1, 2]  # the group still answers (rank 1 after its nap)
