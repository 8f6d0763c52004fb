"""A GRPO step of hyflow against Hugging Face TRL's ``GRPOTrainer`` on the same work, in one run.

    python -m benchmarks.bench_vs_trl [--steps 40] [--rounds 2] [--warmup 5] [--sft-steps 800]

The same work on both sides: the tiny Qwen2 (workers/models/tiny.py, ~1M parameters) and its locally built
tokenizer, warm-started once by hyflow's SFT (``recipes.trainer.warm_start``) on 2-digit additions written
as ``\\boxed{N}`` and saved as one HF directory that both sides load; 4 prompts x 8 samples per step, at most
16 new tokens, temperature 1, lr 2e-5 (constant, no weight decay), clip 0.2, no KL, one epoch and one
mini-batch per batch (one optimizer step); the same prompt token ids (the chat template; checked), the same
EOS ids, the same reward (the last ``\\boxed{}`` equals the answer).

hyflow runs its real recipe, ``recipes.grpo.main`` with overrides (colocated, 1 device), and reports its own
``timing_s/step``; TRL runs ``benchmarks/trl_grpo_baseline.py`` in its own virtualenv (``.venv-trl``, made by
``benchmarks/trl_env.sh`` when missing: TRL is a baseline, never a dependency), timing each optimizer step
with a TrainerCallback. Rounds alternate hyflow, TRL, hyflow, TRL, ...; per side the median and p90 step time
over the steps after the first ``--warmup`` of each round, completion tokens per step (both sides must
generate comparable amounts) and the mean training reward; the ratio hyflow / TRL. JSON to
``outputs/bench_vs_trl.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict
from unittest.mock import patch

import pandas as pd
import ray

from benchmarks.common import print_table, write_json
from benchmarks.trl_grpo_baseline import N_RENDERED, render_ids
from recipes import grpo
from recipes.data import PromptDataset
from recipes.tasks import generate_splits, write_parquet
from recipes.trainer import demonstrations, parse_args, start_run, warm_start
from recipes.trainer.tracking import Tracker
from workers.models.loading import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".venv-trl"
TRL_SCRIPT = ROOT / "benchmarks" / "trl_grpo_baseline.py"
TRL_SETUP = ROOT / "benchmarks" / "trl_env.sh"

# 2-digit additions from the arithmetic task generator: two operands, "+" only, sums up to 198
ADDITION_KNOBS: dict[str, Any] = {
    "min_operands": 2,
    "max_operands": 2,
    "max_operand": 99,
    "ops": "+",
    "max_abs_value": 198,
}
_ADDITION = re.compile(r"Compute (\d+)\+(\d+)\.")

N_VAL = 200  # held-out prompts
RACE_MAX_STEPS = 100_000  # a race ends on time, long before this


class Work(TypedDict):
    """``WORK``'s keys and types."""

    n_prompts: int
    n_samples: int
    max_new_tokens: int
    lr: float
    temperature: float
    clip_ratio: float
    grad_clip: float
    seed: int


WORK: Work = {  # the GRPO settings both sides run
    "n_prompts": 4,
    "n_samples": 8,
    "max_new_tokens": 16,
    "lr": 2e-5,
    "temperature": 1.0,
    "clip_ratio": 0.2,
    "grad_clip": 1.0,
    "seed": 0,
}


def operands(question: str) -> tuple[int, int]:
    """``a, b`` of the arithmetic task's prompt ``Compute a+b.``"""
    match = _ADDITION.fullmatch(question)
    if match is None:
        raise ValueError(f"not an addition prompt: {question!r}")
    return int(match[1]), int(match[2])


def addition_rows(n: int, split_rows: list[dict]) -> list[dict]:
    """The first ``n`` rows whose operands both have two digits, each demonstration the bare ``\\boxed{N}``
    (short answers keep every completion inside 16 new tokens)."""
    rows = []
    for row in split_rows:
        a, b = operands(row["extra_info"]["question"])
        if a >= 10 and b >= 10:
            answer = row["reward_model"]["ground_truth"]
            rows.append({**row, "extra_info": {**row["extra_info"], "solution": f"\\boxed{{{answer}}}"}})
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} two-digit additions among {len(split_rows)} rows, {n} asked")
    return rows[:n]


