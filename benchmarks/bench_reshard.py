"""Training -> generation weight resharding (workers/weight_sync/reshard.py): HybridFlow's regrouped
(micro-DP) path against gathering the whole model, in the same run, at several layouts.

Ranks: ``--world`` spawned CPU processes joined by gloo (on a machine with that many GPUs: NCCL, one GPU
per rank). Model: a Qwen2-shaped HF state dict (``--hidden``, ``--layers``, ``--vocab``; fp32 by default)
of random tensors; each rank keeps only its training chunks. Contenders per layout:

* ``regrouped``: broadcasts inside micro-DP groups, streamed in ``--bucket-mb`` buckets;
* ``naive-full``: every rank gathers the whole model over its model-parallel group, then slices (no
  buckets: what "gather everything" costs in memory);
* ``naive-bucketed``: the same gather streamed in the same buckets (full tensors per bucket).

Columns (per rank; max over ranks unless said): MiB received (max and mean over ranks) / sent (logical
payload, see reshard.py), the HybridFlow paper's per-rank volume for the path (3D-HybridEngine ``(t*p - t_g)/(t_g*t*p) M``;
"HybridFlow-V" ``(t*p - 1)/(t*p) M``), peak transient MiB (counted exactly: the send and receive buffers
alive at once), CUDA peak allocation MiB when on GPU, and the median wall time over ``--repeats`` (slowest
rank; the three contenders alternate run by run). Every path is checked once per layout: each rank's
generation chunks equal slices of the full tensors.

Run: python -m benchmarks.bench_reshard [--world 4] [--hidden 512] [--layers 8] [--vocab 16384]
     [--bucket-mb 4] [--repeats 3]
Writes outputs/bench_reshard.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import print_table, write_json
from workers.distributed import free_port
from workers.weight_sync.reshard import Resharder, ReshardStats, paper_volume_bytes
from workers.weight_sync.reshard_plan import GenLayout, ReshardPlan, TrainLayout, hf_param_specs

MIB = 1 << 20

LAYOUTS = {
    4: [
        ((1, 4, 1), (4, 1)),
        ((1, 4, 1), (2, 2)),
        ((1, 4, 1), (1, 4)),
        ((2, 2, 1), (2, 2)),
        ((2, 2, 1), (1, 4)),
        ((1, 2, 2), (1, 4)),
    ],
    8: [
        ((1, 8, 1), (4, 2)),
        ((1, 8, 1), (2, 4)),
        ((2, 4, 1), (4, 2)),
        ((2, 4, 1), (2, 4)),
        ((2, 4, 1), (1, 8)),
        ((4, 2, 1), (2, 4)),
    ],
}


def qwen2_shapes(
    hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, inter: int
) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = hidden // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def _full_tensor(index: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=g).to(dtype)


def _check(got: dict, specs, plan, rank: int, dtype, what: str) -> None:
    """Every generation chunk equals the slice of the full tensor this rank needs."""
    bad = []
    for i, spec in enumerate(specs):
        need = plan.needed(rank, spec)
        ref = spec.chunk(_full_tensor(i, spec.shape, dtype), need.index, need.parts)
        if not torch.equal(got[spec.name].cpu(), ref):
            bad.append(spec.name)
    if bad:
        raise AssertionError(f"rank {rank} {what}: wrong shards {bad[:3]}")


def _rank_main(rank: int, world: int, args: dict, out_path: str) -> None:
    dtype = getattr(torch, args["dtype"])
    cuda = args["cuda"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    shapes = qwen2_shapes(
        args["hidden"], args["layers"], args["vocab"], args["heads"], args["kv_heads"], args["inter"]
    )
    named = [(n, s, dtype) for n, s in shapes]
    bucket = int(args["bucket_mb"] * MIB)
    rows = []
    for train, gen in LAYOUTS[world]:
        specs = hf_param_specs(named, args["layers"], train[0], args["heads"], args["kv_heads"])
        plan = ReshardPlan(specs, TrainLayout(*train), GenLayout(*gen))
        model_bytes = sum(s.nbytes for s in specs)
        # this rank's training chunks, cut from deterministic full tensors (the same on every rank)
        local = {}
        for i, spec in enumerate(specs):
            piece = plan.held(rank, spec)
            if piece is not None:
                full = _full_tensor(i, spec.shape, dtype)
                local[spec.name] = spec.chunk(full, piece.index, piece.parts).clone().to(device)
        contenders = [("regrouped", "regrouped", bucket), ("naive-full", "naive", None)]
        contenders.append(("naive-bucketed", "naive", bucket))
        resharders = {label: Resharder(plan, mode, device=device) for label, mode, _ in contenders}
        times: dict[str, list[float]] = {label: [] for label, _, _ in contenders}
        stats: dict[str, ReshardStats] = {}
        measured: dict[str, int] = {}
        # contenders alternate run by run so that machine noise hits all of them alike; run 0 of each is
        # the warm-up and the correctness check
        for rep in range(args["repeats"] + 1):
            for label, _, bucket_bytes in contenders:
                resharder = resharders[label]
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                got: dict[str, torch.Tensor] = {}
                for bucket_out in resharder.stream(local, bucket_bytes):
                    got.update(bucket_out)  # the generation shard is kept, as the rollout engine would
                run_stats = resharder.stats
                assert run_stats is not None  # stream() sets it
                if cuda:
                    torch.cuda.synchronize()
                    measured[label] = torch.cuda.max_memory_allocated() - base - run_stats.gen_shard_bytes
                elapsed = time.perf_counter() - t0
                if rep == 0:
                    _check(got, specs, plan, rank, dtype, f"{label} {train}->{gen}")
                else:
                    times[label].append(elapsed)
                stats[label] = run_stats
                del got
        for label, mode, _ in contenders:
            resharders[label].destroy()
            row = stats[label].as_dict()
            row.update(
                label=label,
                train=train,
                gen=gen,
                time_s=statistics.median(times[label]),
                measured_peak_bytes=measured.get(label),
                paper_bytes=paper_volume_bytes(model_bytes, plan, mode),
                model_bytes=model_bytes,
            )
            rows.append(row)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out_path)


def _spawn_entry(rank: int, world: int, port: int, args: dict, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    backend = "nccl" if args["cuda"] else "gloo"
    if args["cuda"]:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        _rank_main(rank, world, args, out_path)
    finally:
        dist.destroy_process_group()


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    out = []
    for i, first in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        (pp, tp, dp), (tp_g, dp_g) = first["train"], first["gen"]
        measured = [r["measured_peak_bytes"] for r in rows if r["measured_peak_bytes"] is not None]
        out.append(
            {
                "train pp,tp,dp": f"{pp},{tp},{dp}",
                "gen tp_g,dp_g": f"{tp_g},{dp_g}",
                "path": first["label"],
                "recv MiB": max(r["bytes_received"] for r in rows) / MIB,
                "recv MiB (mean)": sum(r["bytes_received"] for r in rows) / len(rows) / MIB,
                "sent MiB": max(r["bytes_sent"] for r in rows) / MIB,
                "paper MiB": first["paper_bytes"] / MIB,
                "peak transient MiB": max(r["peak_transient_bytes"] for r in rows) / MIB,
                "cuda peak MiB": max(measured) / MIB if measured else None,
                "time s": max(r["time_s"] for r in rows),
                "buckets": first["buckets"],
                "model MiB": first["model_bytes"] / MIB,
                "gen shard MiB": first["gen_shard_bytes"] / MIB,
            }
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4, choices=sorted(LAYOUTS))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are present")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    if cuda and torch.cuda.device_count() < a.world:
        print(f"{torch.cuda.device_count()} GPU(s) < world {a.world}: running on CPU over gloo")
        cuda = False
    args = dict(vars(a), cuda=cuda)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.pt")
        t0 = time.perf_counter()
        mp.start_processes(
            _spawn_entry,
            args=(a.world, free_port(), args, out_path),
            nprocs=a.world,
            join=True,
            start_method="spawn",
        )
        per_rank = torch.load(out_path, weights_only=False)
    table = summarize(per_rank)
    print(
        f"reshard: world {a.world} ({'nccl' if cuda else 'gloo, CPU'}), Qwen2 hidden {a.hidden} x {a.layers} "
        f"layers, vocab {a.vocab}, {a.dtype}, bucket {a.bucket_mb} MiB, median of {a.repeats} "
        f"({time.perf_counter() - t0:.0f}s total); all shards verified"
    )
    print_table(table, list(table[0]))
    path = write_json("bench_reshard", {"args": args, "table": table, "per_rank": per_rank})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
