"""The small shared library the recipe scripts (``recipes/grpo.py``, ``grpo_async.py``, ``ppo.py``, ``rlm.py``,
``hybrid_rl.py``, ``quickstart.py``) call, so that each script holds only its algorithm.

* ``run``: command line -> validated config; run directory, resolved config saved, tiny model and task data
  prepared, Ray started (``parse_args``, ``start_run``, ``cli``)
* ``session``: ``Session`` -- data, roles, KL controller, resume, tracker; ``Session.train(step)`` runs a
  recipe's step function with validation (``should_validate``, the recipe's validator), checkpoints, export;
  ``print_summary`` of a finished run, ``report_result`` (with the score before and after, and result.json)
* ``roles``: resource pools and WorkerGroups for ``trainer.placement`` colocated / disaggregated
  (``build_roles``; ``Roles.generate``, ``Roles.sync_weights``), ``metrics_of`` a worker call
* ``steps``: sampling settings with per-step seeds, reward + log-probs, advantages on the controller (rows
  that inherit theirs: ``sources``), the env-failure abort, mini-batch filling, ``due``,
  trainer state + checkpoint save/resume
* ``validation``: one generate -> score loop on the held-out prompts; ``greedy_accuracy``, ``PassAtK``,
  ``print_accuracy_change``
* ``warm_start``: the supervised warm start on demonstrations or replayed trajectories, exported for RL
* ``data``: resumable prompt batches, validation batches, SFT batches
* ``metrics``: verl-named data / timing / throughput / validation metrics, ``timer``
* ``tracking``: console line, tqdm bar, metrics.jsonl, TensorBoard, wandb, curves.png
* ``checkpoint``: checkpoint layout, ``latest_step`` marker, Ctrl-C-safe saves
* ``async_rl``: where an asynchronous recipe's batches come from (``rollout_source``: ``SyncRollout`` or the
  ``RolloutStream`` of one-step off-policy / fully asynchronous generation; imported from its module)
* ``hybrid``: the hybrid recipe's PRM role, teacher hints and advantage (imported from its module, not
  re-exported here)
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
from recipes.trainer.session import Session, print_summary, report_result
from recipes.trainer.steps import (
    TrainerState,
    apply_rollout_correction,
    check_env_errors,
    compute_advantage,
    due,
    fill_mini_batches,
    log_probs,
    resume,
    rollout_meta,
    save_checkpoint,
    score,
    update_actor,
)
from recipes.trainer.tracking import Tracker, console_line, plot_curves
from recipes.trainer.validation import PassAtK, greedy_accuracy, pass_at_k, print_accuracy_change, val_meta
from recipes.trainer.warm_start import demonstrations, replayed, warm_start

__all__ = [
    "PassAtK",
    "Roles",
    "Run",
    "Session",
    "Tracker",
    "TrainerState",
    "apply_rollout_correction",
    "build_actor_group",
    "build_roles",
    "cli",
    "check_env_errors",
    "compute_advantage",
    "compute_data_metrics",
    "compute_throughput",
    "console_line",
    "demonstrations",
    "due",
    "fill_mini_batches",
    "greedy_accuracy",
    "hold_interrupts",
    "init_ray",
    "latest_step",
    "metrics_of",
    "model_config",
    "parse_args",
    "pass_at_k",
    "plot_curves",
    "print_accuracy_change",
    "print_summary",
    "report_result",
    "prompt_batches",
    "replayed",
    "resume",
    "rollout_meta",
    "save_checkpoint",
    "log_probs",
    "score",
    "sft_batches",
    "sft_loader",
    "start_run",
    "timer",
    "timing_metrics",
    "total_steps",
    "train_loader",
    "update_actor",
    "val_batches",
    "val_meta",
    "validation_metrics",
    "warm_start",
]
