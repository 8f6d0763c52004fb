"""Resumable checkpoints (torch.distributed.checkpoint) and Hugging Face export of any `TrainEngine`.

The engine is saved the way torchtitan's checkpointer saves its ``Stateful`` components: whatever
``engine.state_dict()`` returns (model and optimizer shards, LR schedule, step counters) goes through DCP, and
``engine.load_state_dict()`` takes it back; this module knows nothing else of the engine but its process
group (``checkpoint_group()``) and the layout a checkpoint must match (``checkpoint_layout()``).

Layout of one checkpoint directory::

    step_12/
      model_optim/          DCP: .metadata + __<rank>_0.distcp files (each rank's shards of the engine state)
      engine_state.pt       the engine's layout, the number of ranks, the caller's opaque `extra`
      rng_rank<r>.pt        torch / cuda / numpy / python RNG states of rank r
      manifest.json         every file above with its size and xxh3-128 content hash; written after all of them

A checkpoint is written into ``step_N.tmp`` and renamed to ``step_N`` only when complete (manifest written and
all ranks done), so a crash mid-save leaves only a ``.tmp`` directory that is never loaded. A failed save
(disk full included) removes its ``.tmp`` and raises `CheckpointError` naming the path and, for a full disk,
the bytes needed; an earlier ``step_N`` is untouched. `load_checkpoint` verifies every file's size and hash
before reading any (split over the ranks) and raises `CheckpointError` naming the file and the step. Which
step is the newest complete one is the caller's business (recipes/trainer/checkpoint.py writes
``latest_step`` once every role's checkpoint of a step is complete).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from workers import distributed as du
from workers.engine.base import LoRATrainEngine, TrainEngine
from workers.engine.lora import write_peft_adapter

MODEL_OPTIM_DIR = "model_optim"
ENGINE_STATE = "engine_state.pt"
ADAPTER_DIR = "adapter"  # a LoRA run's export: the PEFT adapter beside the merged model
MANIFEST = "manifest.json"
HASH = "xxh3_128"
FORMAT_VERSION = 3  # 2: a content hash per file in the manifest; 3: step counters and LR schedule in DCP
_CHUNK = 8 << 20
_FULL = 1 << 20  # a filesystem with less free space than this after a failed save is full


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded (missing, truncated or altered file, full disk); the message
    names the file or path."""


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_gather(group, obj: Any) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


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


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``path`` through ``path.tmp`` + rename, so that readers see the old or the new content; a failed
    write removes the ``.tmp`` and leaves ``path`` as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_share(group, directory: Path, names: list[str]) -> dict[str, str]:
    """Content hashes of ``names`` under ``directory``, each rank of ``group`` hashing every k-th file."""
    rank, world = _rank(group), (dist.get_world_size(group) if group is not None else 1)
    try:
        mine, err = {n: _file_hash(directory / n) for n in names[rank::world]}, None
    except OSError as e:  # e.g. a file that vanished: every rank raises it, none waits for this one
        mine, err = {}, CheckpointError(f"cannot read checkpoint file {e.filename}: {e.strerror}")
    parts = _all_gather(group, (mine, err))
    errors = [e for _, e in parts if e is not None]
    if errors:
        raise errors[0]
    return {k: v for part, _ in parts for k, v in part.items()}


def _state_bytes(group, state: dict) -> int:
    """Bytes of the tensors a checkpoint of ``state`` holds (sharded tensors at their global size, keys that
    several ranks hold counted once)."""
    sizes = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, torch.Tensor):  # a DTensor's numel is its global one
            sizes[prefix] = obj.numel() * obj.element_size()

    walk("", state)
    merged = {}
    for part in _all_gather(group, sizes):
        merged.update(part)
    return sum(merged.values())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _no_space(path: Path, needed: int, where: str = "") -> CheckpointError:
    free = shutil.disk_usage(path).free if path.exists() else shutil.disk_usage(path.parent).free
    return CheckpointError(
        f"no space left on device for checkpoint {path}: it needs about {needed} bytes ({_mib(needed)}), "
        f"{free} bytes ({_mib(free)}) free there; the partial save was removed{where}"
    )


def _first_failure(err: BaseException) -> BaseException:
    """A rank's own exception inside DCP's CheckpointException (which wraps every rank's failure)."""
    if isinstance(err, CheckpointException) and err.failures:
        return _first_failure(next(iter(err.failures.values()))[0])
    return err


def _disk_full(err: BaseException, root: Path) -> bool:
    """The save failed for want of space: ENOSPC/EDQUOT, or any failure while the filesystem is full (DCP
    torch.saves into its file stream, and a short write there surfaces as a RuntimeError without errno)."""
    e = _first_failure(err)
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    try:
        return shutil.disk_usage(root).free < _FULL
    except OSError:
        return False