def write_task(out: Path, n_train: int, n_val: int, n_sft: int, seed: int = 0) -> dict[str, str]:
    """``out/{train,val,sft}.parquet`` of 2-digit additions, no problem in two splits: the warm start learns
    from ``sft``, so the RL prompts (``train``) are not memorised (a memorised group is all correct: no signal)."""
    # 1.3x the rows asked: ~83% of the sums drawn from 1..99 have two 2-digit operands
    sizes = {"train": n_train, "val": n_val, "sft": n_sft}
    drawn = {k: int(1.3 * n) + 10 for k, n in sizes.items()}
    splits = generate_splits(
        "arithmetic", drawn["train"], drawn["val"], seed=seed, n_sft=drawn["sft"], **ADDITION_KNOBS
    )
    return {
        split: write_parquet(addition_rows(n, splits[split]), out / f"{split}.parquet")
        for split, n in sizes.items()
    }


def common_overrides(files: dict[str, str], run_dir: Path) -> list[str]:
    return [
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['val']}]",
        "data.max_prompt_length=32",
        f"data.val_max_samples={N_VAL}",
        f"data.max_response_length={WORK['max_new_tokens']}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.overwrite=true",  # the benchmark's own scratch folder
        "trainer.n_gpus_per_node=1",
        "trainer.placement=colocated",
    ]


def in_own_ray(fn, *args):
    """``fn(*args)``, with Ray shut down afterwards when it was not running before (the TRL rounds then run
    beside no idle Ray processes); a caller's session (tests) is left as it is."""
    started_here = not ray.is_initialized()
    try:
        return fn(*args)
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


def warm_started_model(
    work_dir: Path, files: dict[str, str], sft_steps: int, n_sft: int, tiny_size: str
) -> str:
    """The HF directory both sides start from: hyflow's SFT (the quickstart's optimiser settings) on the ``sft``
    split's additions, ``sft_steps`` steps (0: the untrained tiny model), exported once and reused."""
    model_dir = work_dir / f"model-{tiny_size}-sft{sft_steps}-n{n_sft}"  # the data is deterministic in n_sft
    if (model_dir / "config.json").is_file():
        return str(model_dir)
    cfg = parse_args(
        "quickstart",
        [
            *common_overrides({**files, "train": files["sft"]}, work_dir / "sft_run"),
            f"model.tiny_size={tiny_size}",
            f"sft.enable={str(sft_steps > 0).lower()}",
            f"sft.total_steps={max(sft_steps, 1)}",
            "sft.max_length=64",
            "sft.log_every=100",
        ],
    )

    def sft() -> str:
        run = start_run(cfg, "quickstart")
        return warm_start(cfg, run, demonstrations)

    trained = in_own_ray(sft)
    shutil.copytree(trained, model_dir)
    # an untrained tiny model's directory has the tokenizer; an export too
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    return str(model_dir)


def hyflow_prompt_ids(model_dir: str, train_file: str, n: int) -> list[list[int]]:
    """The token ids of the first ``n`` training prompts as hyflow's prompt dataset renders them."""
    dataset = PromptDataset(train_file, load_tokenizer(model_dir), max_prompt_length=32)
    return [list(dataset[i]["input_ids"]) for i in range(n)]


def grpo_overrides(model_dir: str, files: dict[str, str], run_dir: Path, seed: int) -> list[str]:
    """``recipes.grpo`` overrides for the work (``WORK``): the model, data, sampling and update settings."""
    return [
        *common_overrides(files, run_dir),
        f"model.path={model_dir}",
        f"data.train_batch_size={WORK['n_prompts']}",
        f"data.seed={seed}",
        f"rollout.n={WORK['n_samples']}",
        f"rollout.temperature={WORK['temperature']}",
        f"rollout.seed={seed}",
        f"actor.ppo_mini_batch_size={WORK['n_prompts']}",
        "actor.ppo_epochs=1",
        "actor.use_kl_loss=false",
        "actor.entropy_coeff=0.0",
        f"actor.clip_ratio={WORK['clip_ratio']}",
        "actor.loss_agg_mode=token-mean",
        f"actor.optim.lr={WORK['lr']}",
        "actor.optim.weight_decay=0.0",
        f"actor.optim.grad_clip={WORK['grad_clip']}",
        "algorithm.use_kl_in_reward=false",
        "algorithm.norm_adv_by_std_in_grpo=true",
    ]


