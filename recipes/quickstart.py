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
from recipes.trainer import cli, demonstrations, parse_args, start_run, warm_start


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = parse_args("quickstart", argv)  # recipes/quickstart.yaml + overrides, validated before Ray starts
    run = start_run(cfg, "quickstart")  # tiny model + task data built, config saved, Ray started
    print(f"[quickstart] run dir {run.dir}; model {run.model_path}; data {run.train_files[0]}")
    if cfg.sft.enable:
        # GRPO (policy and reference) starts from the SFT model
        run.model_path = warm_start(cfg, run, demonstrations(cfg, run))
    result = grpo.train(cfg, run, recipe="quickstart")

    vals = result["val_history"]
    before, after = (vals[0][1]["val/accuracy"], vals[-1][1]["val/accuracy"]) if vals else (float("nan"),) * 2
    wall = time.perf_counter() - t0
    print()
    if vals:
        n = int(vals[-1][1]["val/num_samples"])
        print(f"validation accuracy {before:.2f} -> {after:.2f}  (greedy, {n} held-out problems, "
              f"GRPO step {vals[0][0]} -> step {vals[-1][0]})")  # fmt: skip
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
