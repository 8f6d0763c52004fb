"""Size a colocated run on a GPU from the memory model (workers/models/memory.py): every term of one rank's memory
in GiB for both stages, and the largest micro-batch token budget (``actor.ppo_max_token_len_per_gpu``) that fits
the device with a safety margin, or which term is too big. No GPU and no download: the model is built on the meta
device from a config.

    python -m benchmarks.size_run --model qwen2.5-7b --devices 8 --gib 80
    python -m benchmarks.size_run --model /path/to/hf_dir --devices 8 --gib 80 --no-reference --activation-checkpointing
    python -m benchmarks.size_run --docs        # the table of docs/sizing.md (tests/workers/test_memory_estimate.py
                                                # recomputes it and compares it with the page)

``--model``: a preset (below) or a Hugging Face directory / config.json. Writes ``--out`` (default
outputs/size_run.json). Presets are transformers config objects built from the fields of each model's published
config.json listed here (nothing is downloaded): only the fields that change the memory are given; the rest are
transformers' defaults.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
import transformers

from benchmarks.common import QWEN2_0_5B_SHAPE, print_table
from workers.models.memory import (
    GIB,
    MARGIN,
    TOKEN_STEP,
    RunSettings,
    Sizing,
    min_devices,
    param_counts,
    size_colocated_run,
)

PRESETS = {
    # Qwen/Qwen2.5-7B config.json: hidden_size 3584, intermediate_size 18944, num_hidden_layers 28,
    # num_attention_heads 28, num_key_value_heads 4, vocab_size 152064, tie_word_embeddings false
    "qwen2.5-7b": lambda: transformers.Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768,
    # intermediate_size 6144 (unused: no dense layer), decoder_sparse_step 1, mlp_only_layers [],
    # vocab_size 151936, tie_word_embeddings false
    "qwen3-30b-a3b": lambda: transformers.Qwen3MoeConfig.from_dict(
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        )  # head_dim is not among the typed fields of transformers' Qwen3MoeConfig: it is passed as a dict
    ),
    # the GPU check's shape (benchmarks/common.py), where the model was measured
    "qwen2-0.5b": lambda: transformers.Qwen2Config.from_dict(QWEN2_0_5B_SHAPE),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# docs/sizing.md's table: (preset, settings) per row; 8 x 80 GB, model.dtype float32 (the default), bf16 compute
# and rollout, 1024-token prompts + 3072-token responses (64 KV slots x 4096 tokens unless the row says)
DOCS_GIB = 80.0
DOCS_BASE = RunSettings(devices=8, max_num_seqs=64, prompt_length=1024, response_length=3072)
DOCS_ROWS: list[tuple[str, RunSettings]] = [
    ("qwen2.5-7b", replace(DOCS_BASE, reference=ref, activation_checkpointing=ac))
    for ref in (True, False)
    for ac in (False, True)
] + [
    ("qwen3-30b-a3b", replace(DOCS_BASE, reference=ref, activation_checkpointing=True, max_num_seqs=seqs))
    for seqs in (64, 16)
    for ref in (True, False)
] + [
    ("qwen3-30b-a3b", replace(DOCS_BASE, reference=False, activation_checkpointing=False, max_num_seqs=16)),
    ("qwen3-30b-a3b", replace(DOCS_BASE, reference=False, activation_checkpointing=True, max_num_seqs=16,
                              param_dtype=torch.bfloat16)),
]  # fmt: skip
DOCS_COLUMNS = [
    "model", "model.dtype", "reference", "activation ckpt", "KV slots", "train state", "fsdp gather",
    "reference GiB", "rollout weights", "KV cache", "decode graphs", "activations", "gen", "update_actor",
    "ppo_max_token_len_per_gpu", "fewest devices",
]  # fmt: skip


def load_config(model: str):
    """A preset's config, or the one a Hugging Face directory (or its config.json) holds."""
    if model in PRESETS:
        return PRESETS[model]()
    path = Path(model)
    if path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"--model {model!r}: neither a preset ({', '.join(PRESETS)}) nor a directory with config.json"
        )
    return transformers.AutoConfig.from_pretrained(path)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def docs_row(preset: str, settings: RunSettings, counts=None) -> dict[str, str]:
    """One row of the docs table as the page prints it (GiB to one decimal)."""
    config = PRESETS[preset]()
    counts = counts or param_counts(config)
    sizing = size_colocated_run(config, DOCS_GIB, settings, counts=counts)
    fewest = min_devices(config, DOCS_GIB, settings, counts=counts)
    e = sizing.estimate
    return dict(
        zip(
            DOCS_COLUMNS,
            [
                preset, str(settings.param_dtype).removeprefix("torch."), _yes(settings.reference),
                _yes(settings.activation_checkpointing), f"{settings.max_num_seqs} x {settings.max_model_len}",
                *(f"{b / GIB:.1f}" for b in (e.train_state, e.fsdp_gather, e.reference, e.rollout_weights,
                                             e.kv_cache, e.decode_graphs, e.activations, e.gen,
                                             e.update_actor)),
                f"{sizing.max_token_len:,}" if sizing.fits else "does not fit",
                str(fewest) if fewest is not None else "none",
            ],
            strict=True,
        )
    )  # fmt: skip