def hyflow_round(
    model_dir: str,
    files: dict[str, str],
    steps: int,
    run_dir: Path,
    race_s: float | None = None,
    seed: int = WORK["seed"],
    extra: list[str] | None = None,
) -> dict:
    """``steps`` steps of ``recipes.grpo`` on the work (with ``race_s``: as many as fit in that many seconds of
    training); per step: seconds (``timing_s/step``), completion tokens and mean reward; the greedy held-out
    accuracy before the first step (and with ``race_s``, after the last). ``extra``: more overrides for hyflow's
    side (``--hyflow-override``, e.g. ``model.compile=true``).

    ``line_s``: the step as its user sees it, the wall time between two consecutive step lines of the console
    (``Tracker.log`` returns once the line, metrics.jsonl and TensorBoard are written): the recipe's whole loop,
    batch loading, metrics and tracking included, with ``grpo.yaml``'s own loggers and progress bar."""
    n_rows = WORK["n_prompts"] * WORK["n_samples"]
    overrides = [
        *grpo_overrides(model_dir, files, run_dir, seed),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=true",  # the warm start's greedy held-out accuracy, before the timed steps
        # a race validates once more, at its last step (a run out of time makes that step the last)
        *(
            [f"trainer.max_train_time_s={race_s}", f"trainer.test_freq={steps}"]
            if race_s
            else ["trainer.test_freq=-1"]
        ),
        "trainer.save_freq=-1",
        "trainer.export_hf=false",
        *(extra or []),
    ]
    line_at: list[float] = []
    log = Tracker.log

    def timed_log(tracker: Tracker, metrics: dict, step: int) -> None:
        log(tracker, metrics, step)
        if step > 0:  # step 0: the validation before training
            line_at.append(time.perf_counter())

    with patch.object(Tracker, "log", timed_log):
        result = in_own_ray(grpo.main, overrides)
    history = [row for row in result["history"] if "timing_s/step" in row]  # not the validation row of step 0
    return {
        "val_accuracy_before": result["val_history"][0][1]["val/accuracy"],
        "val_accuracy_after": result["val_history"][-1][1]["val/accuracy"] if race_s else None,
        "step_s": [row["timing_s/step"] for row in history],
        "line_s": [b - a for a, b in zip(line_at, line_at[1:])],  # line_s[i] ends with step i + 2's line
        "completion_tokens": [row["response_length/mean"] * n_rows for row in history],
        "reward": [row["critic/score/mean"] for row in history],
        # where a step goes: each stage the recipe times (gen, reward, update_actor, update_weights, ...)
        "stage_s": {k.removeprefix("timing_s/"): [row.get(k, 0.0) for row in history] for k in STAGE_KEYS},
    }


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL virtualenv's python, set up by ``benchmarks/trl_env.sh`` when missing."""
    python = venv / "bin" / "python"
    if not (venv / ".trl-installed").is_file():
        print(f"[bench_vs_trl] setting up TRL in {venv}: bash {TRL_SETUP} {venv}", flush=True)
        subprocess.run(["bash", str(TRL_SETUP), str(venv)], check=True)
    return python


