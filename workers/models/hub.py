"""A model given as a local folder or as a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``).

    model_path_problem("Qwen/Qwen2.5-0.5B-Instruct", "model.path")   # None, or why it cannot be used (the check)
    resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", "model.path")   # the local folder; downloads once

A path that exists is a local folder. Otherwise a value shaped like a Hub id (``org/name``) is looked up in the
Hub's cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``) and, unless ``HF_HUB_OFFLINE`` is set,
downloaded into it once by ``huggingface_hub.snapshot_download``; the workers then load the cached snapshot
folder. Whichever it is, the folder must hold a model: ``config.json`` and the tokenizer's files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# the tokenizer files of a Hugging Face checkpoint (or a *.tiktoken file): any one lets AutoTokenizer find one
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
MODEL_FOLDER = (
    "a model folder (a Hugging Face checkpoint) holds config.json, the weights (model.safetensors or "
    "pytorch_model.bin, or their shards) and the tokenizer files (tokenizer.json or tokenizer_config.json with its "
    "vocabulary)"
)
# what a download skips: other frameworks' weights and the original (non-HF) checkpoints some repositories carry
IGNORE_PATTERNS = ["*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "original/*", "onnx/*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelPathError(ValueError):
    """The model path is neither a usable local folder nor a Hub id that can be fetched; the message says why."""


def is_hub_id(path: str) -> bool:
    """Whether ``path`` has a Hub repository id's shape, ``org/name`` (a path that exists is a folder first)."""
    return bool(_HUB_ID.match(path)) and ".." not in path and not path.endswith((".", "-"))


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (read now, not when huggingface_hub was imported)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").upper()
    return constants.HF_HUB_OFFLINE or value in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> str:
    """The Hub's cache folder: ``HF_HUB_CACHE`` (read now), else huggingface_hub's own default."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id``'s cached snapshot (its ``main`` revision), or None when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, an invalid id, a damaged cache entry: none to use
        return None


def model_folder_problem(folder: Path, key: str, need_tokenizer: bool = True) -> str | None:
    """Why ``folder`` is no model folder (naming ``key``, the folder and what is missing), or None."""
    if not folder.is_dir():
        return f"{key}={str(folder)!r} is a file, not a model folder; {MODEL_FOLDER}"
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if need_tokenizer and not (
        any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))
    ):
        missing.append("tokenizer files")
    if not missing:
        return None
    return (
        f"{key}={str(folder)!r} is not a model folder: it has no {' and no '.join(missing)}; {MODEL_FOLDER}"
    )


def _fetch_hint(repo_id: str, key: str) -> str:
    return (
        f"fetch it with `hf download {repo_id}` (`huggingface-cli download` before huggingface_hub 1.0) where the "
        f"Hub is reachable, into this HF_HUB_CACHE, or set {key} to a local model folder"
    )


def model_path_problem(path: str, key: str, need_tokenizer: bool = True) -> str | None:
    """Why ``path`` (the value of config key ``key``) cannot be the model, or None; reads only the disk and the
    Hub's cache. A Hub id not yet cached is no problem while downloads are allowed (``resolve_model_path``
    fetches it)."""
    local = Path(path).expanduser()
    if local.exists():
        return model_folder_problem(local, key, need_tokenizer)
    if not is_hub_id(path):
        return f"{key}={path!r} does not exist"
    snapshot = cached_snapshot(path)
    if snapshot is not None:
        return model_folder_problem(Path(snapshot), key, need_tokenizer)
    if hub_offline():
        return (
            f"{key}={path!r} is not a local folder, and as a Hugging Face Hub id it is not in the Hugging Face Hub "
            f"cache ({hub_cache_dir()}) while HF_HUB_OFFLINE is set: {_fetch_hint(path, key)}"
        )
    return None


def resolve_model_path(path: str, key: str, need_tokenizer: bool = True) -> str:
    """The local folder of ``path``: itself, or the Hub id's snapshot in the Hub's cache (downloaded there once
    unless ``HF_HUB_OFFLINE``); ModelPathError saying why not and how to fetch the model."""
    problem = model_path_problem(path, key, need_tokenizer)
    if problem is not None:
        raise ModelPathError(problem)
    local = Path(path).expanduser()
    if local.exists():
        return str(local)
    snapshot = cached_snapshot(path)
    if snapshot is None:
        from huggingface_hub import snapshot_download

        print(f"[hyflow] {key}={path}: downloading from the Hugging Face Hub into {hub_cache_dir()} (once)")
        try:
            snapshot = str(
                snapshot_download(path, cache_dir=hub_cache_dir(), ignore_patterns=IGNORE_PATTERNS)
            )
        except Exception as err:  # no network, no such repository, a gated one without a token
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelPathError(
                f"{key}={path!r} is not a local folder, and downloading it from the Hugging Face Hub failed "
                f"({type(err).__name__}: {reason}): {_fetch_hint(path, key)}"
            ) from None
    problem = model_folder_problem(Path(snapshot), key, need_tokenizer)
    if problem is not None:
        raise ModelPathError(problem)
    return snapshot
