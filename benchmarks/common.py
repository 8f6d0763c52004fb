"""Small helpers shared by the benchmarks: timing, a printed table, and a JSON record."""

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

OUTPUT_DIR = "outputs"

# Qwen2-0.5B's shape (config.json of Qwen/Qwen2-0.5B; Qwen2.5-0.5B has the same): the benchmarks' real-size model
QWEN2_0_5B_SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 2) -> dict:
    """Median and p90 wall time of ``fn`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return _summary(samples)


def time_paired(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, dict]:
    """Like time_calls for several contenders, alternating them call by call so that machine noise
    (other processes on a shared 2-core box) hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: _summary(s) for name, s in samples.items()}


def _summary(samples: list[float]) -> dict:
    samples = sorted(samples)
    return {
        "median_s": statistics.median(samples),
        "p90_s": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "repeats": len(samples),
    }


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


# the CPU features that decide which kernels torch runs (vector width, bf16 / AMX matmuls)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu_info() -> dict:
    """The CPU's model name and which of ``CPU_FLAGS`` it has (``/proc/cpuinfo``, as ``lscpu`` reports them)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:  # not Linux
        pass
    return {"cpu_model": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def machine_info() -> dict:
    return {
        **cpu_info(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(name: str, payload: dict) -> str:
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    path = os.path.join(OUTPUT_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), **payload}, f, indent=2)
    return path


def update_distance(deltas: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> dict:
    """How far our weight update is from a reference's, over ``(name, ours, theirs)`` updates (after - before):
    both norms, relative L2 distance (to theirs; inf when theirs is zero), largest element difference, cosine."""
    dot = ours_sq = theirs_sq = dist_sq = largest = 0.0
    for _, ours, theirs in deltas:
        ours, theirs = ours.double(), theirs.double()
        dot += float((ours * theirs).sum())
        ours_sq, theirs_sq = ours_sq + float(ours.pow(2).sum()), theirs_sq + float(theirs.pow(2).sum())
        dist_sq += float((ours - theirs).pow(2).sum())
        largest = max(largest, float((ours - theirs).abs().max()))
    return {
        "update_norm_ours": math.sqrt(ours_sq),
        "update_norm_theirs": math.sqrt(theirs_sq),
        "relative_distance": math.sqrt(dist_sq / theirs_sq) if theirs_sq else math.inf,
        "max_abs_difference": largest,
        "cosine": dot / math.sqrt(ours_sq * theirs_sq) if ours_sq and theirs_sq else 0.0,
    }