def questions_and_answers(parquet: str) -> list[dict]:
    rows = json.loads(pd.read_parquet(parquet).to_json(orient="records"))  # plain JSON types
    return [
        {"question": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"]} for r in rows
    ]


def trl_spec(
    model_dir: str, files: dict[str, str], steps: int, race_s: float | None = None, seed: int = WORK["seed"]
) -> dict:
    """The TRL script's spec: the model, the training prompts (question, answer) in file order, the work (its
    ``seed``: prompt order and sampling); for a race, the seconds of training and the held-out prompts its greedy
    accuracy is measured on afterwards."""
    spec = {
        "model_dir": model_dir,
        "prompts": questions_and_answers(files["train"]),
        "steps": steps,
        **WORK,
        "seed": seed,
    }
    if race_s:
        spec |= {"train_seconds": race_s, "held_out": questions_and_answers(files["val"])}
    return spec


def trl_round(python: Path, spec: dict, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = run_dir / "spec.json", run_dir / "result.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with open(run_dir / "trl.log", "w") as log:  # TRL prints a dict per step: kept out of the table's way
        done = subprocess.run(
            [str(python), str(TRL_SCRIPT), str(spec_path), str(out_path)], env=env, stdout=log, stderr=log
        )
    if done.returncode != 0:
        raise SystemExit(f"the TRL round failed (exit {done.returncode}); see {run_dir / 'trl.log'}")
    return json.loads(out_path.read_text())


def race_row(side: str, seed: int, result: dict, before: float, after: float) -> dict:
    """One side's race with one seed: steps done, held-out accuracy before and after, mean training reward."""
    return {
        "side": side,
        "seed": seed,
        "steps": len(result["step_s"]),
        "held_out_before": before,
        "held_out_after": after,
        "mean_reward": statistics.fmean(result["reward"]),
    }


def race(
    python: Path | None,
    model_dir: str,
    files: dict[str, str],
    seconds: float,
    work_dir: Path,
    seeds: int = 1,
    extra: list[str] | None = None,
) -> dict:
    """For each of ``seeds`` seeds (prompt order and sampling, the same seed on both sides), each side trains
    ``seconds`` of wall time from the same warm start (start-up and validation not counted); steps done and
    greedy held-out accuracy before and after, per seed and the mean per side, printed as a table."""
    load_before = os.getloadavg()  # the machine is shared: the load beside the numbers
    runs: list[dict] = []
    for seed in range(seeds):
        ours = hyflow_round(
            model_dir,
            files,
            RACE_MAX_STEPS,
            work_dir / f"race_hyflow_s{seed}",
            race_s=seconds,
            seed=seed,
            extra=extra,
        )
        # before: each side's own greedy evaluation of the same warm start (hyflow's engine, HF generate): equal
        runs.append(race_row("hyflow", seed, ours, ours["val_accuracy_before"], ours["val_accuracy_after"]))
        if python is not None:
            spec = trl_spec(model_dir, files, RACE_MAX_STEPS, seconds, seed=seed)
            theirs = trl_round(python, spec, work_dir / f"race_trl_s{seed}")
            runs.append(
                race_row("trl", seed, theirs, theirs["held_out_accuracy_before"], theirs["held_out_accuracy"])
            )
    sides = list(dict.fromkeys(run["side"] for run in runs))
    means = {
        side: {
            key: statistics.fmean(run[key] for run in runs if run["side"] == side)
            for key in ("steps", "held_out_before", "held_out_after", "mean_reward")
        }
        for side in sides
    }
    print(f"race: {seconds:g} s of GRPO each from the warm start, greedy held-out accuracy before and after")
    columns = ["side", "seed", "steps", "held_out_before", "held_out_after", "mean_reward"]
    print_table([*runs, *({"side": side, "seed": "mean", **means[side]} for side in sides)], columns)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    return {"seconds": seconds, "seeds": seeds, "runs": runs, "mean": means, "load_average": load}


STAGE_KEYS = (
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
)


def stage_medians(rounds: list[dict], warmup: int) -> dict[str, float]:
    """Median milliseconds of each timed stage of hyflow's step (0 where a stage did not run)."""
    stages = rounds[0]["stage_s"]
    return {
        name: 1e3 * statistics.median(t for r in rounds for t in r["stage_s"][name][warmup:])
        for name in stages
    }


def trl_stage_medians(rounds: list[dict], warmup: int) -> dict[str, float]:
    """Median milliseconds of TRL's step split in two: its generate-and-score call (sampling, reward,
    advantages) and the rest (loss, backward, clipping, optimizer step, the Trainer's own work)."""
    generate = [g for r in rounds for g in r["generate_s"][warmup:]]
    rest = [
        t - g for r in rounds for t, g in zip(r["step_s"][warmup:], r["generate_s"][warmup:], strict=True)
    ]
    return {"generate_and_score": 1e3 * statistics.median(generate), "rest": 1e3 * statistics.median(rest)}


def summarize(rounds: list[dict], warmup: int) -> dict:
    """Median / p90 step seconds over each round's steps after ``warmup``; the same of the step as the user sees
    it (``line_s``: console line to console line) and the median of what the user's step spends outside the
    timed step (``outside_step_s``: line_s minus that step's step_s); mean tokens per step and reward.
    ``first_step_extra_s``: what the first step of a round takes beyond a counted one (one-time costs: a
    compiled step's compilation), averaged over the rounds."""
    times = sorted(t for r in rounds for t in r["step_s"][warmup:])
    lines = sorted(t for r in rounds for t in r["line_s"][max(warmup - 1, 0) :])
    # line_s[i] holds step i + 1 (0-based step_s) and what the loop does around it
    outside = [
        line - r["step_s"][i + 1] for r in rounds for i, line in enumerate(r["line_s"]) if i + 1 >= warmup
    ]
    tokens = [t for r in rounds for t in r["completion_tokens"]]
    rewards = [x for r in rounds for x in r["reward"]]
    return {
        "median_step_s": statistics.median(times),
        "p90_step_s": _p90(times),
        "median_line_s": statistics.median(lines),
        "p90_line_s": _p90(lines),
        "outside_step_s": statistics.median(outside),
        "steps_counted": len(times),
        "first_step_extra_s": statistics.fmean(r["step_s"][0] for r in rounds) - statistics.median(times),
        "completion_tokens_per_step": statistics.fmean(tokens),
        "mean_reward": statistics.fmean(rewards),
    }


def _p90(sorted_times: list[float]) -> float:
    return sorted_times[min(len(sorted_times) - 1, int(0.9 * len(sorted_times)))]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per side, alternating hyflow / TRL")
    p.add_argument("--warmup", type=int, default=5, help="steps of each round left out of the statistics")
    p.add_argument("--sft-steps", type=int, default=800, help="hyflow SFT steps of the shared warm start")
    p.add_argument(
        "--n-train", type=int, default=2000, help="RL training prompts (as many SFT demonstrations)"
    )
    p.add_argument("--tiny-size", default="tiny", help="workers/models/tiny.py preset")
    p.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / "bench_vs_trl")
    p.add_argument("--trl-venv", type=Path, default=TRL_VENV)
    p.add_argument(
        "--race-s",
        type=float,
        default=None,
        help="also race: each side trains this many seconds from the warm start, then greedy held-out accuracy",
    )
    p.add_argument(
        "--race-seeds",
        type=int,
        default=1,
        help="races per side, seeds 0..N-1 (prompt order and sampling; the same seed on both sides)",
    )
    p.add_argument(
        "--hyflow-only", action="store_true", help="no TRL rounds (hyflow's side of the table only)"
    )
    p.add_argument(
        "--hyflow-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for hyflow's side, e.g. model.compile=true (repeatable)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} leaves no step of {args.steps} to count")
    python = None if args.hyflow_only else ensure_trl_venv(args.trl_venv)
    files = write_task(args.work_dir / "data", args.n_train, N_VAL, args.n_train)
    model_dir = warm_started_model(args.work_dir, files, args.sft_steps, args.n_train, args.tiny_size)
    spec = trl_spec(model_dir, files, args.steps)
    questions = [p["question"] for p in spec["prompts"][:N_RENDERED]]
    prompt_ids = hyflow_prompt_ids(model_dir, files["train"], N_RENDERED)
    if prompt_ids != render_ids(load_tokenizer(model_dir), questions):
        raise SystemExit("hyflow and TRL render the prompts to different token ids")
    print(
        f"[bench_vs_trl] model {model_dir}; prompt of {len(prompt_ids[0])} tokens: {prompt_ids[0]}",
        flush=True,
    )
    load_before = os.getloadavg()  # the machine is shared: the load beside the numbers
    rounds: dict[str, list[dict]] = {"hyflow": [], "trl": []}
    for i in range(args.rounds):
        rounds["hyflow"].append(
            hyflow_round(
                model_dir, files, args.steps, args.work_dir / f"hyflow_{i}", extra=args.hyflow_override
            )
        )
        if python is not None:
            result = trl_round(python, spec, args.work_dir / f"trl_{i}")
            if result["prompt_ids"] != prompt_ids:
                raise SystemExit("TRL rendered the prompts to other token ids than hyflow")
            rounds["trl"].append(result)
    summary = {side: summarize(r, args.warmup) for side, r in rounds.items() if r}
    rows = [{"side": side, **s} for side, s in summary.items()]
    print_table(
        rows,
        ["side", "median_step_s", "p90_step_s", "median_line_s", "p90_line_s", "outside_step_s", "steps_counted",
         "first_step_extra_s", "completion_tokens_per_step", "mean_reward"],
    )  # fmt: skip
    stages = stage_medians(rounds["hyflow"], args.warmup)
    print("hyflow's step by stage, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    trl_stages = trl_stage_medians(rounds["trl"], args.warmup) if rounds["trl"] else None
    if trl_stages:
        print("TRL's step split, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in trl_stages.items()))
    print(
        f"warm start: greedy held-out accuracy {rounds['hyflow'][0]['val_accuracy_before']:.3f} (hyflow's validator)"
    )
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    ratio = line_ratio = None
    if "trl" in summary:
        ratio = summary["hyflow"]["median_step_s"] / summary["trl"]["median_step_s"]
        line_ratio = summary["hyflow"]["median_line_s"] / summary["trl"]["median_line_s"]
        print(
            f"hyflow / TRL median step time: {ratio:.2f}; as the user sees it (line to line): {line_ratio:.2f}"
        )
    payload = {
        "work": WORK,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_dir": model_dir,
        "prompt_ids": prompt_ids,
        "summary": summary,
        "hyflow_stage_ms": stages,
        "trl_stage_ms": trl_stages,
        "ratio_hyflow_over_trl": ratio,
        "line_ratio_hyflow_over_trl": line_ratio,
        "load_average": load,
        "rounds": rounds,
        "trl_versions": rounds["trl"][0]["versions"] if rounds["trl"] else None,
    }
    if args.race_s:
        payload["race"] = race(
            python, model_dir, files, args.race_s, args.work_dir, args.race_seeds, args.hyflow_override
        )
    path = write_json("bench_vs_trl", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
