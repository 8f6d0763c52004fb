"""REPL sandbox latency: creation (fork server vs cold interpreter starts), per-block overhead, and
throughput of many concurrent REPLs driven from asyncio.

Creation contenders, alternated call by call:
  fork server       ``ReplSandbox.create()``: one fork of the pre-imported zygote, limits, uid drop,
                    context sent over the socket, ready handshake (then closed, untimed)
  cold python       ``python -c pass`` as a subprocess (a bare interpreter start, no isolation)
  cold python+imp   ``python -I -c "import <the zygote's pre-imports>"``
  cold bwrap+imp    the same inside a fresh bubblewrap sandbox (what one bwrap per REPL would cost)

Per-block overhead: ``execute("pass")`` (sync API, through the sandbox's loop thread) and
``aexecute("pass")`` (async, on the caller's loop), next to an in-process ``exec`` of the same block.

Throughput: N REPLs (default 64) created concurrently with ``acreate``, each running S trivial blocks
in sequence while all N run concurrently, then closed.

Run: python -m benchmarks.bench_repl
"""

import argparse
import asyncio
import subprocess
import sys
import time

from benchmarks.common import print_table, time_calls, time_paired, write_json
from workers.sandbox import ReplSandbox, SandboxConfig
from workers.sandbox.sandbox import _bwrap_argv, bwrap_path


def _cold(argv: list[str]):
    def run():
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)

    return run


def bench_creation(sb: ReplSandbox, repeats: int, context: str | None) -> dict:
    imports = "import " + ", ".join(sb.config.preimport)

    def fork_server():
        sb.create(context=context).close()

    def fork_only():  # the create alone, close outside the timing
        t0 = time.perf_counter()
        r = sb.create(context=context)
        dt = time.perf_counter() - t0
        r.close()
        return dt

    contenders = {
        "fork server (create+close)": fork_server,
        "cold python": _cold([sys.executable, "-c", "pass"]),
        "cold python+imports": _cold([sys.executable, "-I", "-c", imports]),
    }
    bw = bwrap_path()
    if bw:
        argv = _bwrap_argv(bw, 64, root=True) + ["--", sys.executable, "-I", "-c", imports]
        try:
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            contenders["cold bwrap+python+imports"] = _cold(argv)
        except (OSError, subprocess.SubprocessError):
            pass
    stats = time_paired(contenders, repeats=repeats, warmup=2)
    creates = sorted(fork_only() for _ in range(repeats))
    stats["fork server (create only)"] = {
        "median_s": creates[len(creates) // 2],
        "p90_s": creates[min(len(creates) - 1, int(0.9 * len(creates)))],
        "repeats": len(creates),
    }
    return stats


def bench_step(sb: ReplSandbox, repeats: int) -> dict:
    repl = sb.create(context="x")
    ns: dict = {}
    code = compile("pass", "<bench>", "exec")
    try:
        out = {
            "execute('pass') sync": time_calls(lambda: repl.execute("pass"), repeats=repeats, warmup=5),
            "in-process exec('pass')": time_calls(lambda: exec(code, ns), repeats=repeats, warmup=5),
        }

        async def async_steps():
            samples = []
            for _ in range(5):
                await repl.aexecute("pass")
            for _ in range(repeats):
                t0 = time.perf_counter()
                await repl.aexecute("pass")
                samples.append(time.perf_counter() - t0)
            samples.sort()
            return {
                "median_s": samples[len(samples) // 2],
                "p90_s": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
                "repeats": len(samples),
            }

        out["aexecute('pass') async"] = asyncio.run(async_steps())
        return out
    finally:
        repl.close()


def bench_concurrent(sb: ReplSandbox, n: int, steps: int) -> dict:
    async def run():
        t0 = time.perf_counter()
        repls = await asyncio.gather(*(sb.acreate(context=f"doc {k}") for k in range(n)))
        t1 = time.perf_counter()

        async def traj(r, k):
            for i in range(steps):
                res = await r.aexecute(f"v = {i}\nprint(context, v)")
                assert res.stdout == f"doc {k} {i}\n", res
            return True

        ok = await asyncio.gather(*(traj(r, k) for k, r in enumerate(repls)))
        t2 = time.perf_counter()
        await asyncio.gather(*(r.aclose() for r in repls))
        t3 = time.perf_counter()
        assert all(ok)
        return {
            "repls": n,
            "steps_per_repl": steps,
            "create_all_s": t1 - t0,
            "creates_per_s": n / (t1 - t0),
            "run_all_s": t2 - t1,
            "steps_per_s": n * steps / (t2 - t1),
            "close_all_s": t3 - t2,
            "total_s": t3 - t0,
        }

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "rlimits"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context-chars", type=int, default=1_000_000)
    parser.add_argument(
        "--memory-cgroup",
        action="store_true",
        help="each REPL in a memory cgroup (SandboxConfig.memory_cgroup)",
    )
    args = parser.parse_args()

    t0 = time.perf_counter()
    sb = ReplSandbox(SandboxConfig(isolation=args.isolation, memory_cgroup=args.memory_cgroup))
    zygote_start_s = time.perf_counter() - t0
    try:
        report = sb.isolation_report()
        creation = bench_creation(sb, args.repeats, None)
        big = "x" * args.context_chars
        creation_big = bench_creation_big(sb, args.repeats, big)
        step = bench_step(sb, max(args.repeats * 5, 100))
        conc = bench_concurrent(sb, args.concurrency, args.steps)
    finally:
        sb.close()

    print(
        f"\nisolation: {report['mode']} ({report['uid_separation']}); zygote start {zygote_start_s * 1e3:.0f} ms"
    )
    rows = [
        {"contender": k, "median_ms": v["median_s"] * 1e3, "p90_ms": v["p90_s"] * 1e3}
        for k, v in creation.items()
    ]
    rows.append(
        {
            "contender": f"fork server (create only), {args.context_chars:,}-char context",
            "median_ms": creation_big["median_s"] * 1e3,
            "p90_ms": creation_big["p90_s"] * 1e3,
        }
    )
    print("\nREPL creation")
    print_table(rows, ["contender", "median_ms", "p90_ms"])
    print("\nper-block overhead (trivial block)")
    srows = [
        {"path": k, "median_us": v["median_s"] * 1e6, "p90_us": v["p90_s"] * 1e6} for k, v in step.items()
    ]
    print_table(srows, ["path", "median_us", "p90_us"])
    print(f"\n{args.concurrency} concurrent REPLs x {args.steps} blocks (asyncio)")
    print_table([conc], list(conc))
    path = write_json(
        "bench_repl",
        {
            "benchmark": "REPL sandbox creation, per-block overhead, concurrent throughput",
            "isolation": report["mode"],
            "uid_separation": report["uid_separation"],
            "memory_cgroup": report["memory"],
            "zygote_start_s": zygote_start_s,
            "creation": creation,
            "creation_with_context": {"context_chars": args.context_chars, **creation_big},
            "per_block": step,
            "concurrent": conc,
        },
    )
    print(f"wrote {path}")


def bench_creation_big(sb: ReplSandbox, repeats: int, context: str) -> dict:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = sb.create(context=context)
        samples.append(time.perf_counter() - t0)
        r.close()
    samples.sort()
    return {
        "median_s": samples[len(samples) // 2],
        "p90_s": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "repeats": len(samples),
    }


if __name__ == "__main__":
    main()
