"""What the spawned gloo ranks of tests/workers/engine/test_meta_init.py run (module-level, so
`torch.multiprocessing` spawn can import it)."""

from __future__ import annotations

from pathlib import Path

import engine_testlib as T
import torch

from workers.engine import FSDPEngine, export_hf


def rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def peak_growth_kib(build) -> tuple[object, int]:
    """(build(), how far this process's peak resident memory rose above its resident memory before)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before, _ = rss_kib()
    result = build()
    return result, rss_kib()[1] - before


def meta_init_scenarios(rank: int, world: int, warmup_dir: str, dirs: dict[str, str], out_dir: str) -> None:
    """A first engine on ``warmup_dir`` (the one-time costs of a process's first engine), then per directory of
    ``dirs``: full weights gathered from a sharded engine, the local shard sizes, the peak
    memory growth of building the engine, loss and grad norm of one step; an HF export of the random-init
    model. Results go to ``out_dir/rank<r>.pt``."""
    torch.set_num_threads(1)
    res: dict = {}
    del FSDPEngine(T.engine_config(warmup_dir)).model
    for key, path in dirs.items():
        engine, growth = peak_growth_kib(lambda p=path: FSDPEngine(T.engine_config(p, lr=1e-3)))
        res[f"{key}/growth_kib"] = growth
        res[f"{key}/local_numel"] = sum(p.to_local().numel() for p in engine.model.parameters())
        res[f"{key}/params"] = T.params(engine)
        batch = T.shard_rows(T.make_batch(8, seed=7), rank, world)
        metrics = engine.train_step(batch, T.pg_loss, micro_batch_size=2)
        res[f"{key}/loss"], res[f"{key}/grad_norm"] = metrics["loss"], metrics["grad_norm"]
        if key == "random":
            res["export"] = export_hf(engine, Path(out_dir) / "hf")
        del engine
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
