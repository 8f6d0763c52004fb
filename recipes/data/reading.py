"""Read verl-format parquet rows, validate them, and render prompts with the chat template."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("recipes.data")

MAX_ROW_WARNINGS = 20  # per file; the rest are only counted


def _as_list(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    out = [os.fspath(f) for f in files]
    if not out:
        raise ValueError("no data files given")
    return out


def validate_messages(prompt: Any) -> str | None:
    """Why ``prompt`` is not a usable list of chat messages, or None when it is."""
    if prompt is None:
        return "prompt is missing"
    if not isinstance(prompt, list):
        return f"prompt must be a list of chat messages, got {type(prompt).__name__}"
    if not prompt:
        return "prompt is an empty list"
    for k, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            return f"prompt message {k} is a {type(msg).__name__}, not a dict"
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            return f"prompt message {k} has no role"
        if not isinstance(msg.get("content"), str):
            return f"prompt message {k} has no text content"
    if not any(m["content"].strip() for m in prompt):
        return "prompt has only empty messages"
    return None


def read_rows(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    prompt_key: str = "prompt",
    require_ground_truth: bool = True,
    required_extra: Sequence[str] = (),
) -> tuple[list[dict], int]:
    """Rows of the parquet ``files`` that are well-formed, and the number skipped.

    A row is skipped, with a warning naming its file and row number, when its prompt is missing,
    empty or not a list of ``{"role", "content"}`` messages, when ``data_source`` is not a non-empty
    string, when ``require_ground_truth`` and ``reward_model["ground_truth"]`` is missing, or when
    a key in ``required_extra`` is missing from ``extra_info``. Each kept row gets ``_file`` and
    ``_row`` (its position in that file).
    """
    import pyarrow.parquet as pq

    kept: list[dict] = []
    skipped = 0
    for path in _as_list(files):
        table = pq.read_table(path)
        if prompt_key not in table.column_names:
            raise ValueError(f"{path}: no column {prompt_key!r} (columns: {table.column_names})")
        warned = 0
        file_skipped = 0
        for i, row in enumerate(table.to_pylist()):
            reason = _row_problem(row, prompt_key, require_ground_truth, required_extra)
            if reason is not None:
                file_skipped += 1
                if warned < MAX_ROW_WARNINGS:
                    logger.warning("skipping row %d of %s: %s", i, path, reason)
                    warned += 1
                continue
            row["_file"], row["_row"] = path, i
            kept.append(row)
        if file_skipped > warned:
            logger.warning("skipped %d malformed rows of %s in all (%d shown)", file_skipped, path, warned)
        skipped += file_skipped
    return kept, skipped


def _row_problem(row: dict, prompt_key: str, require_ground_truth: bool, required_extra: Sequence[str]):
    reason = validate_messages(row.get(prompt_key))
    if reason is not None:
        return reason
    ds = row.get("data_source")
    if not isinstance(ds, str) or not ds:
        return "data_source is missing or empty"
    if require_ground_truth:
        rm = row.get("reward_model")
        if not isinstance(rm, dict) or rm.get("ground_truth") is None:
            return "reward_model.ground_truth is missing"
    if required_extra:
        extra = row.get("extra_info")
        if not isinstance(extra, dict):
            return "extra_info is missing"
        for key in required_extra:
            v = extra.get(key)
            if v is None or (isinstance(v, str) and not v.strip()):
                return f"extra_info.{key} is missing or empty"
    return None


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The chat-templated prompt text ending with the assistant generation header."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in msgs) + "\n"


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
