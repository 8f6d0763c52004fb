"""Peak resident memory per rank of one GRPO step at real model shapes, on 1 and on 2 gloo FSDP ranks (CPU).

A random-init directory with Qwen2-0.5B's configuration (hidden 896, 24 layers, 14 / 2 heads, intermediate
4864, vocabulary 151936, tied embeddings; no download, no weights file: `workers.models.meta_init`) plus the
tiny model's tokenizer goes through the real recipe (``python -m recipes.grpo``, colocated actor + native
rollout, no KL, one step, a few short samples) once per DP size. While it runs, every process below the
recipe is polled for its peak resident memory (``VmHWM`` in /proc/<pid>/status); the table gives each Ray
worker's peak beside its theoretical share (``--placement disaggregated``: the ranks train, one more rank holds
the rollout replica and receives the weights over the weight-sync group):

    train state / world  = (params + grads + AdamW m, v) * 4 bytes / world        (fp32, FSDP-sharded)
    rollout replica      = params * 4 bytes                                         (one per colocated rank)
    activations          = the step's saved activations and response logits (workers/models/memory.py)
    FSDP gather          = world > 1 only: the largest FSDP unit unsharded during backward, the root with the
                           tied 151936 x 896 embedding: its gathered parameter, its full gradient and the
                           reduce-scatter input (3 x 0.51 GiB; an estimate, an upper bound)

plus what a worker process holds before any model (torch, transformers, Ray: ~0.6 GiB, the worker's peak
with ``--preset tiny``). Ray's own processes (idle workers, agents) are left out of the table.

    flock /tmp/hyflow-heavy.lock nice -n 5 .venv/bin/python -m benchmarks.bench_memory            # 0.5B, 1 and 2
    flock /tmp/hyflow-heavy.lock nice -n 5 .venv/bin/python -m benchmarks.bench_memory --placement disaggregated
    .venv/bin/python -m benchmarks.bench_memory --preset tiny --ranks 1 2                           # seconds

Writes ``outputs/bench_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import QWEN2_0_5B_SHAPE, print_table, write_json
from workers.models.memory import activation_bytes, num_params

PRESETS: dict[str, dict[str, Any]] = {  # Qwen2Config keyword arguments
    # Qwen2-0.5B's configuration (config.json of Qwen/Qwen2-0.5B).
    "qwen2-0.5b": dict(
        **QWEN2_0_5B_SHAPE,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=4096,
        tie_word_embeddings=True,
    ),
}
GIB = 1 << 30
RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # no model in these


def make_model_dir(out: Path, preset: str, seed: int = 0):
    """A random-init directory of ``preset`` with the tiny model's tokenizer; (path, its transformers config)."""
    from transformers import AutoTokenizer, Qwen2Config

    from workers.models.meta_init import write_random_init_model
    from workers.models.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny"))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = Qwen2Config(**PRESETS[preset], pad_token_id=tokenizer.pad_token_id, **ids)
    return write_random_init_model(out, config, seed=seed, tokenizer=tokenizer), config


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()[:60]
    except OSError:
        return ""


class PeakPoller(threading.Thread):
    """Polls every process below ``root`` for its VmHWM (KiB) until stopped; keeps the last value per pid."""

    def __init__(self, root: int, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.peaks: dict[int, int] = {}
        self.titles: dict[int, str] = {}
        self.stop = threading.Event()

    def _descendants(self) -> list[int]:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        parent = {p: _parent(p) for p in pids}
        out: list[int] = []
        frontier = {self.root}
        while frontier:
            children = {p for p, pp in parent.items() if pp in frontier}
            out += children
            frontier = children
        return [self.root, *out]

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in self._descendants():
                hwm = _status(pid).get("VmHWM")
                if hwm:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(hwm.split()[0]))
                    title = _title(pid)
                    if title:
                        self.titles[pid] = title
            self.stop.wait(self.interval_s)


