"""Supervised warm start on replayed multi-turn trajectories (RLM and tool recipes): ``cfg.sft.total_steps``
``ActorWorker.sft_step`` calls on random minibatches of a DataProto in the rollout layout (loss on
``response_mask`` tokens only), then the model exported as an HF directory the RL phase starts from."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from dataproto import DataProto
from recipes.trainer.roles import build_actor_group, metrics_of
from recipes.trainer.run import Run


def sample_rows(data: DataProto, idx: Sequence[int]) -> DataProto:
    """The tensor rows ``idx`` of ``data`` (an SFT minibatch)."""
    i = torch.as_tensor(list(idx), dtype=torch.long)
    return DataProto.from_dict({k: v[i] for k, v in data.batch.items()})


def warm_start_on_replays(cfg, run: Run, replay, what: str) -> str:
    """Replay the training rows' reference solutions with ``replay(rows, tokenizer, cfg.env) -> DataProto`` (at
    most ``cfg.sft.max_samples`` rows), then `sft_warm_start` on them; returns the exported HF directory."""
    import pandas as pd

    rows = pd.read_parquet(run.train_files[0]).to_dict("records")
    if cfg.sft.max_samples:
        rows = rows[: cfg.sft.max_samples]
    t0 = time.perf_counter()
    data = replay(rows, run.tokenizer, cfg.env)
    trained = data.batch["response_mask"].sum(-1).mean()
    tokens = data.batch["attention_mask"].sum(-1).float().mean()
    print(
        f"[sft] {len(data)} {what} replayed in the sandbox in {time.perf_counter() - t0:.1f}s "
        f"({trained:.0f} trained / {tokens:.0f} tokens each)"
    )
    return sft_warm_start(cfg, run, data)


def sft_warm_start(cfg, run: Run, data: DataProto) -> str:
    """Train on ``data`` with an ActorWorker group (``cfg.sft``: steps, batch size, optimiser, seed); returns the
    exported HF directory ``<run dir>/sft_model``."""
    actor, manager = build_actor_group(cfg, run, replace(cfg.actor, optim=cfg.sft.optim))
    rng, bs = random.Random(cfg.sft.seed), min(cfg.sft.batch_size, len(data))
    try:
        t0 = time.perf_counter()
        for step in range(1, cfg.sft.total_steps + 1):
            m = metrics_of(actor.sft_step(sample_rows(data, rng.sample(range(len(data)), bs))))
            if step % cfg.sft.log_every == 0 or step == cfg.sft.total_steps:
                print(
                    f"[sft] step {step}/{cfg.sft.total_steps} | loss {m['sft/loss']:.4f} | lr {m['sft/lr']:.2e} "
                    f"| {(time.perf_counter() - t0) / step:.2f}s/step",
                    flush=True,
                )
        return actor.export_hf(str(run.dir / "sft_model"))[0]
    finally:
        actor.shutdown()
        manager.remove()
