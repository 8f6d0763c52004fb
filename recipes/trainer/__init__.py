"""The small shared library the recipe scripts (``recipes/grpo.py``, ``ppo.py``, ``quickstart.py``) call.

* ``run``: command line -> validated config; run directory, resolved config saved, tiny model and task data
  prepared, Ray started (``parse_args``, ``start_run``)
* ``roles``: resource pools and WorkerGroups for ``trainer.placement`` colocated / disaggregated
  (``build_roles``; ``Roles.generate``, ``Roles.sync_weights``)
* ``data``: resumable prompt batches, validation batches, SFT batches
* ``steps``: sampling settings with per-step seeds, merging worker outputs, advantages on the controller,
  validation, trainer state + checkpoint save/resume
* ``metrics``: verl-named data / timing / throughput / validation metrics, ``timer``
* ``tracking``: console line, tqdm bar, metrics.jsonl, TensorBoard, wandb, curves.png
* ``checkpoint``: checkpoint layout, ``latest_step`` marker, Ctrl-C-safe saves
"""

from recipes.trainer.checkpoint import hold_interrupts, latest_step
from recipes.trainer.data import (
    prompt_batches,
    sft_batches,
    sft_loader,
    total_steps,
    train_loader,
    val_batches,
)
from recipes.trainer.metrics import (
    compute_data_metrics,
    compute_throughput,
    timer,
    timing_metrics,
    validation_metrics,
)
from recipes.trainer.roles import Roles, build_actor_group, build_roles, metrics_of
from recipes.trainer.run import Run, cli, init_ray, model_config, parse_args, start_run
from recipes.trainer.session import Session
from recipes.trainer.steps import (
    TrainerState,
    compute_advantage,
    due,
    merge,
    resume,
    rollout_meta,
    save_checkpoint,
    val_meta,
    validate,
)
from recipes.trainer.tracking import Tracker, console_line, plot_curves

__all__ = [
    "Roles",
    "Run",
    "Session",
    "Tracker",
    "TrainerState",
    "build_actor_group",
    "build_roles",
    "cli",
    "compute_advantage",
    "compute_data_metrics",
    "compute_throughput",
    "console_line",
    "due",
    "hold_interrupts",
    "init_ray",
    "latest_step",
    "merge",
    "metrics_of",
    "model_config",
    "parse_args",
    "plot_curves",
    "prompt_batches",
    "resume",
    "rollout_meta",
    "save_checkpoint",
    "sft_batches",
    "sft_loader",
    "start_run",
    "timer",
    "timing_metrics",
    "total_steps",
    "train_loader",
    "val_batches",
    "val_meta",
    "validate",
    "validation_metrics",
]
