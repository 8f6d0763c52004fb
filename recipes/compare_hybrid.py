"""Hybrid RL vs the GRPO baseline (and ablations of hybrid) from one warm start, paired by seed: pass@k on
held-out problems per validation step, the paired differences to GRPO at the last step with two exact tests,
the hint fraction and the OPD term, as a table, JSON and a PNG.

    python -m recipes.compare_hybrid --out runs/cmp                      # 3 seeds, hybrid and grpo
    python -m recipes.compare_hybrid --out runs/cmp --seeds 0,1,2,3,4,5,6,7 --arms grpo,hybrid,no_opd,no_prm,opd_no_hint
    python -m recipes.compare_hybrid --out runs/cmp2 --warm-model runs/cmp/warm/sft_model   # reuse a warm start
    python -m recipes.compare_hybrid --out runs/cmp3 --teacher-sft-steps 2000 sft.total_steps=600  # a stronger teacher

1. one warm start (``recipes/hybrid_rl.yaml``'s ``sft``, ``hybrid.hinted_demos`` of it hint-conditioned) into
   ``<out>/warm/sft_model``, and the hint's effect on that model before any RL (``hint_gap``: the mean
   log-prob of the held-out problems' correct solutions with the hindsight judge's hint and without); with
   ``--teacher-sft-steps N`` a second one trained N steps into ``<out>/teacher/sft_model``, the OPD teacher of
   every arm with an OPD term (``hybrid.teacher_path``), and its ``hint_gap``;
2. for every seed (``data.seed``, ``rollout.seed``, ``prm.seed``), each arm of ``--arms`` (``ARMS``: the recipe's
   YAML and its overrides) from that model (``model.path=<sft_model> sft.enable=false``) with the same overrides,
   one after the other, so within a seed the arms differ only by what their overrides change. A run that
   finished before (``<out>/<arm>/seed<k>/compare_run.json`` with the same model and overrides) is read, not
   run again: an interrupted comparison resumes where it stopped;
3. ``<out>/pass_at_k.png`` (one panel per k: the mean over seeds against the step, min-max shaded),
   ``<out>/compare.json`` and the printed tables: per step, and at the last step each arm's mean and standard
   error with its paired difference to ``grpo``, wins / ties / losses by seed, the sign test and the sign-flip
   permutation test (``paired_tests``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from recipes import hybrid_rl
from recipes.config import load_config
from recipes.schemas import HybridConfig
from recipes.trainer import cli, start_run, warm_start
from recipes.trainer.hybrid import hint_gap

# arm -> (the recipe's YAML, overrides): the method, its GRPO baseline and ablations of the method's terms
ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("hybrid_rl_grpo.yaml", []),
    "hybrid": ("hybrid_rl.yaml", []),
    "no_opd": ("hybrid_rl.yaml", ["hybrid.w_opd=0"]),  # GRPO + PRM step advantage
    "no_prm": ("hybrid_rl.yaml", ["hybrid.use_prm_reward=false"]),  # GRPO + OPD (the PRM still writes hints)
    "opd_no_hint": (
        "hybrid_rl.yaml",
        ["hybrid.teacher_reads_hint=false"],
    ),  # OPD's teacher: the plain reference
}
BASELINE = "grpo"
ZERO_VAR = "reward/zero_variance_groups"
# training metrics of the hybrid runs averaged over steps: how often a hint was given, the OPD term's size
HYBRID_TERMS = ("hybrid/hint_frac", "hybrid/opd_term/abs_mean", "hybrid/opd/abs_mean", "prm/score/mean")


def warm_model(
    out: Path, overrides: list[str], model: str | None = None, name: str = "warm"
) -> tuple[str, dict[str, float]]:
    """A warm start in ``<out>/<name>`` (``model``: one trained before, e.g. by an earlier comparison; else this
    comparison's own from an earlier run with the same overrides, else trained now), and ``hint_gap`` of it on
    the held-out split."""
    cfg = load_config(hybrid_rl.RECIPE, [*overrides, f"trainer.default_local_dir={out / name}"])
    assert isinstance(cfg, HybridConfig)  # SCHEMAS[hybrid_rl.RECIPE]
    run = start_run(cfg, hybrid_rl.RECIPE)
    stamp = out / name / "compare_warm.json"  # a comparison run again reuses its warm start (minutes of SFT)
    if model is None and stamp.is_file() and json.loads(stamp.read_text())["overrides"] == overrides:
        model = json.loads(stamp.read_text())["model"]
        print(f"[compare] the {name} start of an earlier run of this comparison: {model}", flush=True)
    if model is None:
        model = warm_start(cfg, run, hybrid_rl.warm_start_data(cfg))
        stamp.write_text(json.dumps({"overrides": overrides, "model": model}))
    rows = pd.read_parquet(run.val_files[0]).to_dict("records")
    return model, hint_gap(model, rows, run.tokenizer, cfg.env, cfg.hybrid.hint_template)


def uses_teacher(arm: str, overrides: list[str]) -> bool:
    """Whether the arm's runs have an OPD term, hence a teacher (the hybrid estimator)."""
    yaml, arm_overrides = ARMS[arm]
    cfg = load_config(
        hybrid_rl.RECIPE,
        [*overrides, *arm_overrides],
        config_path=str(Path(hybrid_rl.__file__).with_name(yaml)),
    )
    return cfg.algorithm.adv_estimator == "hybrid"


def summarize(runs: dict[str, dict[int, list[tuple[int, dict]]]], ks: list[int]) -> dict:
    """Per method and validation step: mean, std, min and max over seeds of each pass@k."""
    out: dict[str, list[dict]] = {}
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


def run_arm(
    out: Path, arm: str, seed: int, model: str, overrides: list[str], teacher: str | None = None
) -> dict:
    """One arm's run for one seed (``ARMS``), or the record of the same run finished before (same warm start and
    overrides): its validation history, training seconds per step, wall time and mean hybrid terms.
    ``teacher``: the OPD teacher of the arms that have one (``hybrid.teacher_path``; None: the warm start)."""
    yaml, arm_overrides = ARMS[arm]
    if teacher is not None and uses_teacher(arm, overrides):
        arm_overrides = [*arm_overrides, f"hybrid.teacher_path={teacher}"]
    run_dir = out / arm / f"seed{seed}"
    argv_run = [
        "--config",
        str(Path(hybrid_rl.__file__).with_name(yaml)),
        *overrides,
        *arm_overrides,
        f"model.path={model}",
        "sft.enable=false",
        f"data.seed={seed}",
        f"rollout.seed={seed}",
        f"prm.seed={seed}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.overwrite=true",  # its own folder: a finished run is read back below, an unfinished one rerun
    ]
    record = run_dir / "compare_run.json"
    if record.is_file():
        done = json.loads(record.read_text())
        if done["argv"] == argv_run:
            print(f"[compare] {arm} seed {seed}: finished before, read from {record}", flush=True)
            return done
    print(f"[compare] {arm} seed {seed}: python -m recipes.hybrid_rl {' '.join(argv_run)}", flush=True)
    res = hybrid_rl.main(argv_run)
    done = {
        "argv": argv_run,
        "val_history": [[step, m] for step, m in res["val_history"]],
        "step_s": {str(m["step"]): m["timing_s/step"] for m in res["history"] if "timing_s/step" in m},
        # the share of GRPO groups whose samples all scored alike: no outcome signal (where GRPO starves)
        "zero_variance_groups": {str(m["step"]): m[ZERO_VAR] for m in res["history"] if ZERO_VAR in m},
        "wall_s": res["wall_s"],
        "terms": {
            t: float(np.mean(v)) for t in HYBRID_TERMS if (v := [m[t] for m in res["history"] if t in m])
        },
    }
    record.write_text(json.dumps(done))  # written last: a run cut short leaves none, and is run again
    return done


def paired_tests(diffs: list[float]) -> dict:
    """Paired differences (arm - baseline, one per seed): wins, ties and losses; the sign test's exact two-sided
    p (ties left out): how often a fair coin splits as unevenly; the sign-flip permutation test's exact two-sided
    p: how often flipping the differences' signs at random gives a sum as far from 0. Neither assumes the
    differences are normal, which a handful of seeds cannot show; the permutation test also weighs their size.
    Past 16 seeds the flips are 2**16 random draws."""
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = wins + losses
    sign_p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n) if n else 1.0
    d = np.asarray(diffs, dtype=float)
    if len(d) <= 16:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    else:
        signs = np.random.default_rng(0).choice((1.0, -1.0), size=(2**16, len(d)))
    extreme = np.abs(signs @ d) >= abs(d.sum()) - 1e-12
    return {"wins": wins, "ties": len(diffs) - n, "losses": losses, "sign_p": sign_p,
            "permutation_p": float(extreme.mean())}  # fmt: skip


