"""The GPU check's steps, most valuable first, each a subprocess with its own time limit under one deadline.

    python -m benchmarks.gpu_check --out DIR        # on a CUDA machine (benchmarks/gpu_check.sh sets it up)
    python -m benchmarks.gpu_check --out DIR --cpu  # the rehearsal: the same steps at CPU sizes

After every step ``DIR/summary.json`` is rewritten (each step's command, status, seconds and its own JSON
record folded in) and its output appended to ``DIR/gpu_check.log``, so a run cut off at the machine's limit
still returns everything that finished. A step starts only when at least ``min_s`` of the deadline is left,
and is stopped at ``min(limit_s, time left)``; the statuses are ok, failed (rc), timeout, skipped (why).

Order (what a GPU can tell us that nothing here can, most valuable first):
  1. facts            versions, the device, copy bandwidth and bf16 matmul rate (what the rest is quoted against)
  2. engine_parity    FSDP2 over NCCL, fp32 and bf16: log-probs and one update against Hugging Face
  3. rollout_equal    native engine on CUDA, fp32, eager and with CUDA graphs: greedy tokens equal HF generate,
                      token for token
  4. rollout_decode   native engine, bf16, Qwen2-0.5B shape, batch 1..256, decode steps eager and replayed as CUDA
                      graphs with either attention form (--cuda-graphs off,on,on-sdpa; one call each beside one HF
                      run per row): decode tok/s against the HBM bound, the graphs' capture seconds and memory
  5. grpo_step        recipes.grpo colocated on one GPU at the 0.5B shape: stage times, tokens/s, the
                      update's MFU, peak memory per stage against workers/models/memory.py's estimate
  6. train_mfu        the engine's train step alone at 8 x 1024: packed attention by SDPA calls, FlexAttention and
                      varlen FlashAttention, against HF's SDPA with a block-diagonal mask and a padded HF step
  7. pytest_gpu       the GPU-marked tests (NCCL pool under Ray, FSDP offload, native engine on CUDA)
  8. megatron_parity  megatron-core on CUDA (TP = PP = 1, fp32: the Megatron engine has no mixed precision)
                      against Hugging Face on step 2's batch, beside the FSDP engine's fp32 row. (The first
                      H200 run ran the Megatron engine's tests instead, written for gloo ranks on the CPU: 14
                      passed, 12 failed mixing cuda:0 and cpu tensors or comparing fp32 Megatron with bf16 FSDP.)
  (after grpo_step) vocab_head  the chunked vocabulary head against the unfused log-probs + entropy at 16,384
                      tokens x 151,936, bf16: peak memory and time of forward + backward (benchmarks.bench_vocab_head)
  (after vocab_head) moe_replay  a 0.5B-active Qwen3-MoE (32 experts, top-4) and its dense twin, bf16 rollout on the
                      native engine (grouped expert matmuls on CUDA) against the FSDP trainer, with and without
                      rollout routing replay: route mismatch, log-prob difference, k3 KL (benchmarks.bench_moe_replay)
  (after moe_replay) lora  LoRA against full fine-tuning at the 0.5B shape: the training engine's peak memory,
                      adapter vs full sync bytes and time into the native engine on CUDA (benchmarks.bench_lora)
  9. compile          model.compile / rollout.compile against eager: the train step and the native engine's
                      generation, the compile time apart (benchmarks.bench_compile)
SGLang is not in the check: its CUDA kernels are hundreds of MB, over what a run may carry (64 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

SAME = ("same as on the GPU",)  # a Step's cpu argv when the rehearsal runs the step unchanged


@dataclass
class Step:
    name: str
    gpu: list[str] | None  # the interpreter's arguments on the GPU machine; None: not run there
    cpu: list[str] | tuple[str, ...] | None  # the rehearsal's (SAME: gpu's); None: skipped there (CUDA only)
    limit_s: float
    min_s: float = 20.0
    record: str | None = None  # the step's JSON record or pytest junit XML, folded into summary.json

    def argv(self, cpu: bool) -> list[str] | None:
        args = self.gpu if not cpu or self.cpu == SAME else self.cpu
        return None if args is None else [sys.executable, *args]


def steps() -> list[Step]:
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", "120"]
    gpu_tests = [
        "tests/controller/test_gpu.py",
        "tests/workers/engine/test_fsdp_engine.py",
        "tests/workers/engine/test_packed_kernels.py",
        "tests/workers/test_memory_estimate.py",
        "tests/workers/rollout/test_native_interfaces.py",
        "tests/workers/rollout/test_native_graphs.py",
    ]
    return [
        Step("facts", ["-m", "benchmarks.gpu_facts", "--out", "{work}/facts.json"], SAME, 60, 10,
             "{work}/facts.json"),
        Step("engine_parity", ["-m", "benchmarks.engine_parity", "--out", "{work}/parity.json"], SAME, 150, 40,
             "{work}/parity.json"),
        Step("rollout_equal",
             ["-m", "benchmarks.bench_rollout", "--model", "qwen2-0.5b", "--dtype", "float32",
              "--batch-sizes", "1,8", "--workloads", "mixed", "--repeats", "1", "--cuda-graphs", "off,on",
              "--out", "{work}/rollout_equal.json"],
             ["-m", "benchmarks.bench_rollout", "--model", "small", "--batch-sizes", "1,4",
              "--workloads", "mixed", "--repeats", "1", "--response-max", "24",
              "--out", "{work}/rollout_equal.json"],
             90, 30, "{work}/rollout_equal.json"),
        Step("rollout_decode",
             ["-m", "benchmarks.bench_rollout", "--model", "qwen2-0.5b", "--dtype", "bfloat16",
              "--batch-sizes", "1,8,32,64,128,256", "--workloads", "fixed", "--fixed-new", "128",
              "--repeats", "1", "--cuda-graphs", "off,on,on-sdpa", "--out", "{work}/rollout_decode.json"],
             ["-m", "benchmarks.bench_rollout", "--model", "small", "--batch-sizes", "1,8",
              "--workloads", "fixed", "--fixed-new", "16", "--repeats", "1", "--cuda-graphs", "off,eager,eager-sdpa",
              "--out", "{work}/rollout_decode.json"],
             200, 40, "{work}/rollout_decode.json"),  # one HF + one call per mode a row: was 2 + 2 at --repeats 2
        Step("grpo_step", ["-m", "benchmarks.bench_grpo_step", "--steps", "4", "--out", "{work}/grpo_step.json"],
             ["-m", "benchmarks.bench_grpo_step", "--preset", "tiny", "--steps", "2", "--out",
              "{work}/grpo_step.json"],
             240, 90, "{work}/grpo_step.json"),
        Step("vocab_head",
             ["-m", "benchmarks.bench_vocab_head", "--device", "cuda", "--dtype", "bfloat16", "--tokens", "16384",
              "--out", "{work}/vocab_head.json"],
             ["-m", "benchmarks.bench_vocab_head", "--tokens", "256", "--vocab", "32000", "--hidden", "256",
              "--out", "{work}/vocab_head.json"],
             90, 30, "{work}/vocab_head.json"),
        Step("moe_replay",
             ["-m", "benchmarks.bench_moe_replay", "--shape", "0.5b-active", "--device", "cuda",
              "--max-new-tokens", "128"],
             ["-m", "benchmarks.bench_moe_replay", "--prompts", "4", "--n", "2", "--max-new-tokens", "16"],
             150, 60, "outputs/bench_moe_replay.json"),
        Step("lora", ["-m", "benchmarks.bench_lora", "--shapes", "qwen2-0.5b"],
             ["-m", "benchmarks.bench_lora", "--shapes", "tiny"], 120, 40, "outputs/bench_lora.json"),
        Step("train_mfu", ["-m", "benchmarks.bench_train", "--steps", "3"],
             ["-m", "benchmarks.bench_train", "--steps", "1", "--batch", "2", "--seq", "64"],
             180, 40, "outputs/bench_train.json"),  # bench_train writes there (benchmarks.common.write_json)
        Step("pytest_gpu", [*pytest, "-m", "gpu", *gpu_tests, "--junitxml", "{work}/pytest_gpu.xml"], None,
             120, 30, "{work}/pytest_gpu.xml"),
        Step("megatron_parity",
             ["-m", "benchmarks.engine_parity", "--engines", "megatron", "--precisions", "fp32", "--out",
              "{work}/megatron_parity.json"], SAME, 120, 40, "{work}/megatron_parity.json"),
        Step("compile", ["-m", "benchmarks.bench_compile", "--size", "small", "--repeats", "3"],
             ["-m", "benchmarks.bench_compile", "--size", "nano", "--repeats", "1", "--rows", "8", "--batch", "4",
              "--fixed-new", "8"], 120, 50, "outputs/bench_compile.json"),
    ]  # fmt: skip


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:  # was an AttributeError on None: same failure, clearer message
        raise ValueError(f"{path}: no <testsuite> element")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed}


def run_step(step: Step, argv: list[str], work: Path, log, remaining: float) -> dict:
    argv = [a.replace("{work}", str(work)) for a in argv]
    limit = min(step.limit_s, remaining)
    entry: dict = {"step": step.name, "argv": argv[1:], "limit_s": round(limit)}
    log.write(f"\n===== {step.name} (limit {limit:.0f} s): {' '.join(argv[1:])}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        # its own session: a timeout kills the step's whole process tree (Ray, spawned ranks)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = proc.wait(timeout=limit)
        entry["status"] = "ok" if rc == 0 else "failed"
        entry["rc"] = rc
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        entry["status"] = "timeout"
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    log.write(f"===== {step.name}: {entry['status']} in {entry['seconds']} s\n")
    log.flush()
    record = Path(step.record.replace("{work}", str(work))) if step.record else None
    # written by this run (not an older run's file left in outputs/)
    if (
        record is not None
        and record.is_file()
        and record.stat().st_mtime >= time.time() - entry["seconds"] - 1
    ):
        entry["result"] = junit_counts(record) if record.suffix == ".xml" else json.loads(record.read_text())
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/gpu_check"))
    p.add_argument("--cpu", action="store_true", help="the rehearsal: CPU sizes, CUDA-only steps skipped")
    p.add_argument("--deadline-s", type=float, default=480.0, help="the whole check, setup excluded")
    p.add_argument("--only", default=None, help="comma-separated step names (default: all, in order)")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the steps' own records go elsewhere and are folded into summary.json: a run returns at most 8 files
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    chosen = steps()
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {s.name for s in chosen})
        if unknown:
            raise SystemExit(f"--only: unknown step(s) {unknown}; steps: {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in names]
    summary = {"mode": "cpu rehearsal" if args.cpu else "gpu", "deadline_s": args.deadline_s, "steps": []}
    start = time.perf_counter()
    with open(out / "gpu_check.log", "a") as log:
        for step in chosen:
            step_argv = step.argv(args.cpu)
            remaining = args.deadline_s - (time.perf_counter() - start)
            if step_argv is None:
                entry = {"step": step.name, "status": "skipped", "why": "CUDA only"}
            elif remaining < step.min_s:
                entry = {
                    "step": step.name,
                    "status": "skipped",
                    "why": f"{remaining:.0f} s left, needs {step.min_s:.0f}",
                }
            else:
                entry = run_step(step, step_argv, work, log, remaining)
            summary["steps"].append(entry)
            summary["elapsed_s"] = round(time.perf_counter() - start, 1)
            tmp = out / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1))
            tmp.replace(out / "summary.json")  # whole or not at all, even when the run is cut off here
            print(f"{step.name}: {entry['status']} {entry.get('seconds', '')}", flush=True)
    bad = [e["step"] for e in summary["steps"] if e["status"] in ("failed", "timeout")]
    print(f"summary: {out / 'summary.json'}; failed or timed out: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
