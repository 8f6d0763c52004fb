"""Checkpoints of a run and resuming from them.

Layout under ``<run dir>/checkpoints``::

    actor/step_N/      the actor's engine checkpoint (model, optimizer, LR schedule, RNG, ``extra``), written
                       atomically by workers/engine/checkpoint.py (step_N.tmp renamed when complete)
    critic/step_N/     the critic's, for PPO
    latest_step        "N": written last, after every role's step_N is complete -- the step a resume takes

``extra`` (saved with the actor) is the trainer state: ``step``, the data loader position, the KL controller's
coefficient and the count of skipped updates. A Ctrl-C during a save is held until the save is complete, so an
interrupted run never leaves ``latest_step`` naming a half-written checkpoint. A failed save (a full disk) raises
`CheckpointError` with the worker's one-line reason and leaves ``latest_step`` naming the previous step.

Loading verifies every file's content hash (workers/engine/checkpoint.py). When the checkpoint
``resume_mode=auto`` picks is damaged, the error names the newest intact earlier step, and the run resumes from
it only with ``trainer.resume_fallback=true``.
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

from controller.errors import WorkerGroupError
from workers.engine.checkpoint import CheckpointError, verify_checkpoint, write_atomic

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


def latest_step(ckpt_dir: str | os.PathLike) -> int | None:
    """The step ``ckpt_dir/latest_step`` names, or None when there is no such file."""
    marker = Path(ckpt_dir) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{marker} should hold the number of the newest complete checkpoint step, but holds {text[:40]!r}; "
            "resume from a step explicitly with trainer.resume_mode=<checkpoints>/actor/step_N"
        )
    return int(text)


def step_dirs(role_dir: Path) -> list[int]:
    if not role_dir.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in role_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )


def remove_partial(ckpt_dir: str | os.PathLike) -> list[str]:
    """Delete what a save cut short by a dying worker left (``<role>/step_N.tmp``, never loaded); returns
    their paths. A complete ``step_N`` is kept."""
    partial = sorted(Path(ckpt_dir).glob("*/step_*.tmp"))  # none when the directory does not exist
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return [str(path) for path in partial]


def _worker_error(err: WorkerGroupError) -> CheckpointError | None:
    """The CheckpointError a worker raised, with its role and rank (a one-line reason, no remote traceback)."""
    cause = getattr(err.__cause__, "cause", None)  # ray.exceptions.RayTaskError.cause: the worker's exception
    if isinstance(cause, CheckpointError):
        return CheckpointError(f"{err.role} rank {err.rank}: {cause}")
    return None


@contextmanager
def _checkpoint_errors():
    try:
        yield
    except WorkerGroupError as err:
        if (found := _worker_error(err)) is not None:
            raise found from None
        raise


def save(ckpt_dir: str | os.PathLike, step: int, groups: dict, extra: dict, keep: int | None = None) -> str:
    """Save every role in ``groups`` ({"actor": wg, "critic": wg}) at ``step``; ``extra`` goes with each."""
    ckpt_dir = Path(ckpt_dir)
    with hold_interrupts(), _checkpoint_errors():
        for role, wg in groups.items():
            wg.save_checkpoint(str(ckpt_dir / role), step, extra)
        write_atomic(ckpt_dir / LATEST, f"{step}\n".encode())
        if keep is not None:
            for role in groups:
                for old in step_dirs(ckpt_dir / role)[:-keep]:
                    if old != step:
                        shutil.rmtree(ckpt_dir / role / f"step_{old}", ignore_errors=True)
    return str(ckpt_dir / "actor" / f"step_{step}")


def _paths(root: Path, step: int, roles: list[str]) -> dict[str, str]:
    out = {}
    for role in roles:
        d = root / role / f"step_{step}"
        if not d.is_dir():
            raise FileNotFoundError(f"resuming step {step}: the {role} checkpoint {d} does not exist")
        out[role] = str(d)
    return out


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
            assert step is not None  # the file is there
        elif m := _STEP_DIR.match(path.name):
            root, step = path.parent.parent, int(m.group(1))
        else:
            raise FileNotFoundError(
                f"trainer.resume_mode={resume_mode!r}: neither a checkpoints directory with {LATEST} nor a "
                "step_N checkpoint directory"
            )
    return _paths(root, step, roles)


def intact_before(paths: dict[str, str]) -> dict[str, str] | None:
    """The newest checkpoint older than ``paths`` (one step_N per role) whose every role verifies, or None.
    Reads and hashes those checkpoints here, on the driver."""
    m = _STEP_DIR.match(Path(paths["actor"]).name)
    assert m is not None  # paths are resolve_resume's: <checkpoints>/<role>/step_N
    root, step = Path(paths["actor"]).parent.parent, int(m.group(1))
    for older in reversed([s for s in step_dirs(root / "actor") if s < step]):
        try:
            candidate = _paths(root, older, list(paths))
            for path in candidate.values():
                verify_checkpoint(path)
        except (FileNotFoundError, CheckpointError):
            continue
        return candidate
    return None


def _load(paths: dict[str, str], groups: dict) -> dict:
    extra = {}
    with _checkpoint_errors():
        for role, path in paths.items():
            got = groups[role].load_checkpoint(path)
            got = got[0] if isinstance(got, list) else got
            if role == "actor":
                extra = got
    return extra


def load(paths: dict[str, str], groups: dict, *, fallback: bool | None = None) -> tuple[dict, dict[str, str]]:
    """Load each role's checkpoint; returns the actor's ``extra`` (the trainer state) and the paths loaded.

    A damaged checkpoint raises CheckpointError. With ``fallback`` not None (``resume_mode=auto``) the error
    names the newest intact earlier checkpoint, which is loaded instead when ``fallback`` is true."""
    try:
        return _load(paths, groups), paths
    except CheckpointError as err:
        if fallback is None:
            raise
        intact = intact_before(paths)
        if intact is None:
            raise CheckpointError(f"{err}\nno earlier checkpoint beside it is intact") from None
        if not fallback:
            raise CheckpointError(
                f"{err}\nthe newest intact earlier checkpoint is {intact['actor']}: set "
                "trainer.resume_fallback=true to resume from it (or trainer.resume_mode=<that path>)"
            ) from None
        logger.warning("%s\nresuming from the newest intact earlier checkpoint %s", err, intact["actor"])
        return _load(intact, groups), intact
