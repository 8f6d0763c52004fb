"""A few steps of the real GRPO recipe, colocated on one device: time per stage, tokens/s, the update's MFU,
and each stage's peak device memory beside the project's estimate (``workers/models/memory.py``).

    python -m benchmarks.bench_grpo_step                          # CUDA: Qwen2-0.5B shape; CPU: tiny
    python -m benchmarks.bench_grpo_step --preset tiny --steps 2  # seconds on a CPU (the GPU check's rehearsal)
    python -m benchmarks.bench_grpo_step --max-token-len auto     # the memory model's budget beside the peak

``python -m recipes.grpo`` runs as a user would run it (colocated actor + native rollout engine + reference on
one device, the arithmetic task, a random-init model of the preset's shape with the tiny tokenizer, no
validation or checkpoints); its ``metrics.jsonl`` is read back. Stage times are medians over the steps after
the first (the first pays for CUDA kernels' first launches). The update's model FLOPs are
``benchmarks/bench_train.py``'s (6 x matmul parameters x tokens + the lm_head at response positions + attention,
x ppo_epochs), over ``timing_s/update_actor``, against a bf16 matmul peak measured in this process (fp32 on
CPU). Memory (CUDA only): ``perf/max_memory_allocated_gib/gen`` and ``/update_actor`` (peaks reset per stage,
`workers.device_memory`) against `estimate_colocated_step` for the settings in the run's ``config.yaml`` (the
decode graphs' pool counted when the rollout replays CUDA graphs: ``rollout.cuda_graphs`` auto is on with CUDA).
Where the steps' metrics have them, the rollout's decode-graph metrics (``timing_s/graph_capture``,
``rollout/num_graph_captures``, ``rollout/max_graph_memory_gib``) are printed and recorded per step.

Writes ``--out`` (default outputs/bench_grpo_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_memory import make_model_dir
from benchmarks.bench_train import measure_peak, train_flops
from benchmarks.common import machine_info, print_table
from recipes.config import load_config
from workers.models import resolve_dtype
from workers.models.memory import estimate_colocated_step
from workers.rollout.base import rollout_dtype

STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")
# the native engine's decode CUDA graphs (workers/rollout/native/graphs.py), per step where the rollout logs them:
# capture seconds (part of timing_s/gen), graphs captured, and the graphs' memory pool
GRAPH_METRICS = ("timing_s/graph_capture", "rollout/num_graph_captures", "rollout/max_graph_memory_gib")


def recipe_overrides(model_dir: str, run_dir: str, args) -> list[str]:
    return [
        f"model.path={model_dir}",
        "trainer.device=auto",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.logger=[console]",
        "trainer.progress_bar=false",
        f"trainer.default_local_dir={run_dir}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_response_length={args.response_length}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_max_token_len_per_gpu={args.max_token_len}",
        f"rollout.n={args.n}",
        f"rollout.max_num_seqs={args.prompts * args.n}",
        *args.override,
    ]


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--preset", choices=["qwen2-0.5b", "tiny"], default="qwen2-0.5b" if gpu else "tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32 if gpu else 4)
    p.add_argument("--n", type=int, default=8 if gpu else 2)
    p.add_argument("--response-length", type=int, default=256 if gpu else 16)
    p.add_argument(
        "--max-token-len",
        default=str(16384 if gpu else 4096),
        help="update micro-batch budget: a token count, or auto (the memory model's answer for this device, "
        "which the recipe prints and this script records beside the measured peak)",
    )
    p.add_argument("--override", nargs="*", default=[], help="more recipe overrides key=value")
    p.add_argument("--timeout-s", type=float, default=None, help="stop the recipe after this long")
    p.add_argument("--out", default="outputs/bench_grpo_step.json")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench_grpo_step_"))
    model_dir, config = make_model_dir(work / "model", args.preset)
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "recipes.grpo", *recipe_overrides(model_dir, str(run_dir), args)]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(work / "recipe.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    metrics_files = sorted(run_dir.rglob("metrics.jsonl"))
    steps = [json.loads(line) for f in metrics_files for line in f.read_text().splitlines() if line.strip()]
    if rc != 0 or not steps:
        print((work / "recipe.log").read_text()[-6000:])
        print(
            f"recipe exited {rc} after {wall:.0f} s with {len(steps)} step(s) logged; log: {work / 'recipe.log'}"
        )
        return rc or 1

    cfg = load_config("grpo", config_path=run_dir / "config.yaml")  # what the recipe ran with
    timed = steps[1:] or steps  # the first step pays for first launches
    stage_s = {s: median_of(timed, f"timing_s/{s}") for s in STAGES}
    rows = cfg.data.train_batch_size * cfg.rollout.n
    tokens = median_of(timed, "perf/total_num_tokens") or 0.0
    resp_tokens = (median_of(timed, "response_length/mean") or 0.0) * rows
    peak = measure_peak(torch.device("cuda" if gpu else "cpu"))
    # the update's model FLOPs, every sequence at the mean length (the metrics give no per-row lengths)
    flops = cfg.actor.ppo_epochs * train_flops(config, [tokens / rows] * rows, int(resp_tokens))
    update_s = stage_s["update_actor"]
    mfu = flops / update_s / peak if update_s else None

    # decode graphs: per step as logged (the first step captures most of them), or {} where the rollout logs none
    graphs = {k: [st.get(k) for st in steps] for k in GRAPH_METRICS if any(k in st for st in steps)}
    # rollout.cuda_graphs: auto (on with CUDA) unless the run's config says false
    graphs_on = bool(graphs) or (gpu and cfg.rollout.cuda_graphs is not False)

    budget = cfg.actor.ppo_max_token_len_per_gpu
    if budget == "auto":  # the saved config keeps auto; the recipe printed what it resolved to
        said = re.search(
            r"actor\.ppo_max_token_len_per_gpu=auto: (\d+) tokens", (work / "recipe.log").read_text()
        )
        if said is None:
            print(f"the recipe did not say what auto resolved to; log: {work / 'recipe.log'}")
            return 1
        budget = int(said.group(1))
    assert isinstance(budget, int), budget
    est = estimate_colocated_step(
        config,
        compute_dtype=torch.bfloat16 if gpu else torch.float32,  # the engine's mixed precision: on for CUDA
        rollout_dtype=resolve_dtype(rollout_dtype(cfg.model, cfg.rollout)),
        reference=cfg.actor.use_kl_loss,
        max_num_seqs=cfg.rollout.max_num_seqs,
        max_model_len=cfg.rollout.prompt_length + cfg.rollout.response_length,
        micro_batch_tokens=min(int(tokens), budget),
        micro_batch_response_tokens=min(int(resp_tokens), budget),
        cuda_graphs=graphs_on,
    ).gib()
    memory = []
    for stage in ("gen", "update_actor"):
        measured = median_of(timed, f"perf/max_memory_allocated_gib/{stage}")
        memory.append({"stage": stage, "measured_gib": measured, "estimate_gib": est[stage],
                       "reserved_gib": median_of(timed, f"perf/max_memory_reserved_gib/{stage}")})  # fmt: skip

    print(f"GRPO, {args.preset} ({est['params'] / 1e6:.0f}M params) on "
          f"{torch.cuda.get_device_name(0) if gpu else 'cpu'}: {args.prompts} prompts x {args.n}, response <= "
          f"{args.response_length}, {len(steps)} steps in {wall:.0f} s (recipe start included)")  # fmt: skip
    print_table(
        [{"stage": s, "median_s": v} for s, v in stage_s.items() if v is not None], ["stage", "median_s"]
    )
    throughput = median_of(timed, "perf/throughput")
    diff = median_of(timed, "training/rollout_logprob_diff_mean")
    print(
        f"tokens/step {tokens:.0f} (response {resp_tokens:.0f}); perf/throughput {throughput or 0:.0f} tok/s"
    )
    if mfu is not None:
        print(
            f"update {flops / 1e12:.2f} TFLOP in {update_s:.3f} s = MFU {mfu:.3f} of {peak / 1e12:.0f} TFLOP/s"
        )
    if diff is not None:
        print(f"rollout vs trainer log-probs: mean |diff| {diff:.4f} (rollout dtype vs training precision)")
    if graphs:
        print("decode CUDA graphs per step: " + "; ".join(
            f"{k} " + ", ".join("-" if v is None else f"{v:.3g}" for v in vals) for k, vals in graphs.items()
        ))  # fmt: skip
    if gpu:
        print_table(memory, ["stage", "measured_gib", "reserved_gib", "estimate_gib"])
    record = {
        "machine": machine_info(),
        "preset": args.preset,
        "args": vars(args),
        "rc": rc,
        "wall_s": wall,
        "steps_logged": len(steps),
        "stage_median_s": stage_s,
        "max_token_len": budget,  # the update's micro-batch budget (auto's answer where it was auto)
        "tokens_per_step": tokens,
        "response_tokens_per_step": resp_tokens,
        "throughput_tok_s": throughput,
        "update_model_flops": flops,
        "peak_flops_measured": peak,
        "update_mfu": mfu,
        "rollout_logprob_diff_mean": diff,
        "rollout_graphs": graphs,  # per step, from each step's metrics
        "memory_estimate_cuda_graphs": graphs_on,
        "memory": memory,
        "memory_estimate_gib": est,
        "metrics": steps,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
