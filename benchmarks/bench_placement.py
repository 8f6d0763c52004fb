"""Placement benchmark: the same PPO recipe for k steps under several placements, measured and predicted.

    python -m benchmarks.bench_placement                           # 4 devices, 3 steps, tiny model
    python -m benchmarks.bench_placement --devices 8 --rollout-devices 2 --critic-devices 2 --steps 5 \\
        model.path=/path/to/hf trainer.device=cuda                 # any recipe override after the flags

Placements (``resource_pools.placement_plan``): ``colocated`` (every role on all devices), ``disaggregated``
(``--rollout-devices`` for the rollout engines, the rest trains), ``split_critic`` (``--critic-devices`` for the
critic, the rest runs actor + rollout + reference). Each runs ``recipes.ppo`` for ``--steps`` steps; the numbers
are means over the steps after the first (the first warms up) and cover, per placement: step time and its
stages (``timing_s/*``), idle time per pool (step time minus the stages of the roles it holds), tokens/s and
tokens/s per device, and the device-memory peak (GPU: sampled with nvidia-smi; not measurable on CPU bundles).

The cost model (``benchmarks/placement_cost_model.py``) is fitted on the measured stages (decode time vs
concurrency, forward / training tokens/s, weight-sync time); the table shows its prediction for each placement
fitted on all runs and fitted leaving that placement's own run out, and the model's best split of the device
count. Writes ``<out>/bench_placement.json`` and ``<out>/bench_placement.png`` (stacked step-time bars).

On CPU every "device" is a CPU bundle and all of them share the machine's cores: a functional run of the
machinery, not a speed claim. The asynchronous schedules (GRPO generating while it trains: ``async_rl.mode``
sync / one_step / full, colocated and disaggregated, equal wall time, held-out accuracy) are benchmarked by
``benchmarks/bench_placement_async.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import placement_cost_model as cm
from benchmarks.common import print_table
from recipes import ppo
from recipes.config import ConfigError, load_config
from recipes.trainer.run import resolve_device, start_run
from resource_pools.plans import PlacementPlan, placement_plan

STAGES = list(cm.STAGE_ROLES) + ["adv"]
SMALL = [  # a short CPU-friendly PPO run: the tiny model, 8 prompts x 4 samples, 48-token responses
    "model.tiny_size=tiny",
    "task.name=arithmetic",
    "task.n_train=256",
    "task.n_val=8",
    "data.train_batch_size=8",
    "data.max_prompt_length=48",
    "data.max_response_length=48",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=8",
    "critic.ppo_mini_batch_size=8",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.logger=[console]",
    "trainer.cpu_oversubscribe=true",  # on CPU the plans' 2-4 "devices" share this machine's cores by design
]


def plan_overrides(plan: PlacementPlan) -> list[str]:
    """The trainer keys that select ``plan`` (one node)."""
    sizes = {pool: sum(n) for pool, n in plan.pool_spec.items()}
    out = [f"trainer.placement={plan.name}", f"trainer.n_gpus_per_node={plan.total_devices}"]
    if plan.name == "disaggregated":
        out.append(f"trainer.rollout_gpus_per_node={sizes['rollout_pool']}")
    if plan.name == "split_critic":
        out.append(f"trainer.critic_gpus_per_node={sizes['critic_pool']}")
    return out


def plans_to_run(args) -> list[PlacementPlan]:
    d = args.devices
    make = {
        "colocated": lambda: placement_plan("colocated", d),
        "disaggregated": lambda: placement_plan(
            "disaggregated", d, rollout_per_node=args.rollout_devices or d // 2
        ),
        "split_critic": lambda: placement_plan(
            "split_critic", d, critic_per_node=args.critic_devices or d // 2
        ),
    }
    unknown = [p for p in args.placements if p not in make]
    if unknown:
        raise SystemExit(f"--placements: unknown {unknown}; choose from {list(make)}")
    try:
        return [make[p]() for p in args.placements]
    except ValueError as err:
        raise SystemExit(f"--devices {d}: {err}") from None


class GpuMemorySampler:
    """Peak used memory per GPU (GiB), polled with nvidia-smi while a run goes on; None without nvidia-smi
    (device memory of CPU bundles is not a separate quantity)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.peak: list[float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def read() -> list[float] | None:
        if shutil.which("nvidia-smi") is None:
            return None
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            return None
        return [float(x) / 1024 for x in out.split()]

    def _loop(self):
        while not self._stop.is_set():
            now = self.read()
            if now is not None:
                self.peak = now if self.peak is None else [max(a, b) for a, b in zip(self.peak, now)]
            self._stop.wait(self.every_s)

    def __enter__(self):
        if self.read() is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _mean_rows(history: list[dict]) -> dict[str, float]:
    steps = [r for r in history if r.get("step", 0) >= 1 and "timing_s/step" in r]
    if not steps:
        raise RuntimeError("the run logged no training step")
    kept = steps[1:] if len(steps) > 1 else steps  # the first step warms up (allocations, caches)
    keys = set.intersection(*(set(r) for r in kept))
    return {k: statistics.fmean(float(r[k]) for r in kept) for k in keys} | {"steps_averaged": len(kept)}


def measure(row: dict[str, float], plan: PlacementPlan, memory: list[float] | None) -> dict:
    timings = {s: row[f"timing_s/{s}"] for s in STAGES if f"timing_s/{s}" in row}
    step = row["timing_s/step"]
    tokens = row["perf/total_num_tokens"]
    return {
        "step_s": step,
        "timing_s": timings,
        "idle_s": cm.idle_seconds(plan, timings, step),
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / plan.total_devices,
        "memory_peak_gib": memory,
        "steps_averaged": int(row["steps_averaged"]),
    }


def workload_of(row: dict[str, float], cfg) -> cm.Workload:
    rows = cfg.data.train_batch_size * cfg.rollout.n
    return cm.Workload(
        sequences=rows,
        response_tokens=row["response_length/mean"] * rows,
        total_tokens=row["perf/total_num_tokens"],
        weight_bytes=row.get("perf/weight_sync_bytes", 0.0),
        has_ref="timing_s/ref" in row,
        has_critic="timing_s/values" in row,
    )


def mean_workload(works: list[cm.Workload]) -> cm.Workload:
    """The runs' average step (response lengths differ a little between placements' samples)."""
    return cm.Workload(
        sequences=works[0].sequences,
        response_tokens=statistics.fmean(w.response_tokens for w in works),
        total_tokens=statistics.fmean(w.total_tokens for w in works),
        weight_bytes=max(w.weight_bytes for w in works),
        has_ref=works[0].has_ref,
        has_critic=works[0].has_critic,
    )


def run_placement(plan: PlacementPlan, args, out_dir: Path) -> dict:
    name = cm.describe(plan)
    run_dir = out_dir / "runs" / name.replace("(", "_").replace(")", "").replace(",", "_").replace("=", "")
    overrides = [
        *SMALL,
        *args.overrides,
        *plan_overrides(plan),
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.overwrite=true",  # the benchmark's own scratch folder
    ]
    cfg = load_config("ppo", overrides)
    run = start_run(cfg, "ppo")  # starts Ray for the largest device count unless it is already up
    with GpuMemorySampler() as mem:
        result = ppo.train(cfg, run)
    row = _mean_rows(result["history"])
    return {
        "cfg": cfg,
        "row": row,
        "measured": measure(row, plan, mem.peak),
        "workload": workload_of(row, cfg),
    }


def feasible_for(cfg_overrides: list[str]):
    """A plan is feasible when the recipe's config validates with it (batch sizes divide the pools)."""

    def check(plan: PlacementPlan) -> bool:
        try:
            load_config("ppo", [*cfg_overrides, *plan_overrides(plan)])
        except ConfigError:
            return False
        return True

    return check


def compare(
    runs: dict[str, dict],
    plans: dict[str, PlacementPlan],
    devices: int,
    overrides: list[str],
    parallel_limit: float = math.inf,
) -> dict:
    obs = {
        n: cm.Observation(
            plans[n], r["workload"], r["measured"]["timing_s"] | {"step": r["measured"]["step_s"]}
        )
        for n, r in runs.items()
    }
    rates = cm.fit_rates(list(obs.values()), parallel_limit)
    work = mean_workload([r["workload"] for r in runs.values()])
    rates_json = {k: (v if math.isfinite(v) else None) for k, v in rates.__dict__.items()}  # inf: no limit
    out = {"rates": rates_json, "placements": {}}
    for n, r in runs.items():
        entry = {
            "workload": dataclasses.asdict(r["workload"]),
            "measured": r["measured"],
            "predicted": cm.predict(rates, plans[n], r["workload"]).as_dict(),
        }
        rest = [o for m, o in obs.items() if m != n]
        try:  # the model fitted without this placement's own run
            loo = cm.fit_rates(rest, parallel_limit) if rest else None
            entry["predicted_leave_one_out"] = (
                cm.predict(loo, plans[n], r["workload"]).as_dict() if loo else None
            )
        except ValueError as err:
            entry["predicted_leave_one_out"] = {"error": str(err)}
        out["placements"][n] = entry
    ranking = cm.rank_plans(
        rates, work, cm.candidate_plans(devices, work.has_critic), feasible_for(overrides)
    )
    out["best"] = {
        "devices": devices,
        "workload": dataclasses.asdict(work),
        "ranking": [p.as_dict() for p in ranking],
    }
    return out


def table_rows(report: dict) -> list[dict]:
    rows = []
    for name, e in report["placements"].items():
        m, p = e["measured"], e["predicted"]
        loo = e.get("predicted_leave_one_out") or {}
        t = m["timing_s"]
        rows.append(
            {
                "placement": name,
                "step_s": m["step_s"],
                "pred_s": p["step_s"],
                "pred_loo_s": loo.get("step_s"),
                "gen": t.get("gen"),
                "update_actor": t.get("update_actor"),
                "update_critic": t.get("update_critic"),
                "update_weights": t.get("update_weights"),
                "idle_s(pool)": " ".join(
                    f"{k.removesuffix('_pool')}={v:.3g}" for k, v in m["idle_s"].items()
                ),
                "tok/s": m["tokens_per_s"],
                "tok/s/dev": m["tokens_per_s_per_device"],
                "mem_GiB": max(m["memory_peak_gib"]) if m["memory_peak_gib"] else None,
            }
        )
    return rows


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    return plt


def plot(report: dict, path: Path) -> str | None:
    """Stacked bars of the measured stage times per placement, the predicted step time as a marker."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(report["placements"])
    labels = [n.replace("(", "\n(") for n in names]
    stages = [*STAGES, "other"]
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(names), 4.5))
    bottom = [0.0] * len(names)
    for stage in stages:
        vals = []
        for n in names:
            m = report["placements"][n]["measured"]
            other = m["step_s"] - sum(m["timing_s"].values())
            vals.append(max(other, 0.0) if stage == "other" else m["timing_s"].get(stage, 0.0))
        if any(v > 0 for v in vals):
            ax.bar(labels, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
    pred = [report["placements"][n]["predicted"]["step_s"] for n in names]
    ax.scatter(labels, pred, marker="_", s=900, color="black", zorder=3, label="predicted step")
    ax.set_ylabel("seconds per step")
    ax.set_title(f"Step time per placement: {report['device']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_placement", description=__doc__.split("\n")[0]
    )
    p.add_argument("--devices", type=int, default=4, help="devices (CPU bundles without a GPU) on one node")
    p.add_argument(
        "--rollout-devices", type=int, default=None, help="disaggregated: rollout pool (default half)"
    )
    p.add_argument(
        "--critic-devices", type=int, default=None, help="split_critic: critic pool (default half)"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per placement")
    p.add_argument(
        "--placements", type=lambda s: s.split(","), default=["colocated", "disaggregated", "split_critic"]
    )
    p.add_argument("--out", default="outputs/bench_placement", help="directory for JSON, PNG and run dirs")
    p.add_argument(
        "--parallel-limit",
        type=float,
        default=None,
        help="devices that compute at once, for the cost model (default: the CPU cores on CPU, no limit on GPU)",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipes.ppo config overrides")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plans = {cm.describe(p): p for p in plans_to_run(args)}
    for plan in plans.values():  # every config error before any run starts
        try:
            load_config("ppo", [*SMALL, *args.overrides, *plan_overrides(plan)])
        except ConfigError as err:
            raise SystemExit(f"placement {cm.describe(plan)}: {err}") from None
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    import ray

    own_ray = not ray.is_initialized()  # the first run starts it; a caller's session is left alone
    runs, wall = {}, {}
    try:
        for name, plan in plans.items():
            start = time.perf_counter()
            runs[name] = run_placement(plan, args, out_dir)
            wall[name] = time.perf_counter() - start
    finally:
        if own_ray:
            ray.shutdown()
    cfg = next(iter(runs.values()))["cfg"]
    use_gpu = resolve_device(cfg)
    limit = args.parallel_limit or (math.inf if use_gpu else float(os.cpu_count() or 1))
    report = {
        "device": "gpu" if use_gpu else f"cpu ({os.cpu_count()} cores shared by {args.devices} CPU bundles)",
        "functional_run": not use_gpu,
        "command": "python -m benchmarks.bench_placement "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps,
        "devices": args.devices,
        "workload": {
            "prompts": cfg.data.train_batch_size,
            "n": cfg.rollout.n,
            "model": cfg.model.path or cfg.model.tiny_size,
        },
        "wall_s": wall,
        "parallel_limit": limit if math.isfinite(limit) else None,
        **compare(runs, plans, args.devices, [*SMALL, *args.overrides], limit),
    }
    rows = table_rows(report)
    print_table(rows, list(rows[0]))
    best = report["best"]["ranking"]
    if best:
        print(
            f"best predicted placement of {args.devices} devices: {best[0]['placement']} ({best[0]['step_s']:.4g} s/step)"
        )
    report["table"] = rows
    report["png"] = plot(report, out_dir / "bench_placement.png")
    json_path = out_dir / "bench_placement.json"
    json_path.write_text(json.dumps(report, indent=1, default=_json_default))
    print(f"wrote {json_path}" + (f" and {report['png']}" if report["png"] else ""))
    report["json"] = str(json_path)
    return report


def _json_default(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return str(v)


if __name__ == "__main__":
    main()