def train_seconds(run: dict, step: int) -> float:
    return sum(s for k, s in run["step_s"].items() if int(k) <= step)


def final_comparison(records: dict[str, dict[int, dict]], ks: list[int]) -> dict:
    """Per arm and pass@k, over the seeds every arm ran: at equal steps (each run's last validation) and at
    equal training time (a seed's budget: its shortest run's training seconds, ``timing_s/step`` summed; each
    run scored by its last validation inside it), the mean and standard error, and for every arm but the
    baseline the paired differences to it with ``paired_tests``."""
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in records.values())))

    def scored(run: dict, budget: float | None) -> dict:
        history = [(int(step), m) for step, m in run["val_history"]]
        if budget is not None:
            history = [(step, m) for step, m in history if train_seconds(run, step) <= budget + 1e-9]
        return history[-1][1]

    budgets = {
        seed: min(train_seconds(r[seed], max(int(st) for st, _ in r[seed]["val_history"])) for r in records.values())
        for seed in seeds
    }  # fmt: skip
    out: dict = {"seeds": seeds, "budget_s": budgets, "equal_steps": {}, "equal_time": {}}
    for key, budget_of in (("equal_steps", lambda seed: None), ("equal_time", budgets.get)):
        for arm, by_seed in records.items():
            row: dict = {}
            for k in ks:
                values = [scored(by_seed[seed], budget_of(seed))[f"val/pass@{k}"] for seed in seeds]
                cell = {"mean": float(np.mean(values)), "se": _se(values), "per_seed": values}
                if arm != BASELINE and BASELINE in records:
                    base = [
                        scored(records[BASELINE][seed], budget_of(seed))[f"val/pass@{k}"] for seed in seeds
                    ]
                    diffs = [a - b for a, b in zip(values, base)]
                    cell["diff"] = {"mean": float(np.mean(diffs)), "se": _se(diffs), **paired_tests(diffs)}
                row[f"pass@{k}"] = cell
            out[key][arm] = row
    return out


