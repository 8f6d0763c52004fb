"""torch.compile against eager: ``model.compile`` for the training step, ``rollout.compile`` for the native
engine's generation.

    python -m benchmarks.bench_compile [--size tiny] [--repeats 5] [--threads 1]

Both in one process, eager and compiled side by side on the same weights and the same work:

* ``train``: one GRPO-shaped update of the FSDP engine (``workers/engine``): ``--rows`` rows of a 20-token
  prompt and a 40-token response, packed forward, backward and AdamW step, with each decoder layer compiled
  (``fsdp_engine.compile_layers``) or not;
* ``generate``: the native engine (``workers/rollout/native``) generating ``--fixed-new`` tokens greedily for
  ``--batch`` prompts of 16-128 tokens, with its layer blocks compiled (``NativeCausalLM.compile_blocks``) or
  not; the compiled engine's tokens must equal the eager one's (``tokens_equal``).

Per side: the median seconds of a call after the first (the two sides' calls alternate), and the first call's
extra seconds over that median
(``compile_s``: tracing and code generation, paid once per process and shape family). ``speedup`` is eager /
compiled; ``break_even_calls`` is how many calls repay the compile time (none when compiled is not faster).
Prints a table and writes ``outputs/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import print_table, time_paired, write_json
from workers.engine import EngineConfig, FSDPEngine, OptimConfig
from workers.models.tiny import ensure_tiny_model
from workers.rollout.native import EngineConfig as NativeConfig
from workers.rollout.native import NativeEngine
from workers.rollout.sampling import SamplingParams


def grpo_batch(rows: int, vocab: int, prompt: int = 20, response: int = 40, seed: int = 0) -> dict:
    """Left-padded prompts and right-padded responses of varied lengths, with advantages: a GRPO batch's
    layout (dataproto/BATCH_LAYOUT.md)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(response // 4, response + 1, (rows,), generator=g)
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for i in range(rows):
        mask[i, prompt - p_len[i] : prompt + r_len[i]] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    response_mask = mask[:, prompt:].float()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": (ids * mask)[:, prompt:],
        "response_mask": response_mask,
        "advantages": torch.randn(rows, response, generator=g) * response_mask,
    }


def pg_loss(outputs, micro, ctx):
    """A policy-gradient loss of the batch's advantages (token mean): what an update differentiates."""
    mask = micro["response_mask"]
    return -(outputs["log_probs"] * micro["advantages"] * mask).sum() / ctx.global_num_tokens, {}


def timed_pair(eager, compiled, repeats: int) -> tuple[dict, dict]:
    """Each side's first call timed alone (the compiled side compiles there), then ``repeats`` calls of each,
    alternating (``benchmarks.common.time_paired``): the median of a call and the first call's seconds over it
    (``compile_s``)."""
    sides = {"eager": eager, "compiled": compiled}
    first = {}
    for name, fn in sides.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    stats = time_paired(sides, repeats, warmup=0)
    result = {
        name: {"median_s": s["median_s"], "compile_s": max(first[name] - s["median_s"], 0.0)}
        for name, s in stats.items()
    }
    return result["eager"], result["compiled"]


def train_call(model_dir: str, compile: bool, batch: dict):
    engine = FSDPEngine(
        EngineConfig(model_path=model_dir, compile=compile, optim=OptimConfig(lr=1e-5, grad_clip=1.0))
    )
    return lambda: engine.train_step(batch, pg_loss)


def generate_call(model_dir: str, compile: bool, prompts, new: int, out: list):
    """A call that generates for ``prompts`` and leaves each one's tokens in ``out``."""
    from transformers import AutoModelForCausalLM

    from workers.distributed import default_device

    # an nn.Module to mypy: transformers' @wraps-ed `to` does not type-check as a method
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(default_device()).eval()
    engine = NativeEngine(
        model,
        config=NativeConfig(
            max_num_seqs=len(prompts), max_model_len=128 + new + 1, eos_token_ids=[], compile=compile
        ),
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=new)

    def generate():
        out[:] = [o[0].token_ids for o in engine.generate_batch(prompts, params)]

    return generate


def row(work: str, eager: dict, compiled: dict, **extra) -> dict:
    gain = eager["median_s"] - compiled["median_s"]
    return {
        "work": work,
        "eager_s": eager["median_s"],
        "compiled_s": compiled["median_s"],
        "speedup": eager["median_s"] / compiled["median_s"],
        "compile_s": compiled["compile_s"],
        "break_even_calls": compiled["compile_s"] / gain if gain > 0 else None,
        **extra,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", help="workers/models/tiny.py preset")
    parser.add_argument("--rows", type=int, default=128, help="rows of the training batch (16 prompts x 8)")
    parser.add_argument("--batch", type=int, default=32, help="prompts generated at once")
    parser.add_argument("--fixed-new", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=11, help="calls of each side, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--work", nargs="+", default=["train", "generate"], choices=["train", "generate"])
    parser.add_argument("--name", default="bench_compile", help="JSON record: outputs/<name>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = ensure_tiny_model(args.size)
    vocab = 1024
    load_before, rows = os.getloadavg(), []
    if "train" in args.work:
        batch = grpo_batch(args.rows, vocab)
        eager, compiled = timed_pair(
            train_call(model_dir, False, batch), train_call(model_dir, True, batch), args.repeats
        )
        rows.append(row("train", eager, compiled, tokens_equal=None))
    if "generate" in args.work:
        g = torch.Generator().manual_seed(args.batch)
        prompts = [
            torch.randint(4, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(16, 129, (args.batch,), generator=g)
        ]
        eager_tokens: list = []
        compiled_tokens: list = []
        eager, compiled = timed_pair(
            generate_call(model_dir, False, prompts, args.fixed_new, eager_tokens),
            generate_call(model_dir, True, prompts, args.fixed_new, compiled_tokens),
            args.repeats,
        )
        rows.append(row("generate", eager, compiled, tokens_equal=eager_tokens == compiled_tokens))
    print(
        f"torch.compile against eager on the {args.size} model, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    )
    print_table(
        rows, ["work", "eager_s", "compiled_s", "speedup", "compile_s", "break_even_calls", "tokens_equal"]
    )
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    path = write_json(args.name, {"rows": rows, "args": vars(args), "load": load})
    print(f"wrote {path}")
    return {"rows": rows, "path": path}


if __name__ == "__main__":
    main()