def _raise_any(group, err: BaseException | None) -> None:
    """Collective: every rank raises the first rank's error (so that no rank waits for a failed one)."""
    errors = [e for e in _all_gather(group, err) if e is not None]
    if errors:
        raise errors[0]


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through Python's file I/O, so that a full disk is an OSError (ENOSPC), not a RuntimeError."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getbuffer())


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


def _dcp_kwargs(group) -> dict:
    return {"process_group": group, "no_dist": group is None}


@contextlib.contextmanager
def _quiet_single_process(group):
    """DCP warns that it 'assumes a single process' without a process group; that is the intent here."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to (save|load) in a single process"
            )
        yield


# ----------------------------------------------------------------------------------------------------------------
# save / verify / load
# ----------------------------------------------------------------------------------------------------------------


def save_checkpoint(
    engine: TrainEngine, root: str | os.PathLike, *, step: int | None = None, extra: dict | None = None
) -> str:
    """Save the engine's state, the RNG states and ``extra`` to ``root/step_<step>`` atomically.

    Collective over ``engine.checkpoint_group()`` (every rank calls it). ``step`` defaults to the engine's
    global step. Returns the final directory. On any failure the partial ``step_<step>.tmp`` is removed, an
    existing ``step_<step>`` is kept, and every rank raises (`CheckpointError` for a full disk)."""
    root = Path(root)
    step = engine.global_step if step is None else step
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    group = engine.checkpoint_group()
    if group is None and du.rank() != 0:
        return str(final)  # unsharded replicas: rank 0 writes for all
    rank = _rank(group)
    state = engine.state_dict()
    needed = _state_bytes(group, state)
    try:
        err = None
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                if shutil.disk_usage(root).free < needed:
                    err = _no_space(tmp, needed)
                else:
                    tmp.mkdir()
            except OSError as e:
                err = e
        _raise_any(group, err)
        with _quiet_single_process(group):
            dcp.save(state, checkpoint_id=str(tmp / MODEL_OPTIM_DIR), **_dcp_kwargs(group))
        err = None
        try:
            _torch_save(_rng_state(), tmp / f"rng_rank{rank}.pt")
            if rank == 0:
                _torch_save(
                    {
                        "format_version": FORMAT_VERSION,
                        "layout": engine.checkpoint_layout(),
                        "ranks": dist.get_world_size(group) if group is not None else 1,
                        "extra": extra or {},
                    },
                    tmp / ENGINE_STATE,
                )
        except OSError as e:
            err = e
        _raise_any(group, err)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        hashes = _hash_share(group, tmp, names)
        err = None
        if rank == 0:
            try:
                files = {n: {"size": (tmp / n).stat().st_size, HASH: hashes[n]} for n in names}
                manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files}
                write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
                _replace_dir(tmp, final)
                _fsync_dir(root)
            except OSError as e:
                err = e
        _raise_any(group, err)
    except BaseException as e:
        full = not isinstance(e, CheckpointError) and _disk_full(e, root)  # before the cleanup frees space
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _first_failure(e)
        if full:
            raise _no_space(tmp, needed, f" ({type(cause).__name__}: {cause})") from None
        if isinstance(e, CheckpointException):  # a BaseException: keep it from passing `except Exception`
            raise CheckpointError(f"could not save {tmp / MODEL_OPTIM_DIR}: {cause!r}") from e
        raise
    return str(final)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is in place."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old)


def _manifest(path: Path) -> dict:
    if not path.is_dir():
        unfinished = path.with_name(path.name + ".tmp").exists()
        hint = " (an unfinished save left only a .tmp directory)" if unfinished else ""
        raise CheckpointError(f"checkpoint directory {path} does not exist{hint}")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: missing file {manifest_path}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"corrupt checkpoint manifest {manifest_path}: {e!r}") from e
    if manifest.get("format_version") == 2:  # format 1 is refused below: it has no content hashes
        raise CheckpointError(
            f"checkpoint {path} was saved by an older hyflow (checkpoint format 2: engine step counters outside "
            f"the DCP state); this hyflow reads format {FORMAT_VERSION}"
        )
    for rel, entry in files.items():
        f = path / rel
        if not isinstance(entry, dict) or HASH not in entry:
            raise CheckpointError(
                f"checkpoint {path} records no content hash for {f} (saved by an older hyflow, manifest "
                f"format {manifest.get('format_version', 1)}); it cannot be verified"
            )
        if not f.is_file():
            raise CheckpointError(f"incomplete checkpoint {path}: missing file {f}")
        actual = f.stat().st_size
        if actual != entry["size"]:
            raise CheckpointError(f"truncated checkpoint file {f}: {actual} bytes, expected {entry['size']}")
    return manifest


def verify_checkpoint(path: str | os.PathLike, group: dist.ProcessGroup | None = None) -> dict:
    """Check that ``path`` is a complete, unaltered checkpoint: every file of its manifest present with the
    recorded size and content hash. Returns the manifest; raises CheckpointError naming the first bad file
    and the step. Collective over ``group`` when given (the ranks share the hashing)."""
    path = Path(path)
    manifest, err = None, None
    try:
        manifest = _manifest(path)
    except CheckpointError as e:
        err = e
    _raise_any(group, err)
    assert manifest is not None  # _raise_any raised otherwise
    files = manifest["files"]
    hashes = _hash_share(group, path, sorted(files))
    for rel in sorted(files):
        if hashes[rel] != files[rel][HASH]:
            raise CheckpointError(
                f"checkpoint {path.name} (step {manifest['step']}) is damaged: {path / rel} changed after it "
                f"was saved (content hash {hashes[rel]}, recorded {files[rel][HASH]})"
            )
    return manifest


def load_checkpoint(engine: TrainEngine, path: str | os.PathLike) -> dict:
    """Restore ``engine`` from a checkpoint directory ``.../step_N`` after verifying it (nothing is loaded
    from a damaged checkpoint). Collective over ``engine.checkpoint_group()``. Returns the ``extra`` dict
    given at save time."""
    path = Path(path)
    group = engine.checkpoint_group()
    verify_checkpoint(path, group)
    es = torch.load(path / ENGINE_STATE, weights_only=False)
    layout = engine.checkpoint_layout()
    saved = es.get("layout", {})
    differ = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
    if differ:
        raise CheckpointError(
            f"checkpoint {path} does not fit this engine: "
            + ", ".join(f"{k}={s!r} in the checkpoint, {v!r} here" for k, (s, v) in differ.items())
        )
    state = engine.state_dict()
    try:
        with _quiet_single_process(group):
            dcp.load(state, checkpoint_id=str(path / MODEL_OPTIM_DIR), **_dcp_kwargs(group))
    except (Exception, CheckpointException) as e:  # DCP errors rarely say which directory
        raise CheckpointError(f"could not load {path / MODEL_OPTIM_DIR}: {e}") from e
    engine.load_state_dict(state)
    rng_file = path / f"rng_rank{_rank(group)}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif es["ranks"] == (dist.get_world_size(group) if group is not None else 1):
        raise CheckpointError(f"incomplete checkpoint {path}: missing file {rng_file}")
    return es["extra"]


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face export
# ----------------------------------------------------------------------------------------------------------------


def servable_generation_config(config):
    """A copy of a Hugging Face ``GenerationConfig`` that serving engines accept as sampling defaults: HF reads
    ``top_k=0`` as "no top-k", SGLang's server refuses it (``top_k must be -1 (disable) or at least 1``) on every
    request, so 0 is written as absent, which both read as off."""
    config = copy.deepcopy(config)
    if getattr(config, "top_k", None) == 0:
        config.top_k = None
    return config


def export_hf(
    engine: TrainEngine,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> str | None:
    """Write the full model as a Hugging Face directory (safetensors + config [+ generation config, tokenizer])
    that ``AutoModelForCausalLM.from_pretrained`` (critics: ``AutoModelForTokenClassification``) loads; with
    LoRA the adapters merged in, and the adapter alone in ``adapter/`` (``PeftModel.from_pretrained`` on the base
    model). Collective over the engine's ranks; rank 0 writes. Returns the directory on rank 0, None elsewhere."""
    out = Path(out_dir)
    writer = du.rank() == 0
    tensors = {}
    for name, t in engine.full_state_dict_iter(device="cpu", dtype=dtype):
        if writer:
            tensors[name] = t.contiguous().clone()
    # LoRA: the merged model above, and the adapter alone in adapter/
    lora_engine = cast(LoRATrainEngine, engine) if engine.supports_lora else None
    lora = None if lora_engine is None else lora_engine.lora
    adapter = {}
    if lora_engine is not None and lora is not None:
        for name, t in lora_engine.adapter_state_iter(device="cpu", dtype=dtype):
            if writer:
                adapter[name] = t.contiguous().clone()
    group = engine.checkpoint_group()
    if not writer:
        if group is not None:
            dist.barrier(group=group)
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
    config = engine.hf_config.__class__.from_dict(engine.hf_config.to_dict())
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(tmp)
    cfg_json = json.loads((tmp / "config.json").read_text())
    cfg_json.pop("_attn_implementation", None)
    cfg_json.pop("attn_implementation", None)
    (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    if engine.generation_config is not None:
        servable_generation_config(engine.generation_config).save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if lora is not None:
        write_peft_adapter(tmp / ADAPTER_DIR, adapter, lora, engine.config.model_path)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    if group is not None:
        dist.barrier(group=group)
    return str(out)
