"""Log-probs and entropy of response tokens at a real vocabulary: the unfused path (``lm_head`` over every token,
fp32 ``log_softmax`` and entropy, kept for backward) against the chunked head (``workers/engine/vocab_head.py``),
forward + backward, each contender in a fresh process so that its peak resident memory is its own.

Shape by default: Qwen2-0.5B's head (hidden 896, vocabulary 151,936), 1,024 response tokens, fp32 (the CPU
engine's dtype), entropy on (as the actor's update). Peak on the CPU = the process's VmHWM after the step minus
before it; on CUDA = ``max_memory_allocated`` during the step minus what was allocated before it (inputs
allocated first in both, so the inputs count in neither).

    .venv/bin/python -m benchmarks.bench_vocab_head                      # writes outputs/bench_vocab_head.json
    .venv/bin/python -m benchmarks.bench_vocab_head --tokens 256 --vocab 32000 --hidden 256   # seconds
    python -m benchmarks.bench_vocab_head --device cuda --dtype bfloat16 --tokens 16384       # the GPU check's step
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import print_table, write_json

GIB = float(1 << 30)

CHILD = r"""
import json, sys, time
import torch
from workers.engine.packing import entropy_from_logits, log_probs_from_logits
from workers.engine.vocab_head import response_log_probs

path, n, h, v, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
device, dtype = torch.device(sys.argv[6]), getattr(torch, sys.argv[7])
torch.manual_seed(0)
hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_()
weight = (torch.randn(v, h, device=device, dtype=dtype) * 0.02).requires_grad_()
labels = torch.randint(v, (n,), device=device)


def hwm():
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024


if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()


def step():
    if path == "unfused":
        logits = torch.nn.functional.linear(hidden, weight).float() / t
        logp, ent = log_probs_from_logits(logits, labels), entropy_from_logits(logits)
    else:
        logp, ent = response_log_probs(hidden, weight, labels, t, with_entropy=True)
    (logp.sum() + 0.01 * ent.sum()).backward()
    return float(logp.sum())


before = hwm()
t0 = time.perf_counter()
value = step()
if device.type == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps({"peak_bytes": hwm() - before, "seconds": seconds, "sum_log_probs": value}))
"""


def run(path: str, args) -> dict:
    shape = [str(args.tokens), str(args.hidden), str(args.vocab), str(args.temperature)]
    argv = [sys.executable, "-c", CHILD, path, *shape, args.device, args.dtype]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="JSON record (default: outputs/bench_vocab_head.json)")
    args = parser.parse_args(argv)
    results = {path: run(path, args) for path in ("unfused", "chunked")}
    buffer = 4 * args.tokens * args.vocab
    rows = [
        {
            "path": path,
            "peak_gib": r["peak_bytes"] / GIB,
            "peak_in_fp32_tokens_x_vocab": r["peak_bytes"] / buffer,
            "seconds": r["seconds"],
        }
        for path, r in results.items()
    ]
    print(
        f"\n{args.tokens} tokens x vocabulary {args.vocab:,} (hidden {args.hidden}), forward + backward, with entropy"
    )
    print_table(rows, ["path", "peak_gib", "peak_in_fp32_tokens_x_vocab", "seconds"])
    same = abs(results["unfused"]["sum_log_probs"] - results["chunked"]["sum_log_probs"])
    record = {
        "benchmark": "vocabulary head: unfused vs chunked log-probs and entropy, forward + backward",
        "shape": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "temperature": args.temperature,
        },
        "fp32_tokens_x_vocab_bytes": buffer,
        "results": results,
        "peak_ratio": results["chunked"]["peak_bytes"] / max(results["unfused"]["peak_bytes"], 1),
        "time_ratio": results["chunked"]["seconds"] / results["unfused"]["seconds"],
        "sum_log_probs_abs_diff": same,
    }
    print(f"chunked / unfused: peak {record['peak_ratio']:.3f}x, time {record['time_ratio']:.2f}x; "
          f"sum of log-probs differs by {same:.2e}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out or write_json('bench_vocab_head', record)}")
    return record


if __name__ == "__main__":
    main()
