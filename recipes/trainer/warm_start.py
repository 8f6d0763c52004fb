"""The supervised warm start a recipe runs before RL (``sft.enable``; by default when ``model.path`` is null): ``cfg.sft.total_steps``
``ActorWorker.sft_step`` calls (loss on ``response_mask`` tokens only) with an actor WorkerGroup of its own,
then the model exported as the HF directory ``<run dir>/sft_model`` that the RL phase starts from::

    run.model_path = warm_start(cfg, run, demonstrations)

Where the SFT batches come from is the recipe's choice, an ``SFTData`` (``(cfg, run) -> batches``):

* ``demonstrations``: the training split's single-turn demonstrations (``extra_info.solution``; quickstart);
* ``replayed(replay, what)``: the rows' reference solutions replayed as multi-turn trajectories in the real
  sandbox (RLM and tool environments), random minibatches of them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial

import pandas as pd
import torch

from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer.checkpoint import resolve_resume
from recipes.trainer.data import sft_batches, sft_loader
from recipes.trainer.metrics import timer
from recipes.trainer.roles import build_actor_group, metrics_of
from recipes.trainer.run import Run
from workers.engine import LoRAConfig

PROGRESS_S = 30.0  # the warm start prints a line at least this often

# rows, tokenizer, env config -> trajectories in the rollout layout
Replay = Callable[[Sequence[Mapping], object, object], DataProto]
# cfg, run -> endless SFT batches
SFTData = Callable[[RecipeConfig, Run], Iterator[DataProto]]


def warm_start(cfg: RecipeConfig, run: Run, data: SFTData) -> str:
    """Train on ``data(cfg, run)`` (``cfg.sft``: steps, optimiser, logging) with an ActorWorker group;
    TensorBoard under ``<run dir>/tensorboard/sft`` when ``trainer.logger`` has it. Returns the exported HF
    directory, or ``run.model_path`` as it is when the run does not warm-start (``SFTConfig.runs``). A run that
    resumes from a checkpoint reuses its own export (``<run dir>/sft_model``, written whole or not at all): its RL
    checkpoint and its reference model were made from that model, and training it again costs minutes."""
    if not cfg.sft.runs(cfg):
        return run.model_path
    exported = run.dir / "sft_model"
    if (exported / "config.json").is_file() and resolve_resume(
        cfg.trainer.resume_mode, run.checkpoint_dir, ["actor"]
    ):
        print(f"[sft] the run resumes: its warm start {exported} is reused, not trained again", flush=True)
        return str(exported)
    batches = data(cfg, run)
    writer = None
    if "tensorboard" in cfg.trainer.logger:
        from torch.utils.tensorboard import SummaryWriter  # heavy (pulls in TensorBoard); only when logging

        writer = SummaryWriter(log_dir=str(run.dir / "tensorboard" / "sft"))
    # the warm start makes the model RL starts from, in full: with actor.lora it becomes the frozen base (and
    # the reference) that the RL adapters train on
    actor, manager = build_actor_group(cfg, run, replace(cfg.actor, optim=cfg.sft.optim, lora=LoRAConfig()))
    try:
        timings: dict[str, float] = {}
        last_line = time.monotonic()
        for step in range(1, cfg.sft.total_steps + 1):
            with timer("sft", timings):
                metrics = metrics_of(actor.sft_step(next(batches)))
            if writer is not None:
                for k, v in metrics.items():
                    writer.add_scalar(k, v, step)
            # every log_every steps, and at least every PROGRESS_S seconds: a long warm start is seen moving
            if (
                step % cfg.sft.log_every == 0
                or step == cfg.sft.total_steps
                or time.monotonic() - last_line >= PROGRESS_S
            ):
                last_line = time.monotonic()
                left = timings["sft"] / step * (cfg.sft.total_steps - step)
                print(
                    f"[sft] step {step}/{cfg.sft.total_steps} | loss {metrics['sft/loss']:.4f} | "
                    f"lr {metrics['sft/lr']:.2e} | {timings['sft'] / step:.2f}s/step"
                    + (f" | ~{left / 60:.0f} min left" if left >= 60 else ""),
                    flush=True,
                )
        return actor.export_hf(str(run.dir / "sft_model"))[0]
    finally:
        if writer is not None:
            writer.close()
        actor.shutdown()
        manager.remove()


def demonstrations(cfg: RecipeConfig, run: Run) -> Iterator[DataProto]:
    """Shuffled batches of the training split's demonstrations, endlessly."""
    loader = sft_loader(cfg, run)
    print(
        f"[sft] {cfg.sft.total_steps} steps of {loader.batch_size} demonstrations ({len(loader.dataset)} in all)"
    )
    return sft_batches(loader)


def replayed(replay: Replay, what: str) -> SFTData:
    """The training rows' reference solutions (at most ``cfg.sft.max_samples`` rows) replayed with
    ``replay(rows, tokenizer, cfg.env)``; random minibatches of ``cfg.sft.batch_size`` of them (seed
    ``cfg.sft.seed``), endlessly. ``what`` names them in the printed line."""
    return partial(_replayed, replay=replay, what=what)


def _replayed(cfg, run: Run, *, replay: Replay, what: str) -> Iterator[DataProto]:
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
    return random_minibatches(data, cfg.sft.batch_size, cfg.sft.seed)


def random_minibatches(data: DataProto, batch_size: int, seed: int) -> Iterator[DataProto]:
    """The tensor columns of ``min(batch_size, len(data))`` random rows (without replacement), endlessly."""
    rng, size = random.Random(seed), min(batch_size, len(data))
    while True:
        rows = torch.as_tensor(rng.sample(range(len(data)), size), dtype=torch.long)
        yield DataProto.from_dict({k: v[rows] for k, v in data.batch.items()})
