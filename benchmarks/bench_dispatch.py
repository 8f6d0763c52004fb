"""Latency of an empty DP_COMPUTE_PROTO group call over 1, 2, 4 and 8 CPU workers.

Batch: 64 x 128 int64 ``input_ids`` and ``attention_mask`` (128 KiB). Each worker returns its chunk
unchanged, so the time is pure controller overhead: pad + chunk + one put per chunk, per-rank calls,
the fail-fast wait loop, concat. Next to it, the same round trip written by hand with Ray (chunk, put,
call, ``ray.get`` of the list, concat) on the same actors, alternated call by call.

Run: python -m benchmarks.bench_dispatch
"""

import argparse
import sys

import ray
import torch

from benchmarks.common import print_table, time_paired, write_json
from controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, register
from dataproto import DataProto
from resource_pools import ResourcePool

if __name__ != "__main__":  # imported: ship the worker class by value, as for __main__
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NoopWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def noop(self, data):
        return data

    def raw_noop(self, data):
        return data


def bench_workers(n: int, data: DataProto, calls: int, warmup: int) -> dict:
    pool = ResourcePool([n], name=f"bench_dispatch_{n}")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NoopWorker), name_prefix=f"noop{n}")
    try:

        def group_call():
            wg.noop(data)

        def raw_ray():
            refs = [ray.put(c) for c in data.chunk(n)]
            DataProto.concat(ray.get([a.raw_noop.remote(r) for a, r in zip(wg.actors, refs)]))

        stats = time_paired({"group": group_call, "raw": raw_ray}, repeats=calls, warmup=warmup)
    finally:
        wg.shutdown()
        pool.remove()
    g, r = stats["group"], stats["raw"]
    return {
        "workers": n,
        "median_ms": g["median_s"] * 1e3,
        "p90_ms": g["p90_s"] * 1e3,
        "raw_ray_median_ms": r["median_s"] * 1e3,
        "raw_ray_p90_ms": r["p90_s"] * 1e3,
        "overhead_median_ms": (g["median_s"] - r["median_s"]) * 1e3,
        "calls": g["repeats"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated group sizes")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=128)
    args = parser.parse_args()
    sizes = [int(s) for s in args.workers.split(",")]

    ray.init(
        num_cpus=max(8, *sizes),
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    data = DataProto.from_dict(
        {
            "input_ids": torch.randint(0, 32000, (args.rows, args.cols)),
            "attention_mask": torch.ones(args.rows, args.cols, dtype=torch.int64),
        }
    )
    rows = [bench_workers(n, data, args.calls, args.warmup) for n in sizes]
    ray.shutdown()

    print(
        f"\nempty DP_COMPUTE_PROTO call, batch {args.rows} x {args.cols}, {args.calls} calls after {args.warmup} warm-up"
    )
    print_table(
        rows, ["workers", "median_ms", "p90_ms", "raw_ray_median_ms", "raw_ray_p90_ms", "overhead_median_ms"]
    )
    path = write_json(
        "bench_dispatch",
        {
            "benchmark": "empty DP_COMPUTE_PROTO group call vs hand-written Ray round trip",
            "batch": {"rows": args.rows, "cols": args.cols, "keys": ["input_ids", "attention_mask"]},
            "warmup": args.warmup,
            "results": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
