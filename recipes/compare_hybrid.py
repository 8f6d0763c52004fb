"""Hybrid RL vs the GRPO baseline from the same warm start: pass@k on held-out problems per step, as a PNG.

    python -m recipes.compare_hybrid                                  # both recipes' YAMLs, runs/compare_hybrid
    python -m recipes.compare_hybrid --out runs/cmp trainer.total_training_steps=10 trainer.test_freq=2

1. one warm start (``recipes/hybrid_rl.yaml``'s ``sft``) into ``<out>/warm/sft_model``;
2. ``recipes.hybrid_rl`` (hybrid.yaml) and its baseline (``hybrid_rl_grpo.yaml``) from that model
   (``model.path=<sft_model> sft.enable=false``), each with the same overrides and seeds, so the only
   difference is the advantage (and the PRM / teacher calls it needs);
3. ``<out>/pass_at_k.png`` (one panel per k: pass@k against the step, both runs) and ``<out>/compare.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recipes import hybrid_rl
from recipes.config import load_config
from recipes.trainer import cli, replayed, start_run, warm_start
from workers.agents.replay import reference_batch

RUNS = {"hybrid": "hybrid_rl.yaml", "grpo": "hybrid_rl_grpo.yaml"}


def warm_model(out: Path, overrides: list[str]) -> str:
    cfg = load_config(hybrid_rl.RECIPE, [*overrides, f"trainer.default_local_dir={out / 'warm'}"])
    return warm_start(cfg, start_run(cfg, hybrid_rl.RECIPE), replayed(reference_batch, "demonstrations"))


def plot_pass_at_k(histories: dict[str, list[tuple[int, dict]]], ks: list[int], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for j, (name, hist) in enumerate(histories.items()):
            steps = [s for s, m in hist if f"val/pass@{k}" in m]
            vals = [m[f"val/pass@{k}"] for s, m in hist if f"val/pass@{k}" in m]
            # distinct markers and dashes so identical curves stay visible on top of each other
            ax.plot(
                steps, vals, marker="os^"[j % 3], linestyle=("-", "--", ":")[j % 3], label=name, alpha=0.85
            )
        ax.set_title(f"pass@{k} (held-out)")
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.compare_hybrid", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="runs/compare_hybrid", help="output directory")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="applied to both runs")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = warm_model(out, args.overrides)
    print(f"[compare] warm start: {model}")
    histories, finals = {}, {}
    for name, yaml in RUNS.items():
        argv_run = [
            "--config",
            str(Path(hybrid_rl.__file__).with_name(yaml)),
            *args.overrides,
            f"model.path={model}",
            "sft.enable=false",
            f"trainer.default_local_dir={out / name}",
        ]
        print(f"[compare] {name}: python -m recipes.hybrid_rl {' '.join(argv_run)}")
        res = hybrid_rl.main(argv_run)
        histories[name] = res["val_history"]
        finals[name] = {k: v for k, v in res["final"].items() if isinstance(v, (int, float))}
    cfg = load_config(hybrid_rl.RECIPE, args.overrides)
    ks = sorted(set(cfg.eval.pass_k))
    png = plot_pass_at_k(histories, ks, out / "pass_at_k.png")
    summary = {
        "warm_model": model,
        "pass_at_k": {
            n: [{"step": s, **{k: v for k, v in m.items() if k.startswith("val/")}} for s, m in h]
            for n, h in histories.items()
        },
        "final": finals,
        "wall_s": time.perf_counter() - t0,
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=1))
    cols = [f"{n}/pass@{k}" for n in histories for k in ks]
    print("\n" + f"{'step':>5} " + " ".join(f"{c:>14}" for c in cols))
    for s in sorted({s for h in histories.values() for s, _ in h}):
        vals = [dict(h).get(s, {}).get(f"val/pass@{k}", float("nan")) for h in histories.values() for k in ks]
        print(f"{s:>5} " + " ".join(f"{v:>14.3f}" for v in vals))
    print(f"plot: {png}\nsummary: {out / 'compare.json'}\nwall time: {summary['wall_s']:.0f}s")
    return {**summary, "plot": png}


if __name__ == "__main__":
    cli(main)
