"""A group call of 2 Ray actors whose ranks report different metrics: the collected DataProto carries them
merged (dataproto/metrics_merge.py), not rank 0's alone."""

import sys

import pytest
import ray
import torch

from controller import PAD_ROWS_KEY, Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, register
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class MetricWorker(Worker):
    @register(Dispatch.DP_SPLIT_PROTO)
    def generate(self, data: DataProto) -> DataProto:
        """Like an env worker: rank 0 gets 2 of 3 rows, rank 1 one; each reports its own chunk's metrics."""
        keep = len(data) - data.meta_info[PAD_ROWS_KEY]
        r = self.rank
        meta = {
            "eos_token_id": 7,
            "rank": r,
            "timing_s/gen": 1.0 + r,
            "rollout/generated_tokens": 10 * (r + 1),
            "metrics": {"env/turns/mean": 2.0 + 4 * r, "env/turns/max": 3.0 + r, "env/errors": float(r)},
        }
        if r == 1:
            meta["metrics"]["env/depth_1/num_trajectories"] = 5.0
        return DataProto.from_dict({"ids": data.batch["ids"][:keep]}, meta_info=meta)


@pytest.fixture(scope="module")
def group2(ray_session):
    pool = ResourcePool([2], name="test_collect_metrics_pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(MetricWorker), name_prefix="metrics")
    yield wg
    wg.shutdown()
    pool.remove()


def test_collected_metrics_are_merged_across_ranks(group2):
    out = group2.generate(DataProto.from_dict({"ids": torch.arange(3)}))
    assert out.batch["ids"].tolist() == [0, 1, 2]
    meta = out.meta_info
    assert meta["eos_token_id"] == 7 and meta["rank"] == 0  # not a metric: the first chunk's
    assert meta["timing_s/gen"] == 2.0  # the slower rank
    assert meta["rollout/generated_tokens"] == 30  # 10 + 20
    m = meta["metrics"]
    assert m["env/turns/mean"] == pytest.approx((2 * 2.0 + 1 * 6.0) / 3)  # weighted by rows 2 and 1
    assert m["env/turns/max"] == 4.0 and m["env/errors"] == 1.0
    assert m["env/depth_1/num_trajectories"] == 5.0  # reported by rank 1 only
