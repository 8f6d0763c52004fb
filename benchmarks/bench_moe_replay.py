"""Rollout-vs-trainer mismatch of a mixture of experts, with and without rollout routing replay (R3).

The native engine samples in ``--rollout-dtype`` (bf16 by default, as a GPU rollout runs) and records every
position's experts; the FSDP engine recomputes the sampled tokens' log-probs in fp32 (the CPU trainer's dtype),
once with its own routers and once replaying the rollout's routes. The dense model of the same size, through
the same two engines, is the baseline: the mismatch that precision alone causes. Reported per arm: the share of
(token, layer) pairs whose experts differ between the rollout and the trainer's own routers, the mean and max
|log p_rollout - log p_trainer| of the sampled tokens, and the k3 estimate of KL(rollout, trainer).

    .venv/bin/python -m benchmarks.bench_moe_replay                 # tiny MoE, writes outputs/bench_moe_replay.json
    .venv/bin/python -m benchmarks.bench_moe_replay --size nano --prompts 8
    # trained models (e.g. the quickstart's export with model.tiny_arch=moe and without):
    .venv/bin/python -m benchmarks.bench_moe_replay --moe-model runs/quickstart_moe/hf_model \
        --dense-model runs/quickstart/hf_model
    # the GPU check's step: a Qwen3-MoE of 0.5B active parameters (Qwen2-0.5B's attention and, per token, its MLP
    # width: 4 of 32 experts of 1,216) against a dense Qwen3 of the same shape, random init, on CUDA, where the
    # trainer computes in bf16 (mixed precision) as the rollout does
    .venv/bin/python -m benchmarks.bench_moe_replay --shape 0.5b-active --device cuda --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3MoeConfig

from benchmarks.common import QWEN2_0_5B_SHAPE, print_table, write_json
from workers.engine import EngineConfig, FSDPEngine
from workers.engine.moe import route_mismatch
from workers.models.loading import load_model
from workers.models.meta_init import write_random_init_model
from workers.models.tiny import ensure_tiny_model
from workers.rollout.batch import build_rollout_batch, rows_from_outputs
from workers.rollout.native import EngineConfig as RolloutConfig
from workers.rollout.native import NativeEngine
from workers.rollout.sampling import SamplingParams


def prompts_of(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Arithmetic questions in the quickstart's phrasing, as chat prompts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a, b, c = (int(x) for x in torch.randint(1, 10, (3,), generator=g))
        messages = [{"role": "user", "content": f"Compute {a}+{b}*{c}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def mismatch(batch: dict, log_probs: torch.Tensor, routes: torch.Tensor | None) -> dict:
    mask = batch["response_mask"].bool()
    log_ratio = (log_probs - batch["rollout_log_probs"])[mask]
    out = {
        "logprob_diff_mean": float(log_ratio.abs().mean()),
        "logprob_diff_max": float(log_ratio.abs().max()),
        "k3_kl": float((log_ratio.exp() - 1 - log_ratio).mean()),
    }
    if routes is not None:
        rollout = batch["routed_experts"]
        ran = rollout[..., 0, 0] >= 0  # positions the rollout engine ran (its routes) and the trainer routed
        out["route_mismatch"] = route_mismatch(routes[ran].long(), rollout[ran].long())["moe/route_mismatch"]
    return out


# Qwen2-0.5B's attention; the MoE's MLP per token is 4 experts x 1,216 = the dense model's 4,864
SHAPE_0_5B: dict[str, Any] = {k: v for k, v in QWEN2_0_5B_SHAPE.items() if k != "intermediate_size"}
SHAPE_0_5B.update(
    head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6
)
MOE_0_5B_ACTIVE: dict[str, Any] = dict(
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=1216, norm_topk_prob=True
)


def shaped_model(arch: str, out: str, seed: int) -> str:
    """A random-init folder of the 0.5B-active MoE (``arch="moe"``) or the dense Qwen3 of the same shape, with the
    tiny model's tokenizer (Qwen's vocabulary)."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny"))
    ids: dict[str, Any] = dict(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if arch == "moe":
        config = Qwen3MoeConfig(**SHAPE_0_5B, **MOE_0_5B_ACTIVE, intermediate_size=4864, **ids)
    else:
        config = Qwen3Config(**SHAPE_0_5B, intermediate_size=4864, **ids)
    return write_random_init_model(f"{out}/{arch}", config, seed=seed, tokenizer=tokenizer)


def run_arch(arch: str, args, scratch: str) -> list[dict]:
    given = args.moe_model if arch == "moe" else args.dense_model
    if given:
        path = given
    elif args.shape == "0.5b-active":
        path = shaped_model(arch, scratch, args.seed)
    else:
        path = ensure_tiny_model(args.size, seed=args.seed, arch=arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path, dtype=args.rollout_dtype, device=args.device)
    engine = NativeEngine(
        model, tokenizer, RolloutConfig(max_num_seqs=args.prompts * args.n, max_model_len=256, seed=args.seed)
    )
    prompts = prompts_of(tokenizer, args.prompts, args.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed)
    t0 = time.perf_counter()
    outs = [o for group in engine.generate_batch(prompts, params) for o in group]
    gen_s = time.perf_counter() - t0
    rows = [p for p in prompts for _ in range(args.n)]
    batch = build_rollout_batch(rows_from_outputs(rows, outs), pad_token_id=tokenizer.pad_token_id)
    trainer = FSDPEngine(EngineConfig(model_path=path, optim=None))
    arms = [("own routers", None)] + ([("replay rollout (R3)", "routed_experts")] if arch == "moe" else [])
    results = []
    for name, replay in arms:
        out = trainer.compute_log_prob(batch, max_token_len=8192, replay_routes=replay)  # None: the default
        default = f"{args.shape if args.shape != 'tiny' else 'tiny-' + args.size} {arch} (random init)"
        row = {"model": given or default, "trainer routes": name}
        row.update(mismatch(batch, out["log_probs"], out.get("routes")))
        row["tokens"] = int(batch["response_mask"].sum())
        row["generate_s"] = round(gen_s, 2)
        results.append(row)
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rollout-dtype", default="bfloat16")
    ap.add_argument(
        "--moe-model", help="a mixture-of-experts model folder (default: the tiny MoE, random init)"
    )
    ap.add_argument("--dense-model", help="the dense baseline's folder (default: the tiny dense model)")
    ap.add_argument(
        "--shape",
        choices=["tiny", "0.5b-active"],
        default="tiny",
        help="the random-init models: the tiny ones (--size), or a 0.5B-active MoE and its dense twin",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="moe_replay_") as scratch:
        rows = run_arch("dense", args, scratch) + run_arch("moe", args, scratch)
    columns = [
        "model",
        "trainer routes",
        "route_mismatch",
        "logprob_diff_mean",
        "logprob_diff_max",
        "k3_kl",
        "tokens",
    ]
    print_table(rows, columns)
    path = write_json(
        "bench_moe_replay",
        {
            "command": "python -m benchmarks.bench_moe_replay " + " ".join(argv or []),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "rollout_dtype": args.rollout_dtype,
            # the FSDP engine computes in bf16 on CUDA (mixed precision, fp32 parameters), in fp32 on the CPU
            "trainer_dtype": "bfloat16 compute" if args.device.startswith("cuda") else "float32",
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
