"""Tracking: a concise console line per step, a tqdm bar with the live reward, metrics.jsonl, TensorBoard,
optional wandb, and a PNG of the reward and validation-accuracy curves at the end.

    tracker = Tracker(cfg, run.dir, total_steps=20, start_step=0, recipe="grpo")
    tracker.log(metrics, step)        # every step (and step 0 for validation before training)
    tracker.close()                   # flush, close the bar, write curves.png
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from recipes.config import as_dict
from recipes.sections import RecipeConfig

logger = logging.getLogger("recipes")

REWARD_KEY = "critic/score/mean"
VAL_KEY = "val/accuracy"


def _fmt(v: float, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        return f"{v:.2e}"
    return f"{v:.{digits}g}"


def kl_of(metrics: dict) -> float | None:
    for key in ("actor/kl_loss", "actor/reward_kl_penalty"):  # KL to the reference, when there is one
        if key in metrics:
            return metrics[key]
    return None


def console_line(metrics: dict, step: int, total: int, recipe: str) -> str:
    parts = [f"[{recipe}] step {step}/{total}"]
    if REWARD_KEY in metrics:
        parts.append(f"reward {_fmt(metrics[REWARD_KEY])}")
    if "train/accuracy" in metrics:
        parts.append(f"acc {_fmt(metrics['train/accuracy'])}")
    if VAL_KEY in metrics:
        parts.append(f"val_acc {_fmt(metrics[VAL_KEY])}")
    if "response_length/mean" in metrics:
        parts.append(f"resp_len {metrics['response_length/mean']:.1f}")
    kl = kl_of(metrics)
    if kl is not None:
        parts.append(f"kl {_fmt(kl)}")
    elif "actor/ppo_kl" in metrics:  # no reference KL configured: show the update's old->new policy KL
        parts.append(f"ppo_kl {_fmt(metrics['actor/ppo_kl'])}")
    if "actor/entropy" in metrics:
        parts.append(f"entropy {_fmt(metrics['actor/entropy'])}")
    if "actor/pg_loss" in metrics:
        parts.append(f"pg_loss {_fmt(metrics['actor/pg_loss'])}")
    if "critic/vf_loss" in metrics:
        parts.append(f"vf_loss {_fmt(metrics['critic/vf_loss'])}")
    if "timing_s/step" in metrics:
        parts.append(f"{metrics['timing_s/step']:.1f}s")
    if "perf/total_num_tokens" in metrics and metrics.get("timing_s/step"):
        parts.append(f"{metrics['perf/total_num_tokens'] / metrics['timing_s/step']:.0f} tok/s")
    return " | ".join(parts)


class Tracker:
    def __init__(
        self, cfg: RecipeConfig, run_dir: str | os.PathLike, total_steps: int, start_step: int, recipe: str
    ):
        self.cfg = cfg
        self.dir = Path(run_dir)
        self.total = total_steps
        self.recipe = recipe
        self.loggers = list(cfg.trainer.logger)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.history: list[dict] = self._load_history(start_step)
        self._rewrite_history()
        self._jsonl = open(self.metrics_path, "a")  # noqa: SIM115 -- closed in close()
        self.tb = self._tensorboard(start_step + 1 if start_step else None)
        self.wandb = None
        if "wandb" in self.loggers:
            import wandb

            self.wandb = wandb.init(
                project=cfg.trainer.project_name,
                name=cfg.trainer.experiment_name,
                config=as_dict(cfg),
                dir=str(self.dir),
                mode=cfg.trainer.wandb_mode,
                resume="allow",
            )
        self.bar = None
        if cfg.trainer.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(  # disable=None: no bar when stderr is not a terminal (logs, CI)
                total=total_steps,
                initial=start_step,
                desc=recipe,
                unit="step",
                dynamic_ncols=True,
                disable=None,
            )

    @property
    def tensorboard_dir(self) -> Path:
        return self.dir / "tensorboard"

    def _load_history(self, start_step: int) -> list[dict]:
        """Earlier steps of a resumed run (steps after the checkpoint will be recomputed and are dropped)."""
        if not start_step or not self.metrics_path.is_file():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("step", 0) <= start_step:
                    rows.append(row)
        return rows

    def _rewrite_history(self) -> None:
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, self.metrics_path)

    def _tensorboard(self, purge_step: int | None):
        """A TensorBoard writer that drops the events from ``purge_step`` on (None: none), when it is a logger."""
        if "tensorboard" not in self.loggers:
            return None
        from torch.utils.tensorboard import SummaryWriter  # heavy (pulls in TensorBoard); only when logging

        return SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """Forget the steps after ``step`` (a run that went back to its checkpoint of that step will log them
        again): metrics.jsonl rewritten, TensorBoard purged past it, the bar set back. wandb keeps what it was
        sent (it refuses a step logged twice, so the recomputed steps show only in the other loggers)."""
        self.history = [r for r in self.history if r["step"] <= step]
        self._jsonl.close()
        self._rewrite_history()
        self._jsonl = open(self.metrics_path, "a")  # noqa: SIM115 -- closed in close()
        if self.tb is not None:
            self.tb.close()
            self.tb = self._tensorboard(step + 1)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        row = {"step": step, **clean}
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if "console" in self.loggers:
            self.write(console_line(clean, step, self.total, self.recipe))
        if self.bar is not None and step > 0:
            post = {}
            if REWARD_KEY in clean:
                post["reward"] = f"{clean[REWARD_KEY]:.3f}"
            if VAL_KEY in clean:
                post["val_acc"] = f"{clean[VAL_KEY]:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(step - self.bar.n)

    def close(self, plot: bool | None = None) -> str | None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if plot if plot is not None else self.cfg.trainer.plot:
            return plot_curves(
                self.history,
                self.dir / "curves.png",
                title=f"{self.recipe}: {self.cfg.trainer.experiment_name}",
            )
        return None


def plot_curves(history: list[dict], path: str | os.PathLike, title: str = "") -> str:
    """Training reward (critic/score/mean) and validation accuracy (val/accuracy) against the step."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in (
        (axes[0], REWARD_KEY, "training reward (mean score)"),
        (axes[1], VAL_KEY, "validation accuracy (greedy)"),
    ):
        pts = [(r["step"], r[key]) for r in history if key in r and math.isfinite(r[key])]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.02, 1.02) if key == VAL_KEY else None
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