def run_recipe(model_dir: str, ranks: int, args, log: Path) -> tuple[dict, float, int, dict]:
    """One GRPO step through ``recipes.grpo`` on ``ranks`` colocated CPU ranks; (peaks KiB by title, wall s,
    return code, the step's weight-sync metrics)."""
    run_dir = tempfile.mkdtemp(prefix="bench_memory_run_")
    overrides = [
        f"model.path={model_dir}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.device=cpu",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=32",
        f"data.max_response_length={args.response_length}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        "actor.use_kl_loss=false",
        f"rollout.n={args.n}",
        *args.override,
    ]
    if args.placement == "disaggregated":
        overrides[1:2] = [
            f"trainer.n_gpus_per_node={ranks + 1}",
            "trainer.placement=disaggregated",
            "trainer.rollout_gpus_per_node=1",
            "trainer.cpu_oversubscribe=true",  # 3 worker processes on a 2-core machine
        ]
    cmd = [sys.executable, "-m", "recipes.grpo", *overrides]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        poller = PeakPoller(proc.pid)
        poller.start()
        rc = proc.wait()
        poller.stop.set()
        poller.join()
    wall = time.perf_counter() - t0
    peaks = {}
    for pid, kib in poller.peaks.items():
        title = poller.titles.get(pid, "?")
        peaks[f"{title} [{pid}]"] = kib
    sync = {}
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.read_text().strip():
        last = json.loads(metrics.read_text().strip().splitlines()[-1])
        sync = {k: last[k] for k in ("perf/weight_sync_bytes", "timing_s/update_weights") if k in last}
    return peaks, wall, rc, sync


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen2-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (= one mini-batch)")
    parser.add_argument("--placement", default="colocated", choices=["colocated", "disaggregated"])
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=8)
    parser.add_argument("--override", nargs="*", default=[], help="extra recipe overrides key=value")
    parser.add_argument("--name", default="bench_memory", help="JSON record: outputs/<name>.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    model_dir, config = make_model_dir(work / "model", args.preset)
    params = num_params(config)
    train_state = 16 * params  # fp32 params + grads + AdamW exp_avg, exp_avg_sq
    replica = 4 * params
    rows_per_rank = args.prompts * args.n
    tokens = rows_per_rank * (32 + args.response_length)  # upper bound: whole batch in one micro-batch
    act = activation_bytes(config, tokens, rows_per_rank * args.response_length)
    c = PRESETS[args.preset]
    gather = 3 * 4 * c["vocab_size"] * c["hidden_size"]
    print(f"{args.preset}: {params / 1e6:.1f}M params; train state {train_state / GIB:.2f} GiB, rollout replica "
          f"{replica / GIB:.2f} GiB, activations <= {act / GIB:.2f} GiB, FSDP gather <= {gather / GIB:.2f} GiB "
          "per rank")  # fmt: skip
    rows, records = [], []
    for ranks in args.ranks:
        load = os.getloadavg()[0]
        peaks, wall, rc, sync = run_recipe(model_dir, ranks, args, work / f"recipe_{ranks}.log")
        workers = {k: v for k, v in peaks.items() if k.startswith("ray::") and not k.startswith(RAY_OWN)}
        for title, kib in sorted(workers.items(), key=lambda kv: -kv[1]):
            rollout_only = args.placement == "disaggregated" and "rollout" in title.lower()
            train = 0.0 if rollout_only else train_state / ranks + act + (gather if ranks > 1 else 0)
            theory_gib = (train + (replica if rollout_only or args.placement == "colocated" else 0)) / GIB
            row = {
                "placement": args.placement,
                "ranks": ranks,
                "process": title.split(" [")[0][:40],
                "peak_rss_gib": kib / 2**20,
                "theory_gib": theory_gib,
                "train_state_share_gib": 0.0 if rollout_only else train_state / ranks / GIB,
                "over_theory_gib": kib / 2**20 - theory_gib,
                "wall_s": wall,
                "sync_bytes": sync.get("perf/weight_sync_bytes"),
                "sync_s": sync.get("timing_s/update_weights"),
                "load": load,
                "rc": rc,
            }
            rows.append(row)
        records.append(
            {"ranks": ranks, "rc": rc, "wall_s": wall, "load_1min": load, "peaks_kib": peaks, "sync": sync}
        )
        if rc != 0:
            print(f"recipe on {ranks} rank(s) exited {rc}; log: {work / f'recipe_{ranks}.log'}")
    print_table(
        rows,
        ["placement", "ranks", "process", "peak_rss_gib", "theory_gib", "train_state_share_gib", "over_theory_gib", "wall_s",
         "sync_bytes", "sync_s", "load", "rc"],
    )  # fmt: skip
    path = write_json(
        args.name,
        {
            "preset": args.preset,
            "params": params,
            "train_state_bytes": train_state,
            "rollout_replica_bytes": replica,
            "activation_bytes_estimate": act,
            "fsdp_gather_bytes_estimate": gather,
            "placement": args.placement,
            "rows": rows,
            "runs": records,
            "logs": str(work),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
