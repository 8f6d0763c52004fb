"""LoRA against full fine-tuning on one process: weight-sync bytes and time into the native engine, the engine's
memory for the adapter, and the training step (CPU).

For each model shape (the tiny model's, and a random-init Qwen2-0.5B-shaped directory: no download), one
FSDPEngine trains the full model and one trains rank-``--rank`` all-linear adapters (the same seeded init);
after one optimizer step each streams what a weight sync sends (full: every weight, the adapter merged in for
LoRA's merged fallback; LoRA: the adapter alone) into a NativeEngine built from the same directory
(``update_weights`` / ``load_adapter``), timed end to end. The step is one GRPO-shaped update of ``--rows``
sequences of ``--tokens`` tokens.

    .venv/bin/python -m benchmarks.bench_lora                    # tiny + 0.5B shape (minutes)
    .venv/bin/python -m benchmarks.bench_lora --shapes tiny      # seconds

Peak memory with the reference counted runs the real recipe: ``benchmarks.bench_memory`` with
``--override actor.use_kl_loss=true`` against ``--override actor.use_kl_loss=true actor.lora.rank=16``.
Writes ``outputs/bench_lora.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_memory import make_model_dir
from benchmarks.common import print_table, write_json


def _batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    resp = tokens // 2
    ids = torch.randint(3, vocab, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "responses": ids[:, -resp:],
        "response_mask": torch.ones(rows, resp),
        "advantages": torch.randn(rows, resp, generator=g),
        "old_log_probs": torch.full((rows, resp), -5.0),
    }


def _loss(outputs, micro, ctx):
    ratio = torch.exp(outputs["log_probs"] - micro["old_log_probs"])
    return (-micro["advantages"] * ratio * micro["response_mask"]).sum() / ctx.global_num_tokens


def measure(model_dir: str, vocab: int, lora_rank: int | None, args) -> dict:
    from workers.distributed import default_device
    from workers.engine import EngineConfig, FSDPEngine, LoRAConfig, OptimConfig
    from workers.models.loading import load_model
    from workers.rollout.native import EngineConfig as RolloutConfig
    from workers.rollout.native import NativeEngine

    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    device = default_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    eng = FSDPEngine(EngineConfig(model_path=model_dir, optim=OptimConfig(lr=1e-4), lora=lora))
    trainable = sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
    batch = _batch(args.rows, args.tokens, vocab)
    eng.train_step(batch, _loss)  # warm-up: the optimizer state exists from here on
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.train_step(batch, _loss)
    step_s = (time.perf_counter() - t0) / args.steps
    peak_train = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    assert eng.optimizer is not None  # built from the OptimConfig above
    optim_bytes = sum(
        t.numel() * t.element_size() for s in eng.optimizer.state.values() for t in s.values() if t.dim()
    )
    rollout = NativeEngine(
        load_model(model_dir, attn_implementation=None),
        config=RolloutConfig(max_num_seqs=2, max_model_len=64, device=str(device)),
    )
    syncs = []
    for _ in range(args.syncs):
        t0 = time.perf_counter()
        if lora is None:
            stream = list(eng.full_state_dict_iter())
            nbytes = sum(t.numel() * t.element_size() for _, t in stream)
            rollout.update_weights(stream)
        else:
            stream = list(eng.adapter_state_iter())
            nbytes = sum(t.numel() * t.element_size() for _, t in stream)
            rollout.load_adapter(stream, scaling=lora.alpha / lora.rank)
        syncs.append(time.perf_counter() - t0)
    base_copy = sum(t.numel() * t.element_size() for t in getattr(rollout, "_adapter_base", {}).values())
    result = {
        "trainable_params": trainable,
        "total_params": eng.num_params,
        "optimizer_state_gib": optim_bytes / 2**30,
        "step_s": step_s,
        "sync_bytes": nbytes,
        "sync_s": min(syncs),
        "engine_base_copy_gib": base_copy / 2**30,
        "peak_train_gib": peak_train,  # CUDA only: the training engine's peak after its steps
    }
    del eng, rollout
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["tiny", "qwen2-0.5b"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--name", default="bench_lora", help="JSON record: outputs/<name>.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    rows = []
    for shape in args.shapes:
        model_dir, config = make_model_dir(work / shape, shape)
        load = os.getloadavg()[0]
        full = measure(model_dir, config.vocab_size, None, args)
        lora = measure(model_dir, config.vocab_size, args.rank, args)
        for name, r in (("full", full), (f"lora r{args.rank}", lora)):
            rows.append({"shape": shape, "train": name, **r, "load": load})
        rows.append(
            {
                "shape": shape,
                "train": "lora / full",
                "trainable_params": lora["trainable_params"] / full["trainable_params"],
                "sync_bytes": lora["sync_bytes"] / full["sync_bytes"],
                "sync_s": lora["sync_s"] / full["sync_s"],
                "step_s": lora["step_s"] / full["step_s"],
                "optimizer_state_gib": lora["optimizer_state_gib"] / full["optimizer_state_gib"],
                "peak_train_gib": lora["peak_train_gib"] / full["peak_train_gib"]
                if full["peak_train_gib"]
                else None,
            }
        )
    columns = ["shape", "train", "trainable_params", "total_params", "sync_bytes", "sync_s", "step_s",
               "optimizer_state_gib", "engine_base_copy_gib", "peak_train_gib", "load"]  # fmt: skip
    print_table(rows, columns)
    path = write_json(args.name, {"rank": args.rank, "rows": rows, "args": vars(args)})
    print(f"wrote {path}")
    return {"rows": rows, "path": path}


if __name__ == "__main__":
    main()
