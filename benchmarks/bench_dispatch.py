"""Latency of an empty DP_COMPUTE_PROTO group call over 1, 2, 4 and 8 CPU workers, against Ray's own floor.

Batches: ``input_ids`` and ``attention_mask`` (int64) of each ``--shapes`` entry, rows x columns (64 x 8 is the
shape issue 18 measured; 64 x 128 is 128 KiB). Each worker returns its chunk unchanged, so the time is the
group call's machinery plus Ray. Four contenders on the same actors, alternated call by call:

* ``floor``: a bare Ray round trip, one small array per actor (``actor.raw.remote(array)`` for each, one
  ``ray.get`` of the list): what Ray itself costs for one call per worker;
* ``group``: ``wg.noop(batch)``, the group call (chunks inside the calls, ``chunks_by_value``, the default);
* ``puts``: the same call with ``chunks_by_value`` off (each chunk put in the object store once);
* ``hand``: the same data flow written by hand (chunk, one put per chunk, call, ``ray.get`` of the list,
  concat).

Reported per worker count: medians in ms, ``ratio`` = group / floor (issue 18's goal: at most 1.3) and
``puts_ratio`` = puts / floor.

Run: python -m benchmarks.bench_dispatch [--shapes 64x8,64x128] [--workers 1,2,4,8] [--calls 50]
"""

import argparse
import sys
from typing import cast

import numpy as np
import ray
import torch

from benchmarks.common import print_table, time_paired, write_json
from controller import Dispatch, GroupMethod, RayClassWithInitArgs, RayWorkerGroup, Worker, register
from dataproto import DataProto
from resource_pools import ResourcePool

if __name__ != "__main__":  # imported: ship the worker class by value, as for __main__
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FLOOR_ARRAY = np.arange(8, dtype=np.int64)


class NoopWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def noop(self, data):
        return data

    def raw(self, value):
        return value


class NoopGroup(RayWorkerGroup):
    """A group of `NoopWorker` as mypy sees it: the group binds ``noop`` at run time (the way
    ``workers/roles/handles.py`` types the roles' groups)."""

    noop: GroupMethod[[DataProto], DataProto]


def make_batch(rows: int, cols: int) -> DataProto:
    return DataProto.from_dict(
        {
            "input_ids": torch.randint(0, 32000, (rows, cols)),
            "attention_mask": torch.ones(rows, cols, dtype=torch.int64),
        }
    )


def parse_shape(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def bench_batch(wg: NoopGroup, data: DataProto, calls: int, warmup: int) -> dict:
    """Medians (ms) of the four contenders on ``wg``'s actors, alternated call by call."""
    n = wg.world_size

    def floor():
        ray.get([a.raw.remote(FLOOR_ARRAY) for a in wg.actors])

    def group():
        wg.noop(data)

    def puts():
        wg.chunks_by_value = False
        try:
            wg.noop(data)
        finally:
            wg.chunks_by_value = True

    def hand():
        refs = [ray.put(c) for c in data.chunk(n)]
        DataProto.concat(ray.get([a.raw.remote(r) for a, r in zip(wg.actors, refs)]))

    contenders = {"floor": floor, "group": group, "puts": puts, "hand": hand}
    stats = time_paired(contenders, repeats=calls, warmup=warmup)
    ms = {name: s["median_s"] * 1e3 for name, s in stats.items()}
    return {
        "workers": n,
        "floor_ms": ms["floor"],
        "group_ms": ms["group"],
        "ratio": ms["group"] / ms["floor"],
        "puts_ms": ms["puts"],
        "puts_ratio": ms["puts"] / ms["floor"],
        "hand_ms": ms["hand"],
        **{f"{name}_p90_ms": s["p90_s"] * 1e3 for name, s in stats.items()},
        "calls": calls,
    }


def bench_workers(n: int, shapes: list[tuple[int, int]], calls: int, warmup: int) -> list[dict]:
    pool = ResourcePool([n], name=f"bench_dispatch_{n}")
    wg = cast(NoopGroup, RayWorkerGroup(pool, RayClassWithInitArgs(NoopWorker), name_prefix=f"noop{n}"))
    try:
        return [
            {"batch": f"{rows}x{cols}", **bench_batch(wg, make_batch(rows, cols), calls, warmup)}
            for rows, cols in shapes
        ]
    finally:
        wg.shutdown()
        pool.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated group sizes")
    parser.add_argument("--shapes", default="64x8,64x128", help="comma-separated batch shapes, rows x cols")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.workers.split(",")]
    shapes = [parse_shape(s) for s in args.shapes.split(",")]

    ray.init(
        num_cpus=max(8, *sizes),
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    results = [row for n in sizes for row in bench_workers(n, shapes, args.calls, args.warmup)]
    ray.shutdown()

    columns = ["workers", "floor_ms", "group_ms", "ratio", "puts_ms", "puts_ratio", "hand_ms"]
    for rows, cols in shapes:
        print(
            f"\nempty DP_COMPUTE_PROTO call, batch {rows} x {cols} int64 x 2 keys, "
            f"{args.calls} calls after {args.warmup} warm-up, alternated"
        )
        print_table([r for r in results if r["batch"] == f"{rows}x{cols}"], columns)
    path = write_json(
        "bench_dispatch",
        {
            "benchmark": "empty DP_COMPUTE_PROTO group call (chunks by value / put) vs a bare Ray round trip",
            "keys": ["input_ids", "attention_mask"],
            "warmup": args.warmup,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
