"""Placement x schedule benchmark: GRPO with synchronous, one-step off-policy and fully asynchronous generation
(``recipes.grpo_async``), each for the same wall time from one warm start, measured and predicted.

    python -m benchmarks.bench_placement_async --time 90          # warm start first (cached in --out)
    python -m benchmarks.bench_placement_async --warm-model runs/x/sft_model --time 90 rollout.n=4  # + overrides

Configurations (``--configs``) on ``--devices`` devices (default 2; CPU bundles without a GPU):

* ``sync_colocated``: ``async_rl.mode=sync``, every role on all devices (today's step);
* ``sync_disaggregated``: ``async_rl.mode=sync``, ``--rollout-devices`` for the rollout engines (default half);
* ``one_step``: ``async_rl.mode=one_step``, disaggregated: batch k+1 generates while batch k trains;
* ``full``: ``async_rl.mode=full``, disaggregated: the rollout ranks stream groups into a bounded buffer.

The workload (``WORKLOAD``): the quickstart's ``arith_mixed`` task with 3 to 8 operands instead of 3 to 4, so
response lengths are right-skewed (on the warm start: p50 45, p90 75, max 103 tokens; the default task's are
32-37); 16 prompts x 8 samples a step, responses up to 128 tokens. The policy is warm-started once with the quickstart's SFT
(``recipes/quickstart.yaml``'s ``sft`` on this task) into ``<out>/warm/sft_model`` and reused from there (or
``--warm-model``). Every configuration trains for ``trainer.max_train_time_s = --time`` seconds and validates
(greedy, held-out) before training and at its last step.

Reported per configuration: training steps, samples/s (steps after the first: it fills the pipeline), the
trainer's and the rollout's idle fractions (``async/trainer_idle_frac``, ``async/rollout_idle_frac``), mean
staleness (``async/staleness_mean``) and the groups dropped as too stale (generated again), held-out accuracy
before and after, and the cost model's prediction (``benchmarks/placement_cost_model.py``: fitted on the sync
runs' training stages, and on the decode cost of generate calls of two sizes timed on the warm-started policy,
which also gives the workload's response-length distribution: p50 / p90 / max). Writes
``<out>/bench_placement_async.json`` and ``<out>/bench_placement_async.png``. On CPU this is a functional run on
shared cores, not a speed claim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch

from benchmarks import placement_cost_model as cm
from benchmarks.bench_placement import plan_overrides, pyplot
from benchmarks.common import print_table
from recipes import grpo_async
from recipes.config import ConfigError, load_config
from recipes.schemas import GRPOAsyncConfig
from recipes.trainer import demonstrations, start_run, warm_start
from recipes.trainer.data import prompt_batches, train_loader
from recipes.trainer.run import resolve_device
from recipes.trainer.steps import rollout_meta
from resource_pools.plans import PlacementPlan, placement_plan
from workers.rollout.native.engine import EngineConfig, NativeEngine

RECIPE = "grpo_async"
# config name -> (placement, async_rl.mode)
CONFIGS: dict[str, tuple[str, str]] = {
    "sync_colocated": ("colocated", "sync"),
    "sync_disaggregated": ("disaggregated", "sync"),
    "one_step": ("disaggregated", "one_step"),
    "full": ("disaggregated", "full"),
}
TASK = ["task.name=arith_mixed", "task.knobs.max_operands=8", "task.n_train=2000", "task.n_val=200"]
WORKLOAD = [  # the RL runs: the quickstart's GRPO settings on the long-tailed task
    *TASK,
    "data.max_prompt_length=32",
    "data.max_response_length=128",
    "data.train_batch_size=16",
    "data.val_max_samples=200",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "actor.ppo_mini_batch_size=16",
    "actor.use_kl_loss=false",
    "actor.optim.lr=1e-4",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=100000",  # trainer.max_train_time_s ends the run
    "trainer.test_freq=100000",  # validation before training and at the last step only
    "trainer.val_before_train=true",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.export_hf=false",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.logger=[console]",
    "trainer.cpu_oversubscribe=true",
]
# the warm start: recipes/quickstart.yaml's SFT on the same task (longer demonstrations than its default)
WARM = [*TASK, "data.max_response_length=128", "sft.max_length=160", "trainer.logger=[console]"]
LENGTH_BATCHES = 4  # prompt batches generated to measure the workload's response lengths and decode cost


def config_plan(name: str, devices: int, rollout_devices: int | None) -> PlacementPlan:
    placement = CONFIGS[name][0]
    if placement == "colocated":
        return placement_plan("colocated", devices)
    return placement_plan("disaggregated", devices, rollout_per_node=rollout_devices or devices // 2)


def config_overrides(name: str, plan: PlacementPlan, seconds: float, model: str | None) -> list[str]:
    """The recipe overrides of one configuration (the user's own go between ``WORKLOAD`` and these);
    ``model``: the warm-started policy (None: the recipe's tiny model, to check the config before it exists)."""
    keys = [*plan_overrides(plan), f"async_rl.mode={CONFIGS[name][1]}", f"trainer.max_train_time_s={seconds}"]
    return keys + ([f"model.path={model}"] if model else [])


def warm_model(out: Path, sft_steps: int | None) -> str:
    """``<out>/warm/sft_model``, trained by the quickstart's SFT the first time (then reused)."""
    model = out / "warm" / "sft_model"
    if (model / "config.json").is_file():
        print(f"[bench] reusing the warm start {model}")
        return str(model)
    steps = [f"sft.total_steps={sft_steps}"] if sft_steps is not None else []
    cfg = load_config(
        "quickstart", [*WARM, *steps, f"trainer.default_local_dir={out / 'warm'}", "trainer.overwrite=true"]
    )
    return warm_start(cfg, start_run(cfg, "quickstart"), demonstrations)


def measure_workload(
    overrides: list[str], out: Path, call_prompts: int, batches: int = LENGTH_BATCHES
) -> tuple[list[int], dict[int, list[float]]]:
    """The warm-started policy on the first ``batches`` training batches, with the recipe's sampling settings,
    on the native engine in this process with one thread (as a rollout worker on one CPU runs it): every
    response's length, and the seconds of each generate call by its size in sequences. Half the batches go
    in one call each (a sync step's call), the rest in calls of ``call_prompts`` prompts (``full``'s), so the
    decode cost is seen at two concurrencies."""
    cfg = load_config(
        RECIPE, [*overrides, f"trainer.default_local_dir={out / 'workload'}", "trainer.overwrite=true"]
    )
    run = start_run(cfg, RECIPE, start_ray=False)
    engine = NativeEngine.from_pretrained(run.model_path, run.tokenizer, EngineConfig(seed=cfg.rollout.seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lengths: list[int] = []
    calls: dict[int, list[float]] = {}
    try:
        for step, batch in zip(range(1, batches + 1), prompt_batches(train_loader(cfg, run))):
            size = len(batch) if step <= batches // 2 else call_prompts
            for start in range(0, len(batch), size):
                part = batch.slice(start, min(start + size, len(batch)))
                part.meta_info = rollout_meta(cfg, step)
                t0 = time.perf_counter()
                generated = engine.generate_sequences(part)
                calls.setdefault(len(generated), []).append(time.perf_counter() - t0)
                lengths += [int(x) for x in generated.batch["response_mask"].sum(-1).tolist()]
        return lengths, calls
    finally:
        torch.set_num_threads(threads)
        engine.shutdown()


def length_stats(lengths: list[int]) -> dict[str, float]:
    return {
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": float(max(lengths)),
        "mean": float(np.mean(lengths)),
    }


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def measure(history: list[dict], val_history: list[tuple[int, dict]], rows_per_step: int) -> dict:
    """One run's numbers: throughput and idle fractions over the steps after the first, accuracy before and
    after, the mean stage times (the cost model's observations)."""
    steps = [r for r in history if r.get("step", 0) >= 1 and "timing_s/step" in r]
    if not steps:
        raise RuntimeError("the run logged no training step")
    kept = steps[1:] if len(steps) > 1 else steps  # the first step warms up / fills the pipeline
    step_s = statistics.fmean(r["timing_s/step"] for r in kept)
    timings = {
        k.removeprefix("timing_s/"): _mean(kept, k) for k in set().union(*kept) if k.startswith("timing_s/")
    }
    vals = [(s, m["val/accuracy"]) for s, m in val_history if "val/accuracy" in m]
    return {
        "steps": len(steps),
        "steps_averaged": len(kept),
        "step_s": step_s,
        "samples_per_s": rows_per_step / step_s,
        "trainer_idle_frac": _mean(kept, "async/trainer_idle_frac"),
        "rollout_idle_frac": _mean(kept, "async/rollout_idle_frac"),
        "staleness_mean": _mean(kept, "async/staleness_mean"),
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in steps),
        "val_before": vals[0][1] if vals and vals[0][0] == 0 else None,
        "val_after": vals[-1][1] if vals and vals[-1][0] > 0 else None,
        "val_after_step": vals[-1][0] if vals else None,
        "response_length_mean": _mean(kept, "response_length/mean"),
        "response_length_max": max(
            (r["response_length/max"] for r in steps if "response_length/max" in r), default=None
        ),
        "timing_s": timings,
        "total_tokens": _mean(kept, "perf/total_num_tokens"),
        "weight_bytes": _mean(kept, "perf/weight_sync_bytes") or 0.0,
    }


def workload_of(m: dict, rows: int, lengths: list[int]) -> cm.Workload:
    return cm.Workload(
        sequences=rows,
        response_tokens=m["response_length_mean"] * rows,
        total_tokens=m["total_tokens"],
        weight_bytes=m["weight_bytes"],
        has_ref="ref" in m["timing_s"],
        has_critic=False,
        response_lengths=tuple(lengths),
    )


def decode_observations(lengths: list[int], calls: dict[int, list[float]]) -> list[cm.Observation]:
    """``measure_workload``'s generate calls as the cost model's observations of ``gen`` on one device (the mean
    call of each size; the expected longest response of a call is drawn from all measured lengths)."""
    mean = statistics.fmean(lengths)
    obs = []
    for size, seconds in sorted(calls.items()):
        work = cm.Workload(
            size, mean * size, mean * size, 0.0, has_critic=False, response_lengths=tuple(lengths)
        )
        obs.append(cm.Observation(placement_plan("colocated", 1), work, {"gen": statistics.fmean(seconds)}))
    return obs


def predictions(
    runs: dict[str, dict], lengths: list[int], calls: dict[int, list[float]], parallel_limit: float
) -> tuple[dict | None, dict[str, dict | None]]:
    """(rates, prediction per configuration) of the cost model fitted on the sync runs' training stages and on
    the decode cost of ``measure_workload``'s calls (the sync runs alone see one concurrency per placement,
    blurred by Ray's call overhead); None without a sync run."""
    sync = [n for n, r in runs.items() if r["mode"] == "sync"]
    if not sync:
        return None, dict.fromkeys(runs)
    obs = decode_observations(lengths, calls)
    for n in sync:
        m = runs[n]["measured"]
        stages = {k: v for k, v in m["timing_s"].items() if k in cm.STAGE_ROLES and k != "gen"}
        # the step without its generation (the decode cost is fitted on the engine's calls), so that the rest
        # of the step beyond the stages is the controller's own time
        stages["step"] = m["step_s"] - m["timing_s"]["wait_rollout"]
        obs.append(cm.Observation(runs[n]["plan"], workload_of(m, runs[n]["rows"], lengths), stages))
    rates = cm.fit_rates(obs, parallel_limit)
    work = obs[-1].workload  # a sync run's step (response lengths of the trained policy move a little)
    out: dict[str, dict | None] = {}
    for n, r in runs.items():
        call = r["call_sequences"] if r["mode"] == "full" else None
        out[n] = cm.predict(rates, r["plan"], work, r["mode"], call).as_dict()
    return {k: (v if math.isfinite(v) else None) for k, v in dataclasses.asdict(rates).items()}, out


def table_rows(report: dict) -> list[dict]:
    rows = []
    for name, e in report["configs"].items():
        m, p = e["measured"], e["predicted"] or {}
        rows.append(
            {
                "config": name,
                "placement": e["placement"],
                "steps": m["steps"],
                "samples/s": m["samples_per_s"],
                "pred": p.get("samples_per_s"),
                "trainer_idle": m["trainer_idle_frac"],
                "pred ": p.get("trainer_idle_frac"),
                "rollout_idle": m["rollout_idle_frac"],
                "pred  ": p.get("rollout_idle_frac"),
                "staleness": m["staleness_mean"],
                "dropped_stale": m["dropped_stale_groups"],
                "acc_before": m["val_before"],
                "acc_after": m["val_after"],
                "resp_len_mean": m["response_length_mean"],
            }
        )
    return rows


def plot(report: dict, path: Path) -> str | None:
    """Samples/s per configuration (bars) with the prediction (markers), and held-out accuracy before / after."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(report["configs"])
    entries = [report["configs"][n] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(3.0 + 2.4 * len(names), 4.0))
    ax1.bar(names, [e["measured"]["samples_per_s"] for e in entries], label="measured")
    pred = [(n, e["predicted"]["samples_per_s"]) for n, e in zip(names, entries) if e["predicted"]]
    if pred:
        ax1.scatter(*zip(*pred), marker="_", s=900, color="black", zorder=3, label="predicted")
    ax1.set_ylabel("samples / s")
    ax1.legend(fontsize=7)
    x = np.arange(len(names))
    for dx, key, label in ((-0.2, "val_before", "before"), (0.2, "val_after", "after")):
        ax2.bar(x + dx, [e["measured"][key] or 0.0 for e in entries], width=0.4, label=label)
    ax2.set_xticks(x, names)
    ax2.set_ylabel("held-out accuracy")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.suptitle(f"{report['seconds']:.0f} s of training each: {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_placement_async", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--time", type=float, default=90.0, help="training seconds per configuration (equal wall time)"
    )
    p.add_argument("--devices", type=int, default=2, help="devices (CPU bundles without a GPU) on one node")
    p.add_argument(
        "--rollout-devices", type=int, default=None, help="disaggregated: rollout pool (default half)"
    )
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS), help=",".join(CONFIGS))
    p.add_argument(
        "--warm-model", default=None, help="a warm-started HF directory (default: <out>/warm, made once)"
    )
    p.add_argument(
        "--sft-steps", type=int, default=None, help="SFT steps of a new warm start (quickstart's 1200)"
    )
    p.add_argument("--out", default="outputs/bench_placement_async", help="directory for JSON, PNG, runs")
    p.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="recipes.grpo_async config overrides"
    )
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if not args.time > 0:
        p.error("--time must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    plans = {n: config_plan(n, args.devices, args.rollout_devices) for n in args.configs}
    for n, plan in plans.items():  # every config error before anything runs
        try:
            load_config(RECIPE, [*WORKLOAD, *args.overrides, *config_overrides(n, plan, args.time, None)])
        except ConfigError as err:
            raise SystemExit(f"config {n} ({cm.describe(plan)}): {err}") from None
    out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    own_ray = not ray.is_initialized()  # the warm start or a run starts it; a caller's session is left alone
    runs: dict[str, dict] = {}
    try:
        model = args.warm_model or warm_model(out, args.sft_steps)
        # a warm start's Ray is sized for its one device (torch threads per worker): the first run starts its own
        if own_ray:
            ray.shutdown()
        base = [*WORKLOAD, *args.overrides, f"model.path={model}"]
        base_cfg = load_config(RECIPE, base)
        assert isinstance(base_cfg, GRPOAsyncConfig)  # SCHEMAS[RECIPE]
        call_prompts = base_cfg.async_rl.groups_per_call
        lengths, calls = measure_workload(base, out, call_prompts)
        print(f"[bench] workload response lengths on the warm start: {json.dumps(length_stats(lengths))}")
        for n, plan in plans.items():
            argv_run = [
                *WORKLOAD,
                *args.overrides,
                *config_overrides(n, plan, args.time, model),
                f"trainer.default_local_dir={out / 'runs' / n}",
                "trainer.overwrite=true",  # the benchmark's own scratch folder
            ]
            print(f"[bench] {n}: python -m recipes.{RECIPE} {' '.join(argv_run)}", flush=True)
            cfg = load_config(RECIPE, argv_run)
            assert isinstance(cfg, GRPOAsyncConfig)  # SCHEMAS[RECIPE]
            start = time.perf_counter()
            result = grpo_async.main(argv_run)
            rows = cfg.data.train_batch_size * cfg.rollout.n
            runs[n] = {
                "plan": plan,
                "mode": CONFIGS[n][1],
                "rows": rows,
                "call_sequences": cfg.async_rl.groups_per_call * cfg.rollout.n,
                "wall_s": time.perf_counter() - start,
                "measured": measure(result["history"], result["val_history"], rows),
            }
    finally:
        if own_ray:
            ray.shutdown()
    load.append(os.getloadavg()[0])
    use_gpu = resolve_device(cfg)
    limit = math.inf if use_gpu else float(os.cpu_count() or 1)
    rates, predicted = predictions(runs, lengths, calls, limit)
    report = {
        "device": "gpu" if use_gpu else f"cpu ({os.cpu_count()} cores shared by {args.devices} CPU bundles)",
        "functional_run": not use_gpu,
        "command": "python -m benchmarks.bench_placement_async "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": args.time,
        "warm_model": model,
        "load_average": {"before": load[0], "after": load[1]},
        "workload": {
            "overrides": [*WORKLOAD, *args.overrides],
            "response_length": length_stats(lengths),
            "generate_call_s": {
                size: statistics.fmean(s) for size, s in calls.items()
            },  # one thread, by size
        },
        "rates": rates,
        "configs": {
            n: {
                "placement": cm.describe(r["plan"]),
                "mode": r["mode"],
                "wall_s": r["wall_s"],
                "measured": r["measured"],
                "predicted": predicted[n],
            }
            for n, r in runs.items()
        },
    }
    rows = table_rows(report)
    stats = report["workload"]["response_length"]
    print(
        f"workload response length p50 {stats['p50']:.0f}, p90 {stats['p90']:.0f}, max {stats['max']:.0f} tokens"
    )
    print_table(rows, list(rows[0]))
    report["table"] = rows
    report["png"] = plot(report, out / "bench_placement_async.png")
    json_path = out / "bench_placement_async.json"
    json_path.write_text(json.dumps(report, indent=1, default=_json_default))
    print(f"wrote {json_path}" + (f" and {report['png']}" if report["png"] else ""))
    report["json"] = str(json_path)
    return report


def _json_default(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # an instance (asdict refuses a class)
        return dataclasses.asdict(v)
    return str(v)


if __name__ == "__main__":
    main()
