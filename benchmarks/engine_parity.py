"""The training engines against plain Hugging Face on the same batch: log-probs and one optimizer step.

    python -m benchmarks.engine_parity                  # CUDA: Qwen2-0.5B shape, NCCL, fp32 and bf16
    python -m benchmarks.engine_parity --model small    # CPU (or a quick GPU run): a ~1M-parameter Qwen2, gloo
    python -m benchmarks.engine_parity --engines megatron --precisions fp32   # megatron-core, TP = PP = 1

The FSDP engine runs as FSDP2 (``fully_shard``) on a one-rank process group (NCCL on CUDA, gloo on CPU), in fp32
and with bf16 mixed precision (FSDP's MixedPrecisionPolicy: bf16 compute, fp32 parameters and reductions); the
Megatron engine (``--engines megatron``) at TP = PP = 1 in fp32 only (it has no mixed precision). The
reference is a Hugging Face ``Qwen2ForCausalLM`` in fp32 on the padded batch (SDPA attention, TF32 off): its
response log-probs, and one step of the same token-mean policy-gradient loss with gradient clipping and
``torch.optim.AdamW``. Per precision the check reports

  * log-prob difference to the fp32 reference (max and mean over response tokens), and for bf16 the same
    for Hugging Face's own bf16 autocast forward: the error bf16 costs anyway, the yardstick for ours;
  * the pre-clip gradient norm of both, and the weight update (after - before) of both: relative L2
    distance and cosine over every parameter.

Pass: fp32 log-probs within ``--fp32-tol`` and the update within 1% (relative distance); bf16 log-probs no
further from fp32 than 2x Hugging Face's own bf16 error (+1e-3), update cosine above 0.9.
Prints a table, writes ``--out`` (default outputs/engine_parity.json) and exits 1 when a row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# left-padded prompts, right-padded responses of random lengths; token-mean policy gradient, ratio to old_log_probs
from benchmarks.bench_train import make_batch, pg_loss
from benchmarks.common import QWEN2_0_5B_SHAPE, machine_info, print_table, update_distance

MODELS = {
    "small": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True),
    "qwen2-0.5b": QWEN2_0_5B_SHAPE,
}  # fmt: skip
LR = 1e-4


def make_model_dir(shape: dict, device: torch.device, out: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with device:  # a 0.5B init is seconds on the GPU, a minute on the CPU
        model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0))
    model.save_pretrained(out)
    return out


def hf_log_probs(model, batch: dict, device, autocast: bool) -> torch.Tensor:
    """Response log-probs of the padded batch, fp32, zeros at response padding."""
    r = batch["responses"].shape[1]
    dev = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(
            dev["input_ids"], attention_mask=dev["attention_mask"], position_ids=dev["position_ids"]
        ).logits
    lp = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1)
    return lp.gather(-1, dev["responses"][..., None])[..., 0] * dev["response_mask"]


def hf_reference(model_dir: str, batch: dict, device) -> dict:
    """fp32 log-probs, bf16-autocast log-probs, one clipped AdamW step: grad norm and the update per name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model = model.to(device)
    with torch.no_grad():
        model.eval()
        lp32 = hf_log_probs(model, batch, device, autocast=False).cpu()
        lp16 = hf_log_probs(model, batch, device, autocast=True).cpu()
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    lp = hf_log_probs(model, batch, device, autocast=False)
    mask = batch["response_mask"].to(device)
    old = lp32.to(device)
    loss = (-batch["advantages"].to(device) * torch.exp(lp - old) * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    update = {n: (p.detach() - before[n]).cpu() for n, p in model.named_parameters()}
    del model, opt, before
    return {"lp32": lp32, "lp16": lp16, "grad_norm": grad_norm, "update": update}


def engine_run(model_dir: str, batch: dict, kind: str, mixed_precision: bool) -> dict:
    """One engine of ``kind`` (fsdp: FSDP2 on the one-rank group; megatron: megatron-core at TP = PP = 1):
    log-probs of the batch, then one update; the update per parameter name (Hugging Face's names)."""
    from workers.engine import EngineConfig, FSDPEngine, OptimConfig

    cfg = EngineConfig(
        model_path=model_dir,
        use_fsdp=True,
        mixed_precision=mixed_precision,
        optim=OptimConfig(lr=LR, weight_decay=0.0, grad_clip=1.0),
    )
    if kind == "megatron":
        from workers.engine.megatron.engine import MegatronEngine

        engine = MegatronEngine(cfg)
    else:
        engine = FSDPEngine(cfg)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    lp = engine.compute_log_prob(batch)["log_probs"]
    sync()
    t_fwd = time.perf_counter() - t0
    before = {n: t.detach().float().cpu().clone() for n, t in engine.full_state_dict_iter()}
    t0 = time.perf_counter()
    m = engine.train_step(batch, pg_loss)
    sync()
    t_step = time.perf_counter() - t0
    update = {n: t.detach().float().cpu() - before[n] for n, t in engine.full_state_dict_iter()}
    if kind == "megatron":
        assert isinstance(engine, MegatronEngine)
        engine.destroy()  # megatron's parallel state is global: the next engine starts from none
    del engine
    return {"lp": lp, "grad_norm": float(m["grad_norm"]), "update": update, "fwd_s": t_fwd, "step_s": t_step}


def compare_updates(ours: dict, theirs: dict) -> dict:
    missing = sorted(set(theirs) - set(ours))
    if missing:
        raise KeyError(f"the engine's state dict lacks {missing[:5]} (of {len(missing)})")
    d = update_distance((name, ours[name], d_theirs) for name, d_theirs in theirs.items())
    return {"update_rel_dist": d["relative_distance"], "update_cosine": d["cosine"]}


def lp_errors(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    d = (lp - ref).abs() * mask
    return float(d.max()), float(d.sum() / mask.sum())


def main(argv: list[str] | None = None) -> int:
    from workers import distributed as du

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="default: qwen2-0.5b on CUDA, else small"
    )
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=None, help="prompt length (default 64 CUDA, 16 CPU)")
    p.add_argument("--response", type=int, default=None, help="response length (default 192 CUDA, 16 CPU)")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--engines", default="fsdp", help="fsdp, megatron (TP = PP = 1) or both, comma-separated")
    p.add_argument(
        "--fp32-tol", type=float, default=None, help="max |log-prob diff| (default 2e-3 CUDA, 1e-4 CPU)"
    )
    p.add_argument("--out", default="outputs/engine_parity.json")
    args = p.parse_args(argv)

    torch.set_float32_matmul_precision("highest")  # no TF32: the fp32 rows compare fp32 with fp32
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(du.free_port())
    du.init_distributed()  # nccl on CUDA, gloo on CPU
    device = du.default_device()
    gpu = device.type == "cuda"
    name = args.model or ("qwen2-0.5b" if gpu else "small")
    prompt, resp = args.prompt or (64 if gpu else 16), args.response or (192 if gpu else 16)
    fp32_tol = args.fp32_tol or (2e-3 if gpu else 1e-4)
    batch = make_batch(args.rows, prompt, resp, MODELS[name]["vocab_size"])
    mask = batch["response_mask"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(MODELS[name], device, tmp)
        ref = hf_reference(model_dir, batch, device)
        batch["old_log_probs"] = ref["lp32"]
        hf16_max, hf16_mean = lp_errors(ref["lp16"], ref["lp32"], mask)
        for kind, precision in [(k, p) for k in args.engines.split(",") for p in args.precisions.split(",")]:
            if kind == "megatron" and precision == "bf16":
                # MegatronEngine computes in its parameter dtype: no bf16 mixed precision to compare (on CUDA
                # the FSDP engine's default is bf16 mixed precision, so the two strategies train differently)
                rows.append(
                    {"engine": kind, "precision": precision, "pass": None, "skipped": "no mixed precision"}
                )
                continue
            ours = engine_run(model_dir, batch, kind, mixed_precision=precision == "bf16")
            lp_max, lp_mean = lp_errors(ours["lp"], ref["lp32"], mask)
            row = {
                "engine": kind,
                "precision": precision,
                "lp_max_abs": lp_max,
                "lp_mean_abs": lp_mean,
                "hf_bf16_lp_mean_abs": hf16_mean if precision == "bf16" else None,
                "grad_norm_hf": ref["grad_norm"],
                "grad_norm_engine": ours["grad_norm"],
                "grad_norm_rel_diff": abs(ours["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
                **compare_updates(ours["update"], ref["update"]),
                "engine_fwd_s": ours["fwd_s"],
                "engine_step_s": ours["step_s"],
            }
            if precision == "fp32":
                row["pass"] = lp_max <= fp32_tol and row["update_rel_dist"] <= 0.01
            else:
                row["pass"] = lp_mean <= 2 * hf16_mean + 1e-3 and row["update_cosine"] >= 0.9
            rows.append(row)
            if gpu:
                torch.cuda.empty_cache()
    print(f"{name} on {torch.cuda.get_device_name(0) if gpu else 'cpu'} ({args.rows}x{prompt}+{resp}), "
          f"{args.engines} on one {'nccl' if gpu else 'gloo'} rank vs HF fp32; HF bf16 autocast: max {hf16_max:.3g}, "
          f"mean {hf16_mean:.3g}")  # fmt: skip
    print_table(rows, ["engine", "precision", "lp_max_abs", "lp_mean_abs", "hf_bf16_lp_mean_abs", "grad_norm_rel_diff",
                       "update_rel_dist", "update_cosine", "engine_step_s", "pass"])  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": machine_info(),
        "model": name,
        "shape": MODELS[name],
        "batch": {"rows": args.rows, "prompt": prompt, "response": resp},
        "fp32_tol": fp32_tol,
        "hf_bf16_lp_max_abs": hf16_max,
        "hf_bf16_lp_mean_abs": hf16_mean,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    torch.distributed.destroy_process_group()
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
