"""Hybrid RL vs the GRPO baseline from one warm start, several seeds each: pass@k on held-out problems per
validation step (mean and spread over seeds), the hint fraction and the OPD term, as a table, JSON and a PNG.

    python -m recipes.compare_hybrid --out runs/cmp                      # 3 seeds, both recipes' YAMLs
    python -m recipes.compare_hybrid --out runs/cmp --seeds 0,1,2,3,4 trainer.total_training_steps=30
    python -m recipes.compare_hybrid --out runs/cmp2 --warm-model runs/cmp/warm/sft_model   # reuse a warm start

1. one warm start (``recipes/hybrid_rl.yaml``'s ``sft``, ``hybrid.hinted_demos`` of it hint-conditioned) into
   ``<out>/warm/sft_model``, and the hint's effect on that model before any RL (``hint_gap``: the mean
   log-prob of the held-out problems' correct solutions with the hindsight judge's hint and without);
2. for every seed (``data.seed``, ``rollout.seed``, ``prm.seed``), ``recipes.hybrid_rl`` (hybrid_rl.yaml) and its
   baseline (``hybrid_rl_grpo.yaml``) from that model (``model.path=<sft_model> sft.enable=false``) with the same
   overrides, alternating, so the only difference within a seed is the advantage (and the PRM / teacher calls
   it needs);
3. ``<out>/pass_at_k.png`` (one panel per k: the mean over seeds against the step, min-max shaded),
   ``<out>/compare.json`` and the printed table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from recipes import hybrid_rl
from recipes.config import load_config
from recipes.trainer import cli, start_run, warm_start
from recipes.trainer.hybrid import hint_gap

RUNS = {"hybrid": "hybrid_rl.yaml", "grpo": "hybrid_rl_grpo.yaml"}
# training metrics of the hybrid runs averaged over steps: how often a hint was given, the OPD term's size
HYBRID_TERMS = ("hybrid/hint_frac", "hybrid/opd_term/abs_mean", "hybrid/opd/abs_mean", "prm/score/mean")


def warm_model(out: Path, overrides: list[str], model: str | None = None) -> tuple[str, dict[str, float]]:
    """The shared warm start (``model``: one trained before, e.g. by an earlier comparison), and ``hint_gap`` of
    it on the held-out split."""
    cfg = load_config(hybrid_rl.RECIPE, [*overrides, f"trainer.default_local_dir={out / 'warm'}"])
    run = start_run(cfg, hybrid_rl.RECIPE)
    model = model or warm_start(cfg, run, hybrid_rl.warm_start_data(cfg))
    rows = pd.read_parquet(run.val_files[0]).to_dict("records")
    return model, hint_gap(model, rows, run.tokenizer, cfg.env, cfg.hybrid.hint_template)


def summarize(runs: dict[str, dict[int, list[tuple[int, dict]]]], ks: list[int]) -> dict:
    """Per method and validation step: mean, std, min and max over seeds of each pass@k."""
    out: dict[str, dict] = {}
    for name, by_seed in runs.items():
        steps = sorted({s for hist in by_seed.values() for s, _ in hist})
        rows = []
        for step in steps:
            row: dict = {"step": step}
            for k in ks:
                vals = [dict(h)[step][f"val/pass@{k}"] for h in by_seed.values() if step in dict(h)]
                row[f"pass@{k}"] = {
                    "mean": float(np.mean(vals)),
                    "std": float(np.std(vals)),
                    "min": float(np.min(vals)),
                    "max": float(np.max(vals)),
                    "seeds": len(vals),
                }
            rows.append(row)
        out[name] = rows
    return out


def plot_pass_at_k(summary: dict, ks: list[int], path: Path) -> str:
    import matplotlib  # heavy, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for j, (name, rows) in enumerate(summary.items()):
            steps = [r["step"] for r in rows]
            mean = [r[f"pass@{k}"]["mean"] for r in rows]
            lo = [r[f"pass@{k}"]["min"] for r in rows]
            hi = [r[f"pass@{k}"]["max"] for r in rows]
            line = ax.plot(steps, mean, marker="os^"[j % 3], linestyle=("-", "--", ":")[j % 3], label=name)[0]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(f"pass@{k} (held-out; mean, min-max over seeds)")
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def print_table(summary: dict, ks: list[int]) -> None:
    cols = [f"{n} pass@{k}" for n in summary for k in ks]
    print("\n" + f"{'step':>5} " + " ".join(f"{c:>17}" for c in cols))
    steps = sorted({r["step"] for rows in summary.values() for r in rows})
    for step in steps:
        cells = []
        for rows in summary.values():
            row = next((r for r in rows if r["step"] == step), None)
            for k in ks:
                v = row[f"pass@{k}"] if row else None
                cells.append(f"{v['mean']:.3f} +- {v['std']:.3f}" if v else "-")
        print(f"{step:>5} " + " ".join(f"{c:>17}" for c in cells))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.compare_hybrid", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="runs/compare_hybrid", help="output directory")
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 1, 2],
        help="RL seeds, e.g. 0,1,2",
    )
    parser.add_argument(
        "--warm-model", default=None, help="an earlier warm start's HF directory (skips step 1)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="applied to every run")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, gap = warm_model(out, args.overrides, args.warm_model)
    print(f"[compare] warm start: {model}; held-out hint gap: {json.dumps(gap)}")
    runs: dict[str, dict[int, list]] = {name: {} for name in RUNS}
    terms: dict[int, dict[str, float]] = {}
    walls: dict[str, list[float]] = {name: [] for name in RUNS}
    for seed in args.seeds:
        for name, yaml in RUNS.items():
            argv_run = [
                "--config",
                str(Path(hybrid_rl.__file__).with_name(yaml)),
                *args.overrides,
                f"model.path={model}",
                "sft.enable=false",
                f"data.seed={seed}",
                f"rollout.seed={seed}",
                f"prm.seed={seed}",
                f"trainer.default_local_dir={out / name / f'seed{seed}'}",
            ]
            print(
                f"[compare] {name} seed {seed}: python -m recipes.hybrid_rl {' '.join(argv_run)}", flush=True
            )
            res = hybrid_rl.main(argv_run)
            runs[name][seed] = res["val_history"]
            walls[name].append(res["wall_s"])
            if name == "hybrid":
                terms[seed] = {
                    t: float(np.mean([m[t] for m in res["history"] if t in m])) for t in HYBRID_TERMS
                }
    ks = sorted(set(load_config(hybrid_rl.RECIPE, args.overrides).eval.pass_k))
    summary = summarize(runs, ks)
    png = plot_pass_at_k(summary, ks, out / "pass_at_k.png")
    result = {
        "warm_model": model,
        "hint_gap": gap,
        "seeds": args.seeds,
        "overrides": args.overrides,
        "summary": summary,
        "hybrid_terms": terms,
        "per_seed": {
            n: {
                s: [{"step": st, **{k: v for k, v in m.items() if k.startswith("val/")}} for st, m in h]
                for s, h in by_seed.items()
            }
            for n, by_seed in runs.items()
        },  # fmt: skip
        "run_wall_s": {n: float(np.mean(w)) for n, w in walls.items()},
        "wall_s": time.perf_counter() - t0,
    }
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print_table(summary, ks)
    for t in HYBRID_TERMS:
        print(f"hybrid {t} (mean over steps and seeds): {np.mean([v[t] for v in terms.values()]):.3f}")
    print(f"plot: {png}\nsummary: {out / 'compare.json'}\nwall time: {result['wall_s']:.0f}s")
    return {**result, "plot": png}


if __name__ == "__main__":
    cli(main)
