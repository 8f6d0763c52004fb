"""Training throughput and MFU of the FSDP2 engine (workers/engine) on a small random-init Qwen2.

CPU (default): a ~3.5M-parameter Qwen2 (hidden 256, 4 layers, vocab 2048), batch 8 x 256 (prompt 64 +
response 192, random lengths: about a quarter of the padded grid is padding). GPU (when CUDA is available):
a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads / 2 KV heads, vocab 151936), bf16 mixed
precision, batch 8 x 1024; ``--model-path`` points either run at a real checkpoint instead.

Contenders, one optimizer step each (forward + backward of a token-mean policy-gradient loss + AdamW):
  * engine/sdpa     the engine: padding removed, sequences packed (`hyflow_varlen`), each sequence (or a
                    padded group of short ones) its own SDPA call (``model.packed_attention=sdpa``, the CPU's
                    auto), log-probs only at response positions;
  * engine/flex     (CUDA) the same packing, one compiled FlexAttention call over the row's block mask
                    (``packed_attention=flex``, CUDA's auto);
  * engine/flash    (CUDA) the same packing, torch's varlen FlashAttention (``packed_attention=flash``);
  * engine/auto+checkpointing  the device's auto kernel with activation checkpointing (its cost in time; on
                    CUDA every contender's step_gib, what one step allocates above what is resident, shows
                    what it saves);
  * engine/hf-sdpa  the engine, packed, but HF's own packed attention (a dense block-diagonal mask: the
                    scores between different sequences are computed and discarded);
  * padded-hf       baseline: a plain HF forward on the padded [B, P+R] batch, logits everywhere.
and the forward-only `compute_log_prob` of the engine (its device's auto kernel). A contender whose first step
fails (a kernel the installed torch lacks) is reported with its error instead of a time.

Model FLOPs per step (what MFU counts; the same useful work for every contender):
    6 * N_layers * T            dense matmuls of the decoder layers over the T real tokens
  + 6 * V * d * T_resp          lm_head at the T_resp positions that predict response tokens
  + 12 * L * d * sum_i S_i^2    attention scores and weighted sum (PaLM/verl convention, full S x S,
                                i.e. causal masking not discounted)
with N_layers the matmul parameters of the L decoder layers, d the hidden size (= heads x head_dim), V the
vocabulary and S_i the real length of sequence i. Forward-only: one third of that. MFU = model FLOPs /
step time / peak, where the peak on CPU is a dense fp32 matmul measured in this run (best of several
2048^2 products on the threads torch uses); on GPU a bf16 matmul measured the same way.

Run: python -m benchmarks.bench_train [--steps 5] [--batch 8] [--seq 256] [--threads 1] [--model-path DIR]
Writes outputs/bench_train.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.common import QWEN2_0_5B_SHAPE, print_table, time_paired, write_json
from workers import distributed as du
from workers.engine import EngineConfig, FSDPEngine, OptimConfig

CPU_MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
GPU_MODEL = QWEN2_0_5B_SHAPE


# ----------------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------------


def layer_matmul_params(cfg) -> int:
    d = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q = d * cfg.num_attention_heads * hd
    kv = 2 * d * cfg.num_key_value_heads * hd
    o = cfg.num_attention_heads * hd * d
    mlp = 3 * d * cfg.intermediate_size
    return cfg.num_hidden_layers * (q + kv + o + mlp)


def train_flops(cfg, seq_lens: Sequence[float], resp_tokens: int) -> float:
    tokens = sum(seq_lens)
    d = cfg.hidden_size
    dense = 6 * layer_matmul_params(cfg) * tokens
    head = 6 * cfg.vocab_size * d * resp_tokens
    attn = 12 * cfg.num_hidden_layers * d * sum(s * s for s in seq_lens)
    return float(dense + head + attn)


def measure_peak(
    device: torch.device, n: int | None = None, repeats: int = 5, dtype: torch.dtype | None = None
) -> float:
    """Best dense matmul FLOP/s (default: fp32 on CPU at 2048^2, bf16 on CUDA at 8192^2: at 2048 an H200 measured
    275 TFLOP/s against 805 at 8192, which made every MFU quoted against it 2.9x too high)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ b).sum().item()
        dt = time.perf_counter() - t
        best = max(best, 2 * n**3 / dt)
    return best


