"""The split dispatch (DP_SPLIT_PROTO: unpadded contiguous chunks for methods that return several rows per
input row, a placeholder row for a rank with nothing to do), ONE_TO_ALL_RANK_ZERO, and ``wait_all`` over
several calls in flight: results in order, the first error of any call raised at once, a timeout naming the
call still running."""

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
    wait_all,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SplitWorker(Worker):
    @register(Dispatch.DP_SPLIT_PROTO)
    def twice(self, data: DataProto) -> DataProto:
        """Every row twice (like a generation with n = 2), the placeholder row's outputs dropped."""
        keep = len(data) - data.meta_info[PAD_ROWS_KEY]
        ids = data.batch["ids"][:keep].repeat_interleave(2)
        return DataProto.from_dict({"ids": ids, "rank": torch.full_like(ids, self.rank)})

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def plus_rank(self, x: int) -> int:
        return x + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float, fail_rank: int | None = None) -> int:
        if self.rank == fail_rank:
            raise ValueError(f"rank {self.rank} fails (marker-5b1e)")
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def group3(ray_session):
    pool = ResourcePool([3], name="test_split_wait_pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(SplitWorker), name_prefix="split")
    yield wg
    wg.shutdown()
    pool.remove()


def test_split_dispatch_chunks_without_padding(group3):
    out = group3.twice(DataProto.from_dict({"ids": torch.arange(5)}))
    assert out.batch["ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert out.batch["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]  # chunks of 2, 2, 1 rows
    # fewer rows than ranks: rank 2 gets a placeholder row and returns nothing
    out = group3.twice(DataProto.from_dict({"ids": torch.arange(2)}))
    assert out.batch["ids"].tolist() == [0, 0, 1, 1] and out.batch["rank"].tolist() == [0, 0, 1, 1]


def test_one_to_all_rank_zero_runs_everywhere_returns_rank_zero(group3):
    assert group3.plus_rank(10) == 10


@pytest.mark.timeout(60)
def test_wait_all_results_in_order(group3):
    first = group3.nap.with_options(blocking=False)(0.2)
    second = group3.plus_rank.with_options(blocking=False)(5)
    assert wait_all([first, second]) == [[0, 1, 2], 5]
    assert first.resolved and second.resolved


@pytest.mark.timeout(60)
def test_wait_all_raises_the_first_error_at_once(group3):
    start = time.monotonic()
    # a worker runs one call at a time: the failing call goes first, the slow one is still running after it
    failing = group3.nap.with_options(blocking=False)(0.0, fail_rank=1)
    slow = group3.nap.with_options(blocking=False)(5.0)
    with pytest.raises(WorkerGroupError, match=r"'split' rank 1 failed in 'nap'.*marker-5b1e"):
        wait_all([slow, failing])
    assert time.monotonic() - start < 4.0  # did not wait for the slow call
    slow.get()  # let the slow call finish before the next test uses the group


@pytest.mark.timeout(60)
def test_wait_all_timeout_names_the_running_call(group3):
    slow = group3.nap.with_options(blocking=False)(3.0)
    quick = group3.plus_rank.with_options(blocking=False)(1)
    with pytest.raises(WorkerGroupTimeoutError) as info:
        wait_all([slow, quick], timeout_s=0.5)
    assert info.value.method == "nap" and info.value.pending_ranks == [0, 1, 2]
    slow.get()
