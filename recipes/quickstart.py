"""Quickstart: from nothing to an RL-trained model on a laptop CPU in a few minutes.

    python -m recipes.quickstart                      # recipes/quickstart.yaml (make demo)
    python -m recipes.quickstart sft.total_steps=300 trainer.total_training_steps=20

1. build the tiny Qwen2 tokenizer + model (workers/models/tiny.py) and generate the task data (recipes/tasks);
2. supervised warm start: ``ActorWorker.sft_step`` on the training split's demonstrations, through a
   WorkerGroup like every other call, then export the warm-started policy (Hugging Face format);
3. GRPO from it, colocated, with the same code as ``recipes/grpo.py``;
4. print the held-out accuracy before and after RL, the exported model, the curves and the TensorBoard dir.
"""

from __future__ import annotations

import time
from pathlib import Path

from recipes import grpo
from recipes.config import QuickstartConfig
from recipes.trainer import (
    Run,
    build_actor_group,
    cli,
    metrics_of,
    parse_args,
    sft_batches,
    sft_loader,
    start_run,
    timer,
)


def warm_start(cfg: QuickstartConfig, run: Run) -> str:
    """Supervised steps on the demonstrations with an ActorWorker group; returns the exported HF directory."""
    from dataclasses import replace

    from torch.utils.tensorboard import SummaryWriter

    out_dir = run.dir / "sft_model"
    loader = sft_loader(cfg, run)
    print(
        f"[sft] {cfg.sft.total_steps} steps of {loader.batch_size} demonstrations ({len(loader.dataset)} in all)"
    )
    actor, manager = build_actor_group(cfg, run, replace(cfg.actor, optim=cfg.sft.optim))
    writer = SummaryWriter(log_dir=str(run.dir / "tensorboard" / "sft"))
    try:
        batches, timings = sft_batches(loader), {}
        for step in range(1, cfg.sft.total_steps + 1):
            with timer("sft", timings):
                metrics = metrics_of(actor.sft_step(next(batches)))
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            if step % cfg.sft.log_every == 0 or step == cfg.sft.total_steps:
                print(
                    f"[sft] step {step}/{cfg.sft.total_steps} | loss {metrics['sft/loss']:.4f} | "
                    f"lr {metrics['sft/lr']:.2e} | {timings['sft'] / step:.2f}s/step",
                    flush=True,
                )
        return actor.export_hf(str(out_dir))[0]
    finally:
        writer.close()
        actor.shutdown()
        manager.remove()


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = parse_args("quickstart", argv)  # recipes/quickstart.yaml + overrides, validated before Ray starts
    run = start_run(cfg, "quickstart")  # tiny model + task data built, config saved, Ray started
    print(f"[quickstart] run dir {run.dir}; model {run.model_path}; data {run.train_files[0]}")
    if cfg.sft.enable:
        run.model_path = warm_start(cfg, run)  # GRPO (policy and reference) starts from the SFT model
    result = grpo.train(cfg, run, recipe="quickstart")

    accs = [
        (r["step"], r["val/accuracy"], r["val/num_samples"]) for r in result["history"] if "val/accuracy" in r
    ]
    before, after = (accs[0][1], accs[-1][1]) if accs else (float("nan"), float("nan"))
    wall = time.perf_counter() - t0
    print()
    if accs:
        print(f"validation accuracy {before:.2f} -> {after:.2f}  (greedy, {int(accs[-1][2])} held-out problems, "
              f"GRPO step {accs[0][0]} -> step {accs[-1][0]})")  # fmt: skip
    else:
        print("no validation ran (trainer.val_before_train=false and trainer.test_freq <= 0)")
    print(f"exported model:  {result['hf_model']}")
    print(f"curves:          {result['plot']}")
    print(f"TensorBoard:     tensorboard --logdir {result['tensorboard']}")
    print(f"wall time:       {wall:.0f}s")
    return {
        **result,
        "val_before": before,
        "val_after": after,
        "wall_s": wall,
        "sft_model": str(Path(run.model_path)),
    }


if __name__ == "__main__":
    cli(main)
