"""Checkpoints of a run and resuming from them.

Layout under ``<run dir>/checkpoints``::

    actor/step_N/      the actor's engine checkpoint (model, optimizer, LR schedule, RNG, ``extra``), written
                       atomically by workers/engine/checkpoint.py (step_N.tmp renamed when complete)
    critic/step_N/     the critic's, for PPO
    latest_step        "N": written last, after every role's step_N is complete -- the step a resume takes

``extra`` (saved with the actor) is the trainer state: ``step``, the data loader position, the KL controller's
coefficient and the count of skipped updates. A Ctrl-C during a save is held until the save is complete, so an
interrupted run never leaves ``latest_step`` naming a half-written checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("recipes")

LATEST = "latest_step"
_STEP_DIR = re.compile(r"^step_(\d+)$")


_holding = False  # a hold_interrupts block is active (nested blocks defer to the outermost one)


@contextmanager
def hold_interrupts():
    """Delay SIGINT until the block is done (then raise KeyboardInterrupt); a no-op off the main thread and
    inside another such block (the outermost one raises)."""
    global _holding
    if _holding or threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    _holding = True
    try:
        yield
    finally:
        _holding = False
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt("interrupted during a checkpoint save (the save completed)")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_step(ckpt_dir: str | os.PathLike) -> int | None:
    marker = Path(ckpt_dir) / LATEST
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def step_dirs(role_dir: Path) -> list[int]:
    if not role_dir.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in role_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )


def save(ckpt_dir: str | os.PathLike, step: int, groups: dict, extra: dict, keep: int | None = None) -> str:
    """Save every role in ``groups`` ({"actor": wg, "critic": wg}) at ``step``; ``extra`` goes with each."""
    ckpt_dir = Path(ckpt_dir)
    with hold_interrupts():
        for role, wg in groups.items():
            wg.save_checkpoint(str(ckpt_dir / role), step, extra)
        _write_atomic(ckpt_dir / LATEST, f"{step}\n")
        if keep is not None:
            for role in groups:
                for old in step_dirs(ckpt_dir / role)[:-keep]:
                    if old != step:
                        shutil.rmtree(ckpt_dir / role / f"step_{old}", ignore_errors=True)
    return str(ckpt_dir / "actor" / f"step_{step}")


def resolve_resume(resume_mode: str, ckpt_dir: str | os.PathLike, roles: list[str]) -> dict[str, str] | None:
    """{role: checkpoint dir} to resume from, or None to start fresh.

    ``auto``: the step named by ``<run>/checkpoints/latest_step`` (None if there is none); ``disable``: None;
    otherwise a path: a checkpoints directory (with ``latest_step``) or an ``actor/step_N`` directory (the
    other roles' ``step_N`` are taken beside it).
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        root, step = Path(ckpt_dir), latest_step(ckpt_dir)
        if step is None:
            return None
    else:
        path = Path(resume_mode).expanduser().resolve()
        if (path / LATEST).is_file():
            root, step = path, latest_step(path)
        elif _STEP_DIR.match(path.name):
            root, step = path.parent.parent, int(_STEP_DIR.match(path.name).group(1))
        else:
            raise FileNotFoundError(
                f"trainer.resume_mode={resume_mode!r}: neither a checkpoints directory with {LATEST} nor a "
                "step_N checkpoint directory"
            )
    out = {}
    for role in roles:
        d = root / role / f"step_{step}"
        if not d.is_dir():
            raise FileNotFoundError(f"resuming step {step}: the {role} checkpoint {d} does not exist")
        out[role] = str(d)
    return out


def load(paths: dict[str, str], groups: dict) -> dict:
    """Load each role's checkpoint; returns the actor's ``extra`` (the trainer state)."""
    extra = {}
    for role, path in paths.items():
        got = groups[role].load_checkpoint(path)
        got = got[0] if isinstance(got, list) else got
        if role == "actor":
            extra = got
    return extra
