"""What the machine is: package versions, the device, and the two hardware limits the other numbers are quoted
against (device-to-device copy bandwidth, dense bf16 matmul rate; on CPU: fp32 matmul, no bandwidth).

    python -m benchmarks.gpu_facts --out outputs/gpu_facts.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.bench_rollout import measure_bandwidth

PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "safetensors", "ray", "omegaconf", "megatron.core",
            "pyarrow", "pandas", "peft", "accelerate", "sglang")  # fmt: skip


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # missing, or broken by another package's version: say which
            out[name] = None if isinstance(e, ModuleNotFoundError) else f"import failed: {e}"
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, iters: int = 10) -> float:
    """Dense n x n x n products per second x 2 n^3, mean of ``iters`` after warm-up (random data)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/gpu_facts.json")
    args = p.parse_args(argv)
    facts: dict = {"versions": versions(), "cpus": os.cpu_count(), "machine": platform.machine()}
    if torch.cuda.is_available():
        device = torch.device("cuda")
        prop = torch.cuda.get_device_properties(0)
        facts["device"] = {
            "name": prop.name,
            "memory_gib": prop.total_memory / 2**30,
            "multiprocessors": prop.multi_processor_count,
            "capability": f"{prop.major}.{prop.minor}",
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
        try:
            facts["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            facts["nvidia_smi"] = f"failed: {e}"
        facts["copy_bandwidth_GBps"] = measure_bandwidth("cuda") / 1e9
        facts["bf16_matmul_TFLOPs"] = matmul_rate(device, 8192, torch.bfloat16) / 1e12
        facts["fp32_matmul_TFLOPs"] = matmul_rate(device, 4096, torch.float32) / 1e12
    else:
        facts["device"] = {
            "name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        }
        facts["fp32_matmul_TFLOPs"] = matmul_rate(torch.device("cpu"), 1024, torch.float32, iters=3) / 1e12
    print(json.dumps(facts, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