def _se(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def print_final(final: dict, ks: list[int]) -> None:
    for key in ("equal_steps", "equal_time"):
        print(
            f"\nlast validation, {key.replace('_', ' ')} ({len(final['seeds'])} seeds, paired to {BASELINE}):"
        )
        for arm, row in final[key].items():
            cells = []
            for k in ks:
                c = row[f"pass@{k}"]
                cell = f"pass@{k} {c['mean']:.3f} +- {c['se']:.3f}"
                if "diff" in c:
                    d = c["diff"]
                    cell += (f" (diff {d['mean']:+.3f} +- {d['se']:.3f}, W/T/L {d['wins']}/{d['ties']}/{d['losses']}, "
                             f"sign p {d['sign_p']:.3f}, perm p {d['permutation_p']:.3f})")  # fmt: skip
                cells.append(cell)
            print(f"  {arm:>12}: " + "; ".join(cells))


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
        "--arms",
        type=lambda v: v.split(","),
        default=["hybrid", BASELINE],
        help=f"comma-separated, of {', '.join(ARMS)} (differences are to {BASELINE})",
    )
    parser.add_argument(
        "--warm-model", default=None, help="an earlier warm start's HF directory (skips step 1)"
    )
    parser.add_argument(
        "--teacher-sft-steps",
        type=int,
        default=None,
        help="a second warm start, trained this many SFT steps (<out>/teacher), as the OPD teacher of the arms "
        "that have one (hybrid.teacher_path); default: the policy's warm start teaches",
    )
    parser.add_argument(
        "--teacher-model", default=None, help="an earlier teacher's HF directory (skips training one)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="applied to every run")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {unknown}; the arms are {list(ARMS)}")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, gap = warm_model(out, args.overrides, args.warm_model)
    print(f"[compare] warm start: {model}; held-out hint gap: {json.dumps(gap)}")
    teacher = None
    if args.teacher_sft_steps is not None or args.teacher_model is not None:
        steps = [] if args.teacher_sft_steps is None else [f"sft.total_steps={args.teacher_sft_steps}"]
        path, teacher_gap = warm_model(out, [*args.overrides, *steps], args.teacher_model, name="teacher")
        teacher = {"model": path, "sft_steps": args.teacher_sft_steps, "hint_gap": teacher_gap}
        print(f"[compare] OPD teacher: {path}; held-out hint gap: {json.dumps(teacher_gap)}")
    records: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            records[arm][seed] = run_arm(
                out, arm, seed, model, args.overrides, teacher["model"] if teacher else None
            )
    runs = {arm: {seed: r["val_history"] for seed, r in by_seed.items()} for arm, by_seed in records.items()}
    cfg = load_config(hybrid_rl.RECIPE, args.overrides)
    assert isinstance(cfg, HybridConfig)  # SCHEMAS[hybrid_rl.RECIPE]
    ks = sorted(set(cfg.eval.pass_k))
    summary = summarize(runs, ks)
    final = final_comparison(records, ks)
    png = plot_pass_at_k(summary, ks, out / "pass_at_k.png")
    terms = {
        arm: {seed: r["terms"] for seed, r in by_seed.items() if r["terms"]}
        for arm, by_seed in records.items()
    }
    result = {
        "warm_model": model,
        "hint_gap": gap,
        "teacher": teacher,  # None: the warm start teaches
        "seeds": args.seeds,
        "arms": args.arms,
        "overrides": args.overrides,
        "summary": summary,
        "final": final,
        "hybrid_terms": {arm: t for arm, t in terms.items() if t},
        "per_seed": {
            n: {
                s: [{"step": st, **{k: v for k, v in m.items() if k.startswith("val/")}} for st, m in h]
                for s, h in by_seed.items()
            }
            for n, by_seed in runs.items()
        },  # fmt: skip
        "zero_variance_groups": {
            arm: {seed: r.get("zero_variance_groups", {}) for seed, r in by_seed.items()}
            for arm, by_seed in records.items()
        },
        "run_wall_s": {
            arm: float(np.mean([r["wall_s"] for r in by_seed.values()])) for arm, by_seed in records.items()
        },
        "wall_s": time.perf_counter() - t0,
    }
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print_table(summary, ks)
    print_final(final, ks)
    for arm, by_seed in records.items():
        shares = [r.get("zero_variance_groups", {}) for r in by_seed.values()]
        first = [z["1"] for z in shares if "1" in z]
        every = [v for z in shares for v in z.values()]
        if every:
            print(f"{arm}: groups without outcome signal ({ZERO_VAR}) at step 1 {np.mean(first):.2f}, "
                  f"over all steps {np.mean(every):.2f}")  # fmt: skip
    for arm, by_seed in result["hybrid_terms"].items():
        means = {t: np.mean([v[t] for v in by_seed.values() if t in v]) for t in HYBRID_TERMS}
        print(
            f"{arm} terms (mean over steps and seeds): " + ", ".join(f"{t} {v:.3f}" for t, v in means.items())
        )
    print(f"plot: {png}\nsummary: {out / 'compare.json'}\nwall time: {result['wall_s']:.0f}s")
    return {**result, "plot": png}


if __name__ == "__main__":
    cli(main)
