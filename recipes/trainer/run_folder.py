"""Whether a run may use its folder: a run never silently overwrites another run's results.

A folder holds results when its ``metrics.jsonl`` has a step or its ``checkpoints/`` a complete one. Then:

* a run that resumes (``trainer.resume_mode=auto`` with a checkpoint there, or a checkpoint path) continues
  it, printing the keys whose values changed; ``auto`` with another model (``MODEL_KEYS``) is refused;
* ``trainer.overwrite=true`` removes what the earlier run wrote and starts again;
* the same config again, with no checkpoint to resume from (a rerun of the same command, a job requeued before
  its first checkpoint) starts again in place: the results it replaces are the ones it will reproduce;
* anything else is refused before Ray starts, naming the folder, what it holds, the keys whose values differ
  and the ways out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from recipes.config import ConfigError, to_yaml
from recipes.sections import RecipeConfig
from recipes.trainer.checkpoint import CheckpointError, latest_step

# What a run writes in its folder and a fresh start replaces (data/ and sft_model/ are rebuilt or reused on
# their own terms; files a user put there are never touched).
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "curves.png", "hf_model", "result.json", "config.prev.yaml")
# The model a checkpoint holds the weights of: resuming one with another of these is another run.
MODEL_KEYS = {
    "model.path",
    "model.tiny_size",
    "model.tiny_seed",
    "model.tiny_chat_template",
    "model.tiny_arch",
    "critic.model_path",
}
# The way out every refusal names first
OWN_FOLDER = (
    "give this run a folder of its own (trainer.experiment_name=<name> or trainer.default_local_dir=<dir>)"
)
# Keys that change how a process runs, not what it trains: a run differing only in these is the same run.
NOT_THE_RUN = {
    "trainer.resume_mode",
    "trainer.resume_fallback",
    "trainer.overwrite",
    "trainer.progress_bar",
    "trainer.max_restarts",
    "trainer.ray_num_cpus",
}


def prepare_run_folder(cfg: RecipeConfig, run_dir: Path) -> None:
    """Refuse, continue or clear ``run_dir`` for this run (the rules above); print what was replaced."""
    steps = _logged_steps(run_dir / "metrics.jsonl")
    checkpoint = _latest_checkpoint(run_dir / "checkpoints")
    if not steps and checkpoint is None:
        return
    mode = cfg.trainer.resume_mode
    if mode == "auto" and checkpoint is not None:  # a resume: the run goes on in its own folder
        _check_resume(cfg, run_dir, checkpoint)
        return
    if mode not in ("auto", "disable"):
        return  # an explicit checkpoint path: the user named what to continue
    held = _describe(steps, checkpoint)
    if cfg.trainer.overwrite:
        _clear(run_dir, with_checkpoints=True)
        print(
            f"[run] trainer.overwrite=true: {run_dir} held {held}; removed, the run starts again", flush=True
        )
        return
    ways_out = f"{OWN_FOLDER}, or replace what is there with trainer.overwrite=true"
    if checkpoint is not None:  # resume_mode=disable over checkpoints
        raise ConfigError(
            f"trainer.default_local_dir: {run_dir} holds {held} and trainer.resume_mode=disable would start "
            f"over them: resume it with trainer.resume_mode=auto, or {ways_out}"
        )
    changed = _changed(cfg, run_dir / "config.yaml")
    if not changed:
        _clear(run_dir, with_checkpoints=False)
        print(
            f"[run] {run_dir} held {held} of this same config and no checkpoint to resume from: "
            "the run starts again and replaces them",
            flush=True,
        )
        return
    raise ConfigError(
        f"trainer.default_local_dir: {run_dir} holds the results of another run ({held}; its config.yaml "
        f"differs in {changed}) that this run would overwrite: {ways_out}"
    )


def _check_resume(cfg: RecipeConfig, run_dir: Path, checkpoint: int) -> None:
    """A resume with another model is refused (its checkpoint holds that run's weights), and so is a changed
    config over a run that already finished (it would train nothing); any other change is printed, so a changed
    command that quietly continues an earlier run is seen doing so."""
    diffs = _differences(cfg, run_dir / "config.yaml")
    if not diffs:  # the same run, or no readable config to compare with
        return
    model = [d for d in diffs if d[0] in MODEL_KEYS]
    if model:
        raise ConfigError(
            f"trainer.resume_mode=auto would resume {run_dir} at step {checkpoint}, a run of another model "
            f"({_named(model)}): {OWN_FOLDER}, or replace that run with trainer.overwrite=true"
        )
    total = cfg.trainer.total_training_steps
    if total is not None and checkpoint >= total:
        raise ConfigError(
            f"trainer.resume_mode=auto would resume {run_dir}, which finished at step {checkpoint}, with a changed "
            f"config ({_named(diffs)}), and train nothing: {OWN_FOLDER}, raise trainer.total_training_steps to "
            "train that run on, or replace it with trainer.overwrite=true"
        )
    print(
        f"[run] resuming {run_dir} at step {checkpoint} with a config that differs from the run's: "
        f"{_named(diffs)} (trainer.experiment_name=<name> starts a run of its own instead)",
        flush=True,
    )


def _logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (KeyError, TypeError, ValueError):
            continue  # a torn last line of a killed run is not a step
    return steps


def _latest_checkpoint(ckpt_dir: Path) -> int | None:
    try:
        return latest_step(ckpt_dir)
    except CheckpointError:
        return -1  # a damaged marker still means checkpoints are there


def _describe(steps: list[int], checkpoint: int | None) -> str:
    parts = []
    if steps:
        parts.append(f"metrics.jsonl with steps {min(steps)}-{max(steps)}")
    if checkpoint is not None:
        parts.append(f"checkpoints up to step {checkpoint}" if checkpoint >= 0 else "checkpoints")
    return " and ".join(parts)


def _changed(cfg: RecipeConfig, saved: Path) -> str:
    """The keys whose values differ between ``saved`` and ``cfg`` as a message shows them; "" for the same run
    (a folder without a readable config.yaml is another run's)."""
    diffs = _differences(cfg, saved)
    if diffs is None:
        return f"everything ({saved.name} is missing or unreadable)"
    return _named(diffs)


def _differences(cfg: RecipeConfig, saved: Path) -> list[tuple[str, object, object]] | None:
    """(dotted key, value in ``saved``, value now) for every key that differs, but those of NOT_THE_RUN; None
    when ``saved`` cannot be read."""
    try:
        before = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return None
    flat_before, flat_now = _flatten(before or {}), _flatten(yaml.safe_load(to_yaml(cfg)))
    keys = sorted(k for k in flat_before.keys() | flat_now.keys() if flat_before.get(k) != flat_now.get(k))
    return [(k, flat_before.get(k), flat_now.get(k)) for k in keys if k not in NOT_THE_RUN]


def _named(diffs: list[tuple[str, object, object]], shown: int = 4) -> str:
    named = [f"{k} ({before!r} -> {now!r})" for k, before, now in diffs[:shown]]
    return ", ".join(named + ([f"{len(diffs) - shown} more"] if len(diffs) > shown else []))


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _clear(run_dir: Path, with_checkpoints: bool) -> None:
    for name in RUN_OUTPUTS + (("checkpoints",) if with_checkpoints else ()):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
