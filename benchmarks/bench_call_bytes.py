"""Bytes a worker-group call ships to its workers, per method, on one short run of the RLM recipe.

Runs ``recipes.rlm`` (tiny model, one GRPO step, S-NIAH contexts of ``--context-chars`` characters, the
recipe's default ``env.include_json=true``, the KL loss on so the reference log-probs are computed) and records,
for every group call, the size of each DataProto the controller ships for it (put into Ray's object store, or
sent inside the call: ``controller.dispatch.ship_chunk``), serialized as Ray does (cloudpickle protocol 5,
tensor/numpy buffers out of band, both counted). Per call: rows of the batch, bytes shipped per call (all
chunks) and per worker (the largest chunk), and the columns that travelled.

Run from the repository root: python -m benchmarks.bench_call_bytes [--context-chars 100000]
The same script run on an older checkout (a git worktree) gives the "before" numbers.
"""

import argparse
import contextlib
import itertools
import pickle
import tempfile

import ray

from benchmarks.common import print_table, write_json
from controller import RayWorkerGroup, dispatch
from dataproto import DataProto
from recipes import rlm

METHODS = ("compute_rm_score", "compute_log_prob", "compute_ref_log_prob", "update_actor")


def serialized_bytes(value) -> int:
    """Bytes of ``value`` serialized the way Ray serializes an object (pickle 5, out-of-band buffers)."""
    buffers: list[pickle.PickleBuffer] = []
    inband = ray.cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(memoryview(b.raw()).nbytes for b in buffers)


@contextlib.contextmanager
def recording_puts():
    """Record every DataProto shipped while a group call dispatches, by ``ray.put`` or inside the call: (call
    number, method, bytes, rows, columns)."""
    records: list[tuple[int, str, int, int, list[str]]] = []
    current: list[tuple[int, str]] = []  # the group calls under way: (call number, method)
    call_ids = itertools.count()
    real_put, real_ship, real_call = ray.put, dispatch.ship_chunk, RayWorkerGroup._call

    def record(value) -> None:
        if current and isinstance(value, DataProto):
            columns = sorted(value.batch) + sorted(value.non_tensor_batch)
            records.append((*current[-1], serialized_bytes(value), len(value), columns))

    def put(value, **kwargs):
        record(value)
        return real_put(value, **kwargs)

    def ship(chunk, by_value):
        if by_value:  # else ship_chunk puts it (recorded above)
            record(chunk)
        return real_ship(chunk, by_value)

    def call(self, gm, args, kwargs):
        current.append((next(call_ids), gm.name))
        try:
            return real_call(self, gm, args, kwargs)
        finally:
            current.pop()

    # patched while recording, restored below
    ray.put, dispatch.ship_chunk, RayWorkerGroup._call = put, ship, call  # type: ignore[method-assign]
    try:
        yield records
    finally:
        ray.put, dispatch.ship_chunk, RayWorkerGroup._call = real_put, real_ship, real_call  # type: ignore[method-assign]


def run_recipe(context_chars: int, out_dir: str) -> list:
    argv = [
        "model.tiny_size=nano",
        "task.n_train=8",
        "task.n_val=2",
        f"task.knobs.lengths={context_chars}",
        "data.val_max_samples=2",
        "data.val_batch_size=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.use_kl_loss=true",
        "rollout.n=2",
        "sft.enable=false",
        "env.agent.max_iterations=2",
        "env.agent.max_new_tokens=24",
        "trainer.total_training_steps=1",
        "trainer.progress_bar=false",
        "trainer.logger=[console]",
        "trainer.plot=false",
        f"trainer.default_local_dir={out_dir}",
    ]
    with recording_puts() as records:
        rlm.main(argv)
    return records


def summarize(records: list) -> list[dict]:
    """One row per call of the measured methods, in call order: rows, bytes shipped (all chunks), the largest chunk
    (what one worker received) and the columns that travelled."""
    calls: dict[int, list] = {}
    for call_id, name, size, n, columns in records:
        if name in METHODS:
            calls.setdefault(call_id, []).append((name, size, n, columns))
    return [
        {
            "method": chunks[0][0],
            "rows": sum(n for _, _, n, _ in chunks),
            "bytes_per_call": sum(b for _, b, _, _ in chunks),
            "bytes_per_worker": max(b for _, b, _, _ in chunks),
            "num_columns": len(chunks[0][3]),
            "columns": chunks[0][3],
        }
        for _, chunks in sorted(calls.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-chars", type=int, default=100_000)
    parser.add_argument(
        "--label", default="current", help="a name for this checkout in the JSON (before / after)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        rows = summarize(run_recipe(args.context_chars, out_dir))
    print(
        f"\nbytes shipped per group call, RLM recipe, 1 GRPO step, contexts of {args.context_chars} chars ({args.label})"
    )
    print_table(rows, ["method", "rows", "bytes_per_call", "bytes_per_worker", "num_columns"])
    path = write_json(
        f"bench_call_bytes_{args.label}",
        {
            "benchmark": "bytes per group call on the RLM recipe (serialized as Ray puts them)",
            "context_chars": args.context_chars,
            "label": args.label,
            "results": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
