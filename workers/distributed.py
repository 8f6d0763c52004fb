"""torch.distributed helpers that any worker uses (training engines, rollout engines, the PRM, env workers): init from
env, device choice, rank and world size that are those of one process when there is no process group, and
``run_in_processes`` for parity tests. A floor below ``workers.engine``: rollout code imports it without the
training package."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from controller.worker import free_port  # noqa: F401  (re-exported: the spawn helpers' and benchmarks' port)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): nccl on CUDA, gloo on CPU. No-op when already initialised or WORLD_SIZE is unset."""
    if is_dist() or "WORLD_SIZE" not in os.environ:
        return
    from datetime import timedelta

    device = default_device()
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def _spawn_entry(local_rank: int, fn: Callable, world: int, port: int, args: tuple, num_threads: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
    )  # fmt: skip
    torch.set_num_threads(num_threads)
    dist.init_process_group("gloo", rank=local_rank, world_size=world)
    try:
        fn(local_rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_in_processes(fn: Callable, world: int, *args, num_threads: int = 1) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned CPU processes joined by a gloo process group on a
    free local port (tests, CPU benchmarks). ``fn`` must be importable (a module-level function). Raises if
    any process fails."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _spawn_entry,
        args=(fn, world, free_port(), args, num_threads),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
