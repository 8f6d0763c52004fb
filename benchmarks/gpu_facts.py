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
from pathlib import Path

import torch

from benchmarks.bench_rollout import measure_bandwidth
from benchmarks.bench_train import measure_peak

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
        facts["bf16_matmul_TFLOPs"] = measure_peak(device) / 1e12
        facts["fp32_matmul_TFLOPs"] = measure_peak(device, n=4096, dtype=torch.float32) / 1e12
    else:
        facts["device"] = {
            "name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        }
        facts["fp32_matmul_TFLOPs"] = measure_peak(torch.device("cpu"), n=1024, repeats=3) / 1e12
    print(json.dumps(facts, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
