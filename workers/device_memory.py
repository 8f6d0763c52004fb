"""Peak device memory of one stage of a step, as metrics (``perf/max_memory_allocated_gib/<stage>``).

The peak is reset when the stage starts, so in a colocated process (actor + rollout engine + reference in
one CUDA context) each stage reports its own high-water mark, the number that decides whether a step fits.
On CPU nothing is reported: a process's resident peak (VmHWM) cannot be reset per stage
(``benchmarks/bench_memory.py`` polls it from outside instead).
"""

from __future__ import annotations

import torch

GIB = float(1 << 30)


class PeakDeviceMemory:
    """``with PeakDeviceMemory("gen") as peak: ...`` then ``peak.metrics``: the stage's peak allocated and
    reserved CUDA memory of the current device in GiB; ``{}`` without CUDA."""

    def __init__(self, stage: str):
        self.stage = stage
        self.metrics: dict[str, float] = {}
        self._on = False

    def __enter__(self) -> PeakDeviceMemory:
        # a process that has not touched CUDA (trainer.device=cpu on a GPU machine) keeps it that way
        self._on = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._on:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        if not self._on:
            return
        torch.cuda.synchronize()
        self.metrics = {
            f"perf/max_memory_allocated_gib/{self.stage}": torch.cuda.max_memory_allocated() / GIB,
            f"perf/max_memory_reserved_gib/{self.stage}": torch.cuda.max_memory_reserved() / GIB,
        }
