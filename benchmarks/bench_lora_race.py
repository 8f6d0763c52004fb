"""LoRA against full fine-tuning at equal wall time, on the quickstart (issue 32).

    python -m benchmarks.bench_lora_race                       # 3 seeds, 40 steps, validation every 5
    python -m benchmarks.bench_lora_race --seeds 1 --steps 10 --sft-model <dir>/seed0-full/sft_model

One supervised warm start (recipes/quickstart.yaml's SFT), then, for each seed (prompt order and sampling), two
GRPO runs of ``--steps`` steps from it, in the same process one after the other: ``full`` (quickstart.yaml as it
is) and ``lora`` (``LORA``: the settings of the recorded LoRA quickstart). Each validates every ``--test-freq``
steps (greedy, the quickstart's 200 held-out prompts), so each has a curve of held-out accuracy against its
training seconds: the sum of ``timing_s/step``, so start-up and validation count for neither arm.

Equal wall time: the budget of a seed is the shorter arm's training time, and each arm is scored by its last
validation inside the budget. Equal steps: each arm's last validation. Both are paired by seed: the mean and
standard error of each arm and of the difference (lora - full). Table + ``outputs/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import print_table, write_json
from recipes import grpo
from recipes.config import load_config
from recipes.trainer import demonstrations, start_run, warm_start

# The recorded LoRA quickstart's settings (benchmarks/results/quickstart_lora.json): LoRA needs 10x the lr.
LORA = ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=1e-3"]
ARMS = {"full": [], "lora": LORA}
DEFAULTS = [
    "trainer.val_before_train=true",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


def curve(result: dict) -> list[dict]:
    """``(step, train_s, val)`` at every validation: training seconds (``timing_s/step``) up to that step."""
    step_s = {row["step"]: row["timing_s/step"] for row in result["history"] if "timing_s/step" in row}
    return [
        {"step": step, "train_s": sum(s for k, s in step_s.items() if k <= step), "val": m["val/accuracy"]}
        for step, m in result["val_history"]
    ]


def score_at(points: list[dict], budget_s: float) -> dict:
    """The last validation of ``points`` whose training seconds are within ``budget_s`` (step 0 always is)."""
    return [p for p in points if p["train_s"] <= budget_s + 1e-9][-1]


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


def summarize(seeds: list[dict]) -> list[dict]:
    """Per seed: each arm's accuracy at equal wall time and at equal steps; then mean and standard error of each
    column and of the paired differences."""
    rows = []
    for s in seeds:
        full, lora = s["arms"]["full"], s["arms"]["lora"]
        budget = min(full[-1]["train_s"], lora[-1]["train_s"])
        at_full, at_lora = score_at(full, budget), score_at(lora, budget)
        rows.append(
            {
                "seed": s["seed"],
                "val_before": full[0]["val"],
                "budget_s": budget,
                "full_s/step": full[-1]["train_s"] / full[-1]["step"],
                "lora_s/step": lora[-1]["train_s"] / lora[-1]["step"],
                "full@time": at_full["val"],
                "full_step@time": at_full["step"],
                "lora@time": at_lora["val"],
                "lora_step@time": at_lora["step"],
                "diff@time": at_lora["val"] - at_full["val"],
                "full@steps": full[-1]["val"],
                "lora@steps": lora[-1]["val"],
                "diff@steps": lora[-1]["val"] - full[-1]["val"],
            }
        )
    numeric = [k for k in rows[0] if k != "seed"]
    stats = [mean_se([r[k] for r in rows]) for k in numeric]
    rows.append({"seed": "mean", **{k: m for k, (m, _) in zip(numeric, stats)}})
    rows.append({"seed": "se", **{k: se for k, (_, se) in zip(numeric, stats)}})
    return rows


def plot(seeds: list[dict], path: str) -> str:
    """Held-out accuracy against training seconds, one line per arm and seed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for s in seeds:
        for arm, color in (("full", "tab:blue"), ("lora", "tab:orange")):
            points = s["arms"][arm]
            label = arm if s is seeds[0] else None
            ax.plot(
                [p["train_s"] for p in points],
                [p["val"] for p in points],
                color=color,
                marker=".",
                label=label,
            )
    ax.set_xlabel("training seconds (validation not counted)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"quickstart: LoRA (rank 16) against full fine-tuning, {len(seeds)} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (prompt order and sampling)")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of each arm")
    parser.add_argument("--test-freq", type=int, default=5, help="validate every N steps")
    parser.add_argument(
        "--sft-model", default=None, help="an earlier run's warm start (<dir>/seed0-full/sft_model)"
    )
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--name", default="bench_lora_race", help="JSON record: outputs/<name>.json")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="quickstart config overrides")
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_lora_race_"))
    common = [
        *DEFAULTS,
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        *args.overrides,
    ]
    load_before, sft_model, seeds = os.getloadavg(), args.sft_model, []
    for seed in range(args.seeds):
        arms = {}
        for arm, extra in ARMS.items():
            cfg = load_config(
                "quickstart",
                [
                    *common,
                    *extra,
                    f"data.seed={seed}",
                    f"rollout.seed={seed}",
                    f"trainer.default_local_dir={work / f'seed{seed}-{arm}'}",
                    "trainer.overwrite=true",  # the benchmark's own scratch folder
                ],
            )
            run = start_run(cfg, "quickstart")
            sft_model = sft_model or warm_start(cfg, run, demonstrations)  # one warm start for every run
            run.model_path = sft_model
            arms[arm] = curve(grpo.train(cfg, run, recipe="quickstart"))
        seeds.append({"seed": seed, "arms": arms})
    rows = summarize(seeds)
    print(
        f"LoRA ({' '.join(LORA)}) against full fine-tuning, held-out accuracy at equal training time and steps"
    )
    print_table(rows, list(rows[0]))
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    payload = {
        "rows": rows,
        "curves": seeds,
        "lora": LORA,
        "args": vars(args),
        "overrides": common,
        "load": load,
    }
    path = write_json(args.name, payload)
    print(f"wrote {path} and {plot(seeds, path.removesuffix('.json') + '.png')}")
    return {"rows": rows, "curves": seeds, "path": path}


if __name__ == "__main__":
    main()
