"""Native rollout engine vs Hugging Face ``generate`` on the same random-init Qwen2, in the same run.

    python -m benchmarks.bench_rollout [--batch-sizes 1,8,32,64] [--repeats 3] [--threads 1] [--cuda-graphs off,on]

Two workloads per batch size B, both greedy with EOS disabled (the model has no EOS id), B prompts with
lengths drawn uniformly from [16, 128] (fixed seeds):

* ``mixed`` (the headline): request i has its own response budget drawn from [16, 128]. The native
  engine stops each request at its budget and its slot is free at once; ``generate`` has no per-row
  budget, so HF generates the left-padded batch to the largest budget and each row is cut to its own.
  Both are credited with the same tokens: the sum of the budgets.
* ``fixed``: every request generates exactly ``--fixed-new`` tokens (64): no early finishers, so this
  isolates per-step efficiency (packed prefill, static KV cache, no per-step framework overhead).
* ``grouped`` (GRPO's shape, not in the default set): B / ``--group-size`` distinct prompts, each repeated
  ``--group-size`` times, every request ``--fixed-new`` tokens. The native engine prefills each distinct prompt
  once and copies its keys and values to the group's slots; ``generate`` computes every copy.

Throughput = credited tokens / wall time of the whole call (prefill included), best of ``--repeats``;
``cpu-time`` is the same ratio from process CPU time, steadier on a shared machine (both engines run
single-threaded on CPU by default, so the two agree on an idle one).
The outputs are checked against HF token for token (``rows_equal_hf``); ``prefill`` is the prompt tokens the
native engine computed per call (a shared prompt counts once).

On CUDA it also reports the native engine's decode-only tokens/s against the memory-bandwidth bound: per
decode step the weights and the KV entries attended must be read from HBM, so the bound time is
``(steps * weight bytes + KV positions attended * KV bytes per position) / bandwidth`` (bandwidth
measured with a device-to-device copy); the decode time it is divided by leaves out the graphs' capture.

``--cuda-graphs`` (default ``off,on`` on CUDA, ``off`` on CPU) builds one native engine per mode from the same
model and settings: ``off`` steps eagerly, ``on`` replays its decode steps as CUDA graphs
(``workers/rollout/native/graphs.py``), ``eager`` runs the same static, bucketed step uncaptured (it runs on the
CPU); ``on-sdpa`` / ``eager-sdpa`` give the static step's attention to torch's fused SDPA instead of three batched
kernels (``NativeCausalLM.static_attention``). Each row is one (workload, batch, mode): every mode of a (workload, batch) is measured beside the same HF
run, measured once. The warm-up runs every engine once (kernel selection, first launches); the graphs a row
captures are its own: ``graph_captures`` and ``graph_capture_s`` over the row's calls, ``native_s`` is the best
call's whole wall time (with ``--repeats 1``: the capture included), ``native_s_minus_capture`` the best call's
wall time less the seconds it spent capturing, ``native_first_s`` the first call's (which captures); on CUDA
``graph_memory_bytes`` is the graphs' memory pool after the row (``engine.stats["graph_memory_bytes"]``).

Prints a table and writes ``outputs/bench_rollout.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from typing import Any

import torch
import transformers

from benchmarks.common import QWEN2_0_5B_SHAPE
from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.sampling import SamplingParams

MODELS: dict[str, dict[str, Any]] = {  # Qwen2Config keyword arguments
    # ~1.3M parameters, the size of the project's own tiny model.
    "small": dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    # ~4.5M parameters: the CPU benchmark model.
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~0.8B parameters: large enough for decode to be memory-bound on a GPU.
    "medium": dict(vocab_size=32768, hidden_size=1536, intermediate_size=8960, num_hidden_layers=16,
                   num_attention_heads=12, num_key_value_heads=2),
    # Qwen2(.5)-0.5B's shape (494M parameters, 136M of them the tied embedding)
    "qwen2-0.5b": {k: v for k, v in QWEN2_0_5B_SHAPE.items()
                   if k not in ("max_position_embeddings", "tie_word_embeddings")},
}  # fmt: skip


def build_model(name: str, device: str, dtype: torch.dtype) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        **MODELS[name],
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=None,
        initializer_range=0.1,
    )
    with torch.device(device):  # a 0.5B init takes seconds on a GPU, a minute on the CPU
        model = transformers.Qwen2ForCausalLM(cfg)
        # in place (returns the model); seen as an nn.Module: transformers' @wraps-ed `to` is no method to mypy
        module: torch.nn.Module = model
        module.to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(batch: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(
    model, prompts: list[list[int]], new_tokens: int, device: str
) -> tuple[float, float, list[list[int]]]:
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, out[:, P:].tolist()


def native_generate(engine, prompts, budgets, device) -> tuple[float, float, list[list[int]]]:
    params = [SamplingParams(max_new_tokens=b, temperature=0.0, logprobs=True) for b in budgets]
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate_batch(prompts, params)
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, [o[0].token_ids for o in outs]


# on-sdpa / eager-sdpa: the static step's attention as torch's fused SDPA instead of three batched kernels
# (NativeCausalLM.static_attention): which form is faster on a GPU is what these rows tell
GRAPH_MODES = ("off", "on", "eager", "on-sdpa", "eager-sdpa")


def graph_modes(spec: str | None, on_gpu: bool) -> list[str]:
    """``--cuda-graphs``: the modes in the order given (default off,on on CUDA, off on CPU)."""
    modes = (spec or ("off,on" if on_gpu else "off")).split(",")
    unknown = [m for m in modes if m not in GRAPH_MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise SystemExit(f"--cuda-graphs: a comma list of distinct modes among {GRAPH_MODES}, got {spec!r}")
    if any(m.startswith("on") for m in modes) and not on_gpu:
        raise SystemExit("--cuda-graphs on needs a CUDA device; 'eager' runs the same static step on the CPU")
    return modes


def engine_config(mode: str, **kw) -> EngineConfig:
    """The EngineConfig of one ``--cuda-graphs`` mode."""
    if mode == "off":
        return EngineConfig(cuda_graphs=False, **kw)
    return EngineConfig(cuda_graphs=True, graph_replay="eager" if mode.startswith("eager") else "cuda", **kw)


def build_engine(model, mode: str, **kw) -> NativeEngine:
    engine = NativeEngine(model, config=engine_config(mode, **kw))
    if mode.endswith("-sdpa"):
        engine.model.static_attention = "sdpa"
    return engine


def best_of(fn, repeats: int):
    """(best wall time, best process CPU time, outputs) over ``repeats`` runs."""
    results = [fn() for _ in range(repeats)]
    return min(r[0] for r in results), min(r[1] for r in results), results[0][2]


def measure_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    iters = 20
    for _ in range(iters):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * iters / (time.perf_counter() - t0)


def measure_native(name, mode, engine, prompts, budgets, repeats, device, bandwidth, hf, on_gpu) -> dict:
    """One engine's row, beside the row's HF measurement ``hf`` (its best s, cpu_s and first call's out)."""
    B = len(prompts)
    credited = sum(budgets)
    calls = []  # (wall s, process CPU s, outputs, seconds spent capturing graphs)

    def one_call():
        capture0 = engine.stats["graph_capture_s"]
        wall, cpu, out = native_generate(engine, prompts, budgets, device)
        calls.append((wall, cpu, out, engine.stats["graph_capture_s"] - capture0))

    before = dict(engine.stats)
    for _ in range(repeats):
        one_call()
    total = {k: engine.stats[k] - before[k] for k in before}
    delta = {k: v / repeats for k, v in total.items()}
    nat_t, nat_cpu = min(c[0] for c in calls), min(c[1] for c in calls)
    nat_out = calls[0][2]
    same = sum(h[:b] == n for h, b, n in zip(hf["out"], budgets, nat_out))
    row = {
        "workload": name,
        "batch": B,
        "mode": mode,
        "tokens": credited,
        "hf_s": hf["s"],
        "native_s": nat_t,
        "hf_tok_s": credited / hf["s"],
        "native_tok_s": credited / nat_t,
        "speedup": hf["s"] / nat_t,
        "hf_cpu_s": hf["cpu_s"],
        "native_cpu_s": nat_cpu,
        "speedup_cpu_time": hf["cpu_s"] / nat_cpu,
        "rows_equal_hf": f"{same}/{B}",
        "native_decode_steps": delta["decode_steps"],
        "native_prefill_tokens": delta["prefill_tokens"],
        # prefill stays eager (SDPA over length groups; flash attention on CUDA): its share of a call says
        # whether a varlen prefill kernel would be worth having
        "native_prefill_s": delta["prefill_time_s"],
        "native_decode_s": delta["decode_time_s"],
    }
    if engine.graphs is not None:
        minus = min(c[0] - c[3] for c in calls)
        row.update(
            native_first_s=calls[0][0],
            native_s_minus_capture=minus,
            native_tok_s_minus_capture=credited / minus,
            graph_captures=total["graph_captures"],
            graph_capture_s=total["graph_capture_s"],
            graph_replays=total["graph_replays"],
            graphs_held=len(engine.graphs.captured),
        )
        if on_gpu:
            row["graph_memory_bytes"] = engine.stats["graph_memory_bytes"]
    decode_tokens = delta["generated_tokens"] - B  # each request's first token comes from its prefill
    decode_s = delta["decode_time_s"] - delta["graph_capture_s"]  # a capture is no decode step
    if decode_s > 0:
        row["native_decode_tok_s"] = decode_tokens / decode_s
    if bandwidth is not None and delta["decode_steps"]:
        read = (
            delta["decode_steps"] * engine.model.weight_bytes()
            + delta["decode_kv_tokens"] * engine.model.kv_bytes_per_token()
        )
        bound_s = read / bandwidth
        row.update(
            bandwidth_GBps=bandwidth / 1e9,
            decode_bytes_per_step=read / delta["decode_steps"],
            bound_decode_tok_s=decode_tokens / bound_s,
            fraction_of_bound=bound_s / decode_s,
        )
    return row


def run_workload(name, model, engines, prompts, budgets, repeats, device, bandwidth) -> list[dict]:
    """One row per engine (mode) of ``engines``, all beside one HF ``generate`` measurement."""
    on_gpu = device.startswith("cuda")
    hf_t, hf_cpu, hf_out = best_of(lambda: hf_generate(model, prompts, max(budgets), device), repeats)
    hf = {"s": hf_t, "cpu_s": hf_cpu, "out": hf_out}
    rows = []
    for mode, engine in engines.items():
        rows.append(
            measure_native(name, mode, engine, prompts, budgets, repeats, device, bandwidth, hf, on_gpu)
        )
    off = next((r for r in rows if r["mode"] == "off"), None)
    for r in rows:
        if off is not None and r is not off:
            r["speedup_vs_off"] = off["native_s"] / r["native_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--response-min", type=int, default=16)
    ap.add_argument("--response-max", type=int, default=128)
    ap.add_argument("--fixed-new", type=int, default=64)
    ap.add_argument("--workloads", default="mixed,fixed", help="of mixed, fixed, grouped")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt in the grouped workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (1: the CI box's 2 cores are shared, and a second OpenMP "
        "thread that is not scheduled stalls every parallel op)",
    )
    ap.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="default: tiny on CPU, medium on GPU"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU (float32 on GPU: token-for-token equality with HF)",
    )
    ap.add_argument(
        "--cuda-graphs",
        default=None,
        help="comma list of native engine modes among off, on, eager (default: off,on on CUDA, off on CPU): one "
        "engine per mode, each measured beside the same HF run",
    )
    ap.add_argument("--out", default="outputs/bench_rollout.json")
    args = ap.parse_args()

    device = args.device
    on_gpu = device.startswith("cuda")
    modes = graph_modes(args.cuda_graphs, on_gpu)
    if not on_gpu:
        torch.set_num_threads(args.threads)
    model_name = args.model or ("medium" if on_gpu else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    if on_gpu:  # float32 rows: no TF32, the same precision as HF's own float32 kernels
        torch.set_float32_matmul_precision("highest")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    vocab = MODELS[model_name]["vocab_size"]
    model = build_model(model_name, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    max_len = args.prompt_max + max(args.response_max, args.fixed_new) + 1
    engines = {
        mode: build_engine(
            model, mode, max_num_seqs=max(batch_sizes), max_model_len=max_len, eos_token_ids=[]
        )
        for mode in modes
    }
    bandwidth = measure_bandwidth(device) if on_gpu else None

    # Warm-up: first calls allocate caches and pick kernels (the graphs it captures are not any row's).
    warm = make_prompts(4, vocab, args.prompt_min, args.prompt_max, seed=123)
    hf_generate(model, warm, 8, device)
    for engine in engines.values():
        native_generate(engine, warm, [8] * 4, device)

    rows = []
    for B in batch_sizes:
        distinct = make_prompts(B, vocab, args.prompt_min, args.prompt_max, seed=B)
        rng = random.Random(1000 + B)
        for name in workloads:
            prompts = distinct
            if name == "mixed":
                budgets = [rng.randint(args.response_min, args.response_max) for _ in range(B)]
            elif name == "fixed":
                budgets = [args.fixed_new] * B
            elif name == "grouped":
                if B % args.group_size:
                    raise ValueError(f"--group-size {args.group_size} does not divide batch size {B}")
                prompts = [p for p in distinct[: B // args.group_size] for _ in range(args.group_size)]
                budgets = [args.fixed_new] * B
            else:
                raise ValueError(f"unknown workload {name!r} (mixed, fixed, grouped)")
            rows += run_workload(name, model, engines, prompts, budgets, args.repeats, device, bandwidth)

    title = (
        f"model: Qwen2 {model_name} ({n_params / 1e6:.2f}M params, {dtype}), device {device}, torch "
        f"{torch.__version__}, threads {torch.get_num_threads()}, prompts {args.prompt_min}-{args.prompt_max} "
        f"tokens, greedy, no EOS, best of {args.repeats}, native modes {','.join(modes)}"
    )
    print(title)
    graphs = any(m != "off" for m in modes)
    header = (
        f"{'workload':>8} {'batch':>5} {'mode':>5} {'tokens':>7} {'HF tok/s':>9} {'native tok/s':>12} "
        f"{'speedup':>8} {'cpu-time':>8} {'=HF':>6} {'prefill':>7}"
    )
    if on_gpu:
        header += f" {'decode tok/s':>12} {'bound tok/s':>12} {'of bound':>8}"
    if graphs:
        header += f" {'steps':>6} {'captures':>8} {'capture s':>9} {'tok/s -cap':>10}"
        if on_gpu:
            header += f" {'graph MiB':>9}"
    print(header)
    for r in rows:
        line = (
            f"{r['workload']:>8} {r['batch']:>5} {r['mode']:>5} {r['tokens']:>7} {r['hf_tok_s']:>9.0f} "
            f"{r['native_tok_s']:>12.0f} {r['speedup']:>7.2f}x {r['speedup_cpu_time']:>7.2f}x "
            f"{r['rows_equal_hf']:>6} {r['native_prefill_tokens']:>7.0f}"
        )
        if on_gpu:
            if "bound_decode_tok_s" in r:
                line += (
                    f" {r['native_decode_tok_s']:>12.0f} {r['bound_decode_tok_s']:>12.0f}"
                    f" {100 * r['fraction_of_bound']:>7.1f}%"
                )
            else:
                line += f" {'-':>12} {'-':>12} {'-':>8}"
        if graphs:
            line += f" {r['native_decode_steps']:>6.0f}"
            if "graph_captures" in r:
                line += (
                    f" {r['graph_captures']:>8} {r['graph_capture_s']:>9.3f}"
                    f" {r['native_tok_s_minus_capture']:>10.0f}"
                )
                if on_gpu:
                    line += f" {r['graph_memory_bytes'] / 2**20:>9.1f}"
            else:
                line += f" {'-':>8} {'-':>9} {'-':>10}" + (f" {'-':>9}" if on_gpu else "")
        print(line)
    result = {
        "title": title,
        "model": model_name,
        "model_config": MODELS[model_name],
        "params": n_params,
        "dtype": str(dtype),
        "device": device,
        "device_name": torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cuda_graphs": modes,
        "args": vars(args),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
