"""GPU pools: one GPU bundle per rank, NCCL through Worker.init_distributed (skipped without CUDA)."""

import os
import sys

import pytest
import ray
import torch

from controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, register
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class GpuWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nccl_sum(self):
        import torch.distributed as dist

        self.init_distributed()
        t = torch.full((4,), self.rank + 1.0, device="cuda")
        dist.all_reduce(t)
        return dist.get_backend(), t.tolist(), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.timeout(120)
def test_nccl_all_reduce_on_gpu_pool(ray_session):
    n = torch.cuda.device_count()
    pool = ResourcePool([n], use_gpu=True, name="test_gpu_pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(GpuWorker), name_prefix="gpu")
    try:
        out = wg.nccl_sum()
    finally:
        wg.shutdown()
        pool.remove()
    assert [o[0] for o in out] == ["nccl"] * n
    assert [o[1] for o in out] == [[n * (n + 1) / 2] * 4] * n
    assert len({o[2] for o in out}) == n  # Ray gave every rank its own GPU