def docs_table() -> str:
    """docs/sizing.md's table in markdown."""
    counts = {p: param_counts(PRESETS[p]()) for p in {p for p, _ in DOCS_ROWS}}
    rows = [docs_row(p, s, counts[p]) for p, s in DOCS_ROWS]
    lines = ["| " + " | ".join(DOCS_COLUMNS) + " |", "|" + "---|" * len(DOCS_COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in DOCS_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def report(sizing: Sizing, model: str, fewest: int | None) -> None:
    s, e = sizing.settings, sizing.estimate.gib()
    print(
        f"{model}: {e['params'] / 1e9:.2f}B params; {s.devices} x {sizing.gib:g} GiB, colocated (FSDP world "
        f"{s.devices}); model.dtype {s.to_dict()['param_dtype']}, compute {s.to_dict()['compute_dtype']}, rollout "
        f"{s.to_dict()['rollout_dtype']}; reference {_yes(s.reference)}; activation checkpointing "
        f"{_yes(s.activation_checkpointing)}; KV {s.max_num_seqs} slots x {s.max_model_len} "
        f"({s.prompt_length} prompt + {s.response_length} response); rollout tp {s.rollout_tp}; decode CUDA "
        f"graphs {_yes(s.cuda_graphs)}"
    )
    rows = [{"term": k, "GiB": v} for k, v in e.items() if k not in ("params", "gen", "update_actor")]
    rows += [
        {"term": "gen (stage)", "GiB": e["gen"]},
        {"term": "update_actor (stage)", "GiB": e["update_actor"]},
    ]
    print_table(rows, ["term", "GiB"])
    print(f"usable: {sizing.limit_bytes / GIB:.1f} GiB ({sizing.margin:.0%} kept for fragmentation, the CUDA context "
          "and temporaries)")  # fmt: skip
    if sizing.fits:
        print(f"largest micro-batch: actor.ppo_max_token_len_per_gpu={sizing.max_token_len} (multiple of "
              f"{sizing.step}; the terms above are at it)")  # fmt: skip
    else:
        print(f"does not fit: {sizing.reason}; the terms above are at one sequence")
    print(
        f"fewest {sizing.gib:g} GiB devices at these settings: {fewest if fewest is not None else 'none up to 1024'}"
    )
    if s.rollout_tp > 1:
        print("note: the code allows rollout.tensor_model_parallel_size > 1 only with actor.strategy=megatron, "
              "whose train state the train-state and gather terms (FSDP's) do not describe")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="qwen2.5-7b", help=f"a preset ({', '.join(PRESETS)}) or an HF directory"
    )
    p.add_argument("--devices", type=int, default=8, help="GPUs in the run (the FSDP world, all colocated)")
    p.add_argument("--gib", type=float, default=80.0, help="memory of one device in GiB")
    p.add_argument("--margin", type=float, default=MARGIN, help="fraction of the device kept free")
    p.add_argument("--step", type=int, default=TOKEN_STEP, help="the token budget is a multiple of this")
    p.add_argument("--param-dtype", choices=DTYPES, default="float32", help="model.dtype")
    p.add_argument(
        "--compute-dtype", choices=DTYPES, default="bfloat16", help="bfloat16: mixed precision (CUDA)"
    )
    p.add_argument(
        "--rollout-dtype", choices=DTYPES, default="bfloat16", help="rollout.dtype (auto: bf16 on CUDA)"
    )
    p.add_argument(
        "--reference", action=argparse.BooleanOptionalAction, default=True, help="actor.use_kl_loss"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="model.activation_checkpointing")
    p.add_argument("--max-num-seqs", type=int, default=64, help="rollout.max_num_seqs (KV slots)")
    p.add_argument("--prompt-length", type=int, default=1024, help="data.max_prompt_length")
    p.add_argument("--response-length", type=int, default=3072, help="data.max_response_length")
    p.add_argument("--rollout-tp", type=int, default=1, help="rollout.tensor_model_parallel_size")
    p.add_argument("--keep-cache", action="store_true", help="rollout.free_cache_engine=false")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rollout.cuda_graphs (auto: on with CUDA; the term is 0 under rollout tp > 1 or for a MoE)",
    )
    p.add_argument("--docs", action="store_true", help="print docs/sizing.md's table and exit")
    p.add_argument("--out", default="outputs/size_run.json")
    args = p.parse_args(argv)
    if args.docs:
        print(docs_table())
        return 0
    config = load_config(args.model)
    settings = RunSettings(
        devices=args.devices,
        param_dtype=DTYPES[args.param_dtype],
        compute_dtype=DTYPES[args.compute_dtype],
        rollout_dtype=DTYPES[args.rollout_dtype],
        reference=args.reference,
        max_num_seqs=args.max_num_seqs,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        activation_checkpointing=args.activation_checkpointing,
        rollout_tp=args.rollout_tp,
        free_cache_engine=not args.keep_cache,
        cuda_graphs=args.cuda_graphs,
    )
    counts = param_counts(config)
    sizing = size_colocated_run(config, args.gib, settings, margin=args.margin, step=args.step, counts=counts)
    fewest = min_devices(config, args.gib, settings, margin=args.margin, step=args.step, counts=counts)
    report(sizing, args.model, fewest)
    record = {
        "model": args.model,
        **sizing.to_dict(),
        "fewest_devices": fewest,
        "param_counts": asdict(counts),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
