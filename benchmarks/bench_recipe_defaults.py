"""Does each documented recipe command learn as it is? ``python -m recipes.grpo`` / ``recipes.ppo`` /
``recipes.grpo_async`` run as README shows them, one after another, each a user's subprocess that starts its own
Ray; only the run directory is set, and resume is off so that an earlier run is not continued. From each run's
``metrics.jsonl``: the greedy held-out accuracy before RL (after the warm start) and after the last step, the mean
training reward over the first and the last 5 steps, the wall time of the command, and whether the run printed the
learning-signal warning.

    python -m benchmarks.bench_recipe_defaults                          # all three, about 12 minutes on 2 cores
    python -m benchmarks.bench_recipe_defaults --recipes ppo --out runs/recipe_defaults
    python -m benchmarks.bench_recipe_defaults --recipes grpo --override trainer.total_training_steps=3   # briefer

Prints a table and writes ``outputs/bench_recipe_defaults.json``; ``benchmarks/results/recipe_defaults.json`` is a
copy of the last full run, which README's figures are held to (``tests/test_readme_figures.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import print_table, write_json

RECIPES = ("grpo", "ppo", "grpo_async")
NO_SIGNAL = "the reward tells no sample from another"  # recipes/trainer/steps.py's learning-signal warning


def run_recipe(recipe: str, out: Path, overrides: Sequence[str] = ()) -> dict:
    """The command as README shows it (plus ``overrides``, which then count as part of it), in a subprocess."""
    run_dir = out / recipe
    cmd = [sys.executable, "-m", f"recipes.{recipe}", f"trainer.default_local_dir={run_dir}"]
    cmd += ["trainer.resume_mode=disable", "trainer.overwrite=true", *overrides]  # its own scratch folder
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as a user's command
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    (out / f"{recipe}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {out / f'{recipe}.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    reward = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    return {
        "recipe": recipe,
        "command": " ".join([f"python -m recipes.{recipe}", *overrides]),
        "steps": len(reward),
        "val_before": val[0],
        "val_after": val[-1],
        "reward_first5": sum(reward[:5]) / len(reward[:5]),
        "reward_last5": sum(reward[-5:]) / len(reward[-5:]),
        "wall_s": round(wall, 1),
        "no_signal_warning": NO_SIGNAL in proc.stdout + proc.stderr,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of " + ", ".join(RECIPES))
    p.add_argument("--out", default="runs/recipe_defaults", help="run directories and logs")
    p.add_argument("--override", action="append", default=[], help="key=value for every recipe (repeatable)")
    args = p.parse_args(argv)
    names = [r for r in args.recipes.split(",") if r]
    if unknown := sorted(set(names) - set(RECIPES)):
        p.error(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        results.append(run_recipe(name, out, args.override))
        print_table(results[-1:], list(results[-1]))
    print()
    print_table(results, list(results[0]))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None
    )
    load = [round(x, 2) for x in os.getloadavg()]
    report = {"commit": commit, "cpu": cpu, "load_1_5_15min_at_end": load, "results": results}
    print(f"\nwrote {write_json('bench_recipe_defaults', report)}")
    return report


if __name__ == "__main__":
    main()
