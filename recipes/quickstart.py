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
from recipes.trainer import (
    cli,
    demonstrations,
    parse_args,
    report_result,
    start_run,
    warm_start,
)


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = parse_args("quickstart", argv)  # recipes/quickstart.yaml + overrides, validated before Ray starts
    run = start_run(cfg, "quickstart")  # tiny model + task data built, config saved, Ray started
    print(f"[quickstart] run dir {run.dir}; model {run.model_path}; data {run.train_files[0]}")
    run.model_path = warm_start(cfg, run, demonstrations)  # GRPO (policy and reference) starts from it
    result = grpo.train(cfg, run, recipe="quickstart")
    summary = report_result(result, t0, "validation accuracy", run.dir)  # README's figures: its result.json
    return {**result, **summary, "sft_model": str(Path(run.model_path))}


if __name__ == "__main__":
    cli(main)