# ----------------------------------------------------------------------------------------------------------------
# data and loss
# ----------------------------------------------------------------------------------------------------------------


def make_batch(b: int, prompt: int, resp: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(b, prompt, dtype=torch.long)
    responses = torch.zeros(b, resp, dtype=torch.long)
    pm = torch.zeros(b, prompt, dtype=torch.long)
    rm = torch.zeros(b, resp, dtype=torch.long)
    for i in range(b):
        pl = int(torch.randint(prompt // 2, prompt + 1, (1,), generator=g))
        rl = int(torch.randint(resp // 2, resp + 1, (1,), generator=g))
        prompts[i, prompt - pl :] = torch.randint(3, vocab, (pl,), generator=g)
        responses[i, :rl] = torch.randint(3, vocab, (rl,), generator=g)
        pm[i, prompt - pl :] = 1
        rm[i, :rl] = 1
    am = torch.cat([pm, rm], 1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": am,
        "position_ids": (am.cumsum(1) - 1).clamp(min=0),
        "response_mask": rm.float(),
        "advantages": torch.randn(b, resp, generator=g) * rm,
        "old_log_probs": torch.zeros(b, resp),
    }


def pg_loss(outputs, micro, ctx):
    mask = micro["response_mask"]
    ratio = torch.exp(outputs["log_probs"] - micro["old_log_probs"])
    return (-micro["advantages"] * ratio * mask).sum() / ctx.global_num_tokens


# ----------------------------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------------------------


def build_model_dir(overrides: dict, tmp: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**overrides)).save_pretrained(tmp)
    return tmp


def padded_step_fn(model_path: str, batch: dict, device: torch.device, lr: float):
    """Baseline: HF forward/backward on the padded batch, logits at every position, AdamW step."""
    from transformers import AutoModelForCausalLM

    # an nn.Module to mypy: transformers' @wraps-ed `to` does not type-check as a method
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa")
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dev = {k: v.to(device) for k, v in batch.items()}
    r = dev["responses"].shape[1]
    ntok = dev["response_mask"].sum()
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def step():
        with amp:
            logits = model(
                dev["input_ids"], attention_mask=dev["attention_mask"], position_ids=dev["position_ids"]
            ).logits
        lp = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1).gather(-1, dev["responses"][..., None])[
            ..., 0
        ]
        loss = (-dev["advantages"] * torch.exp(lp - dev["old_log_probs"]) * dev["response_mask"]).sum() / ntok
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def flex_score_visits(lengths: list[int]) -> dict:
    """The scores FlexAttention's block mask visits for the packed row of ``lengths`` (partial and full 128 x 128
    blocks), against the causal scores that exist (sum of S(S+1)/2) and those a padded batch computes (B x L^2):
    what the flex kernel's work is, told without a GPU."""
    from workers.models.packed_kernels import FLEX_BLOCK, packed_block_mask

    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    mask = packed_block_mask(bounds, (), None, "cpu")
    visited = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) * FLEX_BLOCK**2
    causal = sum(n * (n + 1) // 2 for n in lengths)
    return {
        "visited_scores": visited,
        "causal_scores": causal,
        "visited_over_causal": visited / causal,
        "padded_batch_scores": len(lengths) * max(lengths) ** 2,
    }


def run(args) -> dict:
    device = du.default_device()
    gpu = device.type == "cuda"
    batch_rows = args.batch or 8
    seq = args.seq or (1024 if gpu else 256)
    prompt = seq // 4
    resp = seq - prompt
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or build_model_dir(GPU_MODEL if gpu else CPU_MODEL, tmp)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
        batch = make_batch(batch_rows, prompt, resp, cfg.vocab_size)
        seq_lens = batch["attention_mask"].sum(1).tolist()
        resp_tokens = int(batch["attention_mask"][:, -resp:].sum())
        flops = train_flops(cfg, seq_lens, resp_tokens)
        optim = OptimConfig(lr=1e-5, grad_clip=1.0)
        kernels = ["sdpa", "flex", "flash"] if gpu else ["sdpa"]
        configs = {
            f"engine/{k}": EngineConfig(model_path=model_path, optim=optim, packed_attention=k)
            for k in kernels
        }
        # the device's auto kernel with activation checkpointing: its time against its memory
        configs["engine/auto+checkpointing"] = EngineConfig(
            model_path=model_path, optim=optim, activation_checkpointing=True
        )
        configs["engine/hf-sdpa"] = EngineConfig(
            model_path=model_path, optim=optim, attn_implementation="sdpa"
        )
        contenders: dict[str, Callable[[], object]] = {}
        failed: dict[str, str] = {}
        # CUDA: what one step allocates above what is resident before it (every engine here stays resident)
        step_gib: dict[str, float] = {}
        for name, config in configs.items():
            try:
                engine = FSDPEngine(config)
                step = functools.partial(engine.train_step, batch, pg_loss, max_token_len=args.max_token_len)
                step()  # compiles what the kernel compiles; a kernel this torch lacks fails here
                if gpu:
                    torch.cuda.reset_peak_memory_stats()
                    resident = torch.cuda.memory_allocated()
                    step()
                    step_gib[name] = (torch.cuda.max_memory_allocated() - resident) / 2**30
            except Exception as e:  # noqa: BLE001 -- reported in the table and the JSON, the others still timed
                failed[name] = f"{type(e).__name__}: {e}"[:300]
                continue
            contenders[name] = step
        auto = FSDPEngine(EngineConfig(model_path=model_path, optim=None))
        n_params = auto.num_params
        contenders["padded-hf"] = padded_step_fn(model_path, batch, device, 1e-5)
        contenders[f"engine/log_prob (fwd, {auto.packed_attention})"] = lambda: auto.compute_log_prob(
            batch, max_token_len=args.max_token_len
        )
        peak = measure_peak(device)
        times = time_paired(contenders, repeats=args.steps, warmup=2)
        peak = max(peak, measure_peak(device))
    total_grid = batch["attention_mask"].numel()
    rows = []
    for name, t in times.items():
        fwd_only = "fwd" in name
        f = flops / 3 if fwd_only else flops
        sec = t["median_s"]
        rows.append(
            {
                "contender": name,
                "step_s": sec,
                "tokens/s": sum(seq_lens) / sec,
                "TFLOP/s": f / sec / 1e12,
                "MFU": f / sec / peak,
                **({"step_gib": step_gib[name]} if name in step_gib else {}),
            }
        )
    rows += [{"contender": name, "error": error} for name, error in failed.items()]
    flex_visits = flex_score_visits([int(n) for n in seq_lens])
    return {
        "device": str(device) if not gpu else torch.cuda.get_device_name(0),
        "threads": torch.get_num_threads(),
        "params": n_params,
        "batch": f"{batch_rows}x{seq} (prompt {prompt} + response {resp})",
        "real_tokens": sum(seq_lens),
        "padded_grid_tokens": total_grid,
        "response_tokens": resp_tokens,
        "model_flops_per_step": flops,
        "peak_flops_measured": peak,
        "flops_formula": "6*N_layers*T + 6*V*d*T_resp + 12*L*d*sum(S_i^2); forward-only /3",
        "flex_score_visits": flex_visits,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=None, help="rows (default 8)")
    p.add_argument("--seq", type=int, default=None, help="prompt+response length (default 256 CPU, 1024 GPU)")
    p.add_argument(
        "--max-token-len", type=int, default=None, help="token budget per micro-batch (default: all)"
    )
    p.add_argument("--model-path", default=None, help="a local HF checkpoint instead of the random model")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared 2-core box two OpenMP threads thrash; the matmul "
        "peak is measured with the same count)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    if args.max_token_len is None:
        args.max_token_len = (args.batch or 8) * (args.seq or 4096)
    result = run(args)
    print(
        f"{result['device']} ({result['threads']} threads), {result['params'] / 1e6:.2f}M params, batch "
        f"{result['batch']}: {result['real_tokens']} real of {result['padded_grid_tokens']} padded tokens; "
        f"peak {result['peak_flops_measured'] / 1e9:.1f} GFLOP/s (measured matmul)"
    )
    print_table(result["rows"], ["contender", "step_s", "tokens/s", "TFLOP/s", "MFU", "step_gib", "error"])
    print(f"model FLOPs: {result['flops_formula']}")
    visits = result["flex_score_visits"]
    print(
        f"flex block mask: visits {visits['visited_scores']:,} scores for {visits['causal_scores']:,} causal ones "
        f"({visits['visited_over_causal']:.2f}x); a padded batch computes {visits['padded_batch_scores']:,}"
    )
    path = write_json("bench_train", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
