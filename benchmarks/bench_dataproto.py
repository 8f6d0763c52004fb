"""DataProto transfer through Ray against pickling the same tensors with torch.save.

Batch: 256 x 4096 int64 + 256 x 4096 float32 (12 MiB). Two measurements, each for DataProto and for
the baseline (a dict of tensors serialised with torch.save into bytes, then ray.put):
  * put + get on the driver;
  * a 4-way dispatch: chunk into 4, put each chunk once, 4 actors each fetch their chunk and return
    it, the driver gets the 4 results and concatenates them.

Run: python -m benchmarks.bench_dataproto
"""

import io

import ray
import torch

from benchmarks.common import print_table, time_paired, write_json
from dataproto import DataProto

ROWS, COLS, WORKERS, REPEATS = 256, 4096, 4, 40


def to_bytes(tensors: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob))


@ray.remote(num_cpus=1)
class Echo:
    def proto(self, chunk: DataProto) -> DataProto:
        return chunk

    def pickled(self, blob: bytes) -> bytes:
        return to_bytes(from_bytes(blob))


def main() -> None:
    ray.init(num_cpus=WORKERS, include_dashboard=False, configure_logging=False)
    tensors = {
        "input_ids": torch.randint(0, 32000, (ROWS, COLS), dtype=torch.int64),
        "log_probs": torch.randn(ROWS, COLS, dtype=torch.float32),
    }
    data = DataProto.from_dict(tensors)
    # ray.remote made Echo an actor class; mypy keeps a decorated class's own type
    workers = [Echo.remote() for _ in range(WORKERS)]  # type: ignore[attr-defined]
    ray.get([w.proto.remote(data.slice(0, 1)) for w in workers])

    def proto_put_get():
        ray.get(ray.put(data))

    def pickle_put_get():
        from_bytes(ray.get(ray.put(to_bytes(tensors))))

    def proto_dispatch():
        refs = [ray.put(c) for c in data.chunk(WORKERS)]
        DataProto.concat(ray.get([w.proto.remote(r) for w, r in zip(workers, refs)]))

    def pickle_dispatch():
        refs = [
            ray.put(to_bytes({k: v.chunk(WORKERS)[i] for k, v in tensors.items()})) for i in range(WORKERS)
        ]
        parts = [from_bytes(b) for b in ray.get([w.pickled.remote(r) for w, r in zip(workers, refs)])]
        {k: torch.cat([p[k] for p in parts]) for k in tensors}

    results = []
    for op, proto_fn, pickle_fn in [
        ("put+get", proto_put_get, pickle_put_get),
        ("4-way chunk/dispatch/concat", proto_dispatch, pickle_dispatch),
    ]:
        timed = time_paired({"proto": proto_fn, "pickle": pickle_fn}, REPEATS)
        proto, base = timed["proto"], timed["pickle"]
        results.append(
            {
                "operation": op,
                "dataproto_ms": proto["median_s"] * 1e3,
                "torch_save_ms": base["median_s"] * 1e3,
                "speedup": base["median_s"] / proto["median_s"],
            }
        )
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    print(
        f"DataProto vs torch.save pickling, batch {ROWS}x{COLS} int64 + float32 ({mib:.0f} MiB), median of {REPEATS}"
    )
    print_table(results, ["operation", "dataproto_ms", "torch_save_ms", "speedup"])
    print("wrote", write_json("bench_dataproto", {"batch_mib": mib, "repeats": REPEATS, "results": results}))
    ray.shutdown()


if __name__ == "__main__":
    main()
