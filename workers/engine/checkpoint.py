"""Resumable checkpoints (torch.distributed.checkpoint) and Hugging Face export for `FSDPEngine`.

Layout of a checkpoint root::

    root/
      latest                  text: the name of the newest complete checkpoint ("step_12"), written last
      step_12/
        model_optim/          DCP: .metadata + one __<rank>_0.distcp per rank (sharded model + optimizer)
        engine_state.pt       step, skipped steps, LR scheduler, the caller's opaque `extra` (e.g. data position)
        rng_rank<r>.pt        torch / cuda / numpy / python RNG states of rank r
        manifest.json         every file above with its size; written after all of them

A checkpoint is written into ``step_N.tmp`` and renamed to ``step_N`` only when complete (manifest written and
all ranks done); ``latest`` is replaced atomically after the rename. A crash mid-save leaves only a ``.tmp``
directory that is never loaded. `load_checkpoint` checks the manifest first and raises `CheckpointError`
naming any missing or truncated file.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.engine import distributed as du

if TYPE_CHECKING:
    from workers.engine.fsdp_engine import FSDPEngine

MODEL_OPTIM_DIR = "model_optim"
ENGINE_STATE = "engine_state.pt"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or truncated; the message names the file."""


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _collective(engine: FSDPEngine) -> bool:
    return engine.use_fsdp


def _barrier(engine: FSDPEngine) -> None:
    if _collective(engine):
        dist.barrier(group=engine.device_mesh.get_group())


def _broadcast_obj(engine: FSDPEngine, obj: Any) -> Any:
    if not _collective(engine):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=engine.device_mesh.get_group())
    return box[0]


@contextlib.contextmanager
def _quiet_single_process(engine: FSDPEngine):
    """DCP warns that it 'assumes a single process' without a process group; that is the intent here."""
    with warnings.catch_warnings():
        if not _collective(engine):
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to (save|load) in a single process"
            )
        yield


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_optim_state(engine: FSDPEngine) -> dict:
    if engine.optimizer is not None:
        msd, osd = get_state_dict(engine.model, engine.optimizer)
        return {"model": msd, "optim": osd}
    msd, _ = get_state_dict(engine.model, [])
    return {"model": msd}


# ----------------------------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------------------------


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint named by ``root/latest``, or None if there is none yet."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    path = Path(root) / name
    if not path.is_dir():
        raise CheckpointError(f"{marker} names {name!r}, but {path} does not exist")
    return path


def save_checkpoint(
    engine: FSDPEngine, root: str | os.PathLike, *, step: int | None = None, extra: dict | None = None
) -> str:
    """Save model, optimizer, LR scheduler, RNG states, step and ``extra`` to ``root/step_<step>`` atomically.

    Collective under FSDP (every rank calls it). ``step`` defaults to the engine's global step. Returns the
    final directory."""
    root = Path(root)
    step = engine.global_step if step is None else step
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    rank = du.rank() if _collective(engine) else 0
    if not _collective(engine) and du.rank() != 0:
        return str(final)  # an unsharded replica: rank 0 writes for all
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier(engine)

    with _quiet_single_process(engine):
        dcp.save(
            _model_optim_state(engine),
            checkpoint_id=str(tmp / MODEL_OPTIM_DIR),
            no_dist=not _collective(engine),
        )
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    _barrier(engine)

    if rank == 0:
        torch.save(
            {
                "format_version": FORMAT_VERSION,
                "global_step": engine.global_step,
                "skipped_steps": engine.skipped_steps,
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                "extra": extra or {},
                "dp_size": engine.dp_size,
                "model_path": str(engine.config.model_path),
                "value_head": engine.is_value_model,
            },
            tmp / ENGINE_STATE,
        )
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        _write_atomic(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
        if final.exists():
            old = root / f"step_{step}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, final.name.encode())
    _barrier(engine)
    return str(final)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check that ``path`` is a complete checkpoint; returns its manifest. Raises CheckpointError naming the
    first missing or truncated file."""
    path = Path(path)
    if not path.is_dir():
        hint = (
            " (an unfinished save left only a .tmp directory)"
            if path.with_name(path.name + ".tmp").exists()
            else ""
        )
        raise CheckpointError(f"checkpoint directory {path} does not exist{hint}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: missing file {manifest_path}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt checkpoint manifest {manifest_path}: {e}") from e
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"incomplete checkpoint {path}: missing file {f}")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"truncated checkpoint file {f}: {actual} bytes, expected {size}")
    return manifest


def load_checkpoint(engine: FSDPEngine, path: str | os.PathLike) -> dict:
    """Restore ``engine`` from a checkpoint directory (or from a root holding a ``latest`` marker).
    Collective under FSDP. Returns the ``extra`` dict given at save time."""
    path = Path(path)
    if (path / LATEST).is_file() and not (path / MANIFEST).exists():
        path = latest_checkpoint(path)
    verify_checkpoint(path)
    state = _model_optim_state(engine)
    try:
        with _quiet_single_process(engine):
            dcp.load(state, checkpoint_id=str(path / MODEL_OPTIM_DIR), no_dist=not _collective(engine))
    except Exception as e:  # DCP errors rarely say which directory
        raise CheckpointError(f"could not load {path / MODEL_OPTIM_DIR}: {e}") from e
    if engine.optimizer is not None:
        if "optim" not in state:
            raise CheckpointError(f"{path / MODEL_OPTIM_DIR} holds no optimizer state")
        set_state_dict(
            engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_state_dict(engine.model, [], model_state_dict=state["model"], optim_state_dict={})

    es = torch.load(path / ENGINE_STATE, weights_only=False)
    engine.global_step = es["global_step"]
    engine.skipped_steps = es["skipped_steps"]
    if engine.lr_scheduler is not None and es["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(es["lr_scheduler"])
    rank = du.rank() if _collective(engine) else 0
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif es["dp_size"] == engine.dp_size:
        raise CheckpointError(f"incomplete checkpoint {path}: missing file {rng_file}")
    return es["extra"]


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face export
# ----------------------------------------------------------------------------------------------------------------


def export_hf(
    engine: FSDPEngine,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> str | None:
    """Write the full model as a Hugging Face directory (safetensors + config [+ tokenizer]) that
    ``AutoModelForCausalLM.from_pretrained`` (critics: ``AutoModelForTokenClassification``) loads.
    Collective under FSDP; rank 0 writes. Returns the directory on rank 0, None elsewhere."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    writer = du.rank() == 0
    tensors = {}
    for name, t in engine.full_state_dict_iter(device="cpu", dtype=dtype):
        if writer:
            tensors[name] = t.contiguous().clone()
    if not writer:
        _barrier(engine)
        return None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    config = engine.model_config
    if config is not None:
        config = config.__class__.from_dict(config.to_dict())
        config.architectures = [engine.model_class_name]
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(tmp)
        cfg_json = json.loads((tmp / "config.json").read_text())
        cfg_json.pop("_attn_implementation", None)
        cfg_json.pop("attn_implementation", None)
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    gen = getattr(engine.model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    _barrier(engine)
    return str(out)
