"""RL prompt dataset and batches laid out as dataproto/BATCH_LAYOUT.md describes."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Collection, Sequence

import numpy as np
import torch

from dataproto import DataProto, position_ids
from recipes.data.loader import ResumableLoader
from recipes.data.reading import read_rows, render_prompt, tokenize_texts

logger = logging.getLogger("recipes.data")

_UID_NAMESPACE = uuid.UUID("6f1c1f0e-2a59-4d55-9a8e-6b7c3c0a9d11")
NON_TENSOR_KEYS = ("data_source", "reward_model", "extra_info", "raw_prompt", "data_row", "uid", "env_name")


def object_array(values: list) -> np.ndarray:
    """A 1-D numpy object array holding ``values`` as they are (lists/dicts are not expanded)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


class UnknownDataSourceError(ValueError):
    """A row's ``data_source`` is not one the reward can score (raised at load time, naming file and row)."""


class UnknownEnvNameError(ValueError):
    """A row's ``env_name`` is not one of the config's environments (raised at load time, naming file and row)."""


class PromptDataset:
    """Tokenised RL prompts from verl-format parquet files.

    Every row's ``prompt`` messages go through the tokenizer's chat template with the generation
    prompt appended, and are tokenised without extra special tokens. Malformed rows are skipped with
    a warning naming the file and row (see ``read_rows``); prompts longer than ``max_prompt_length``
    tokens are dropped (``overlong="filter"``, the count is logged and kept in
    ``num_filtered_overlong``) or raise (``overlong="error"``). With ``data_sources`` (those the reward can
    score), a row whose ``data_source`` is not among them raises UnknownDataSourceError naming its file and
    row (``unknown_data_source="error"``) or is dropped and counted in ``num_unknown_data_source`` ("skip").
    With ``env_names`` (the agent env's ``env.env_names()``), a row whose ``env_name`` column (a missing value:
    ``""``) is not among them raises UnknownEnvNameError naming its file and row; a dataset with that column
    hands it on as the non-tensor ``env_name`` (the environment that runs the row, ``workers.agents.mixed``).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        max_prompt_length: int = 512,
        prompt_key: str = "prompt",
        overlong: str = "filter",
        require_ground_truth: bool = True,
        max_samples: int | None = None,
        data_sources: Collection[str] | None = None,
        unknown_data_source: str = "error",
        env_names: Collection[str] | None = None,
    ):
        if overlong not in ("filter", "error"):
            raise ValueError(f"overlong must be 'filter' or 'error', got {overlong!r}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        rows, self.num_malformed = read_rows(files, prompt_key, require_ground_truth=require_ground_truth)
        if max_samples is not None:
            rows = rows[:max_samples]
        rows, self.num_unknown_data_source = _known_sources_only(rows, data_sources, unknown_data_source)
        self.has_env_name = any("env_name" in r for r in rows)
        if env_names is not None:
            _check_env_names(rows, env_names)
        ids = tokenize_texts(tokenizer, [render_prompt(tokenizer, r[prompt_key]) for r in rows])
        self.rows: list[dict] = []
        self.num_filtered_overlong = 0
        for row, toks in zip(rows, ids):
            if len(toks) > max_prompt_length:
                if overlong == "error":
                    raise ValueError(
                        f"row {row['_row']} of {row['_file']}: prompt has {len(toks)} tokens, "
                        f"more than max_prompt_length={max_prompt_length}"
                    )
                self.num_filtered_overlong += 1
                continue
            row["input_ids"] = toks
            self.rows.append(row)
        if self.num_filtered_overlong:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_filtered_overlong,
                len(rows),
                max_prompt_length,
            )
        if not self.rows:
            raise ValueError(f"no usable prompts in {files}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        r = self.rows[i]
        item = {
            "input_ids": r["input_ids"],
            "raw_prompt": r[self.prompt_key],
            "data_source": r["data_source"],
            "reward_model": r.get("reward_model"),
            "extra_info": r.get("extra_info"),
            "data_row": f"row {r['_row']} of {r['_file']}",  # where later errors point (file rows, not batch rows)
        }
        if self.has_env_name:
            item["env_name"] = env_name_of(r)
        return item


def env_name_of(row: dict) -> str:
    """A row's ``env_name``: ``""`` when the column or the value is missing."""
    name = row.get("env_name")
    return name if isinstance(name, str) else ""


def _check_env_names(rows: list[dict], known: Collection[str]) -> None:
    bad = [r for r in rows if env_name_of(r) not in known]
    if bad:
        first = bad[0]
        raise UnknownEnvNameError(
            _env_name_error(first["_file"], first["_row"], env_name_of(first), len(bad), known)
        )


def _env_name_error(path: str, row: int, name: str, count: int, known: Collection[str]) -> str:
    unnamed = "" if "" in known else '; a row without one is refused too (env.default is "")'
    return (
        f"row {row} of {path}: env_name {name!r} is not one of the config's environments "
        f"{sorted(n for n in known if n)} ({count} such row(s) in all{unnamed}); name them in env.envs "
        "(env.loop: mixed, docs/agent_env.md)"
    )


def check_env_names(files: str | os.PathLike | Sequence[str | os.PathLike], known: Collection[str]) -> None:
    """The ``env_name`` column of the parquet ``files`` (only that column is read; files that do not exist are
    left to the loader) against ``known``: UnknownEnvNameError naming the file and row of the first bad one, as
    `PromptDataset` does at load time -- for a check before the run starts (``recipes.schemas``)."""
    import pyarrow.parquet as pq

    for path in (
        [os.fspath(files)] if isinstance(files, (str, os.PathLike)) else [os.fspath(f) for f in files]
    ):
        if not os.path.isfile(path):
            continue
        if "env_name" in pq.read_schema(path).names:
            names = [
                n if isinstance(n, str) else ""
                for n in pq.read_table(path, columns=["env_name"])[0].to_pylist()
            ]
        else:
            names = [""] * pq.read_metadata(path).num_rows
        bad = [i for i, n in enumerate(names) if n not in known]
        if bad:
            raise UnknownEnvNameError(_env_name_error(path, bad[0], names[bad[0]], len(bad), known))


def _known_sources_only(
    rows: list[dict], known: Collection[str] | None, on_unknown: str
) -> tuple[list[dict], int]:
    if known is None:
        return rows, 0
    if on_unknown not in ("error", "skip"):
        raise ValueError(f"unknown_data_source must be 'error' or 'skip', got {on_unknown!r}")
    bad = [r for r in rows if r["data_source"] not in known]
    if not bad:
        return rows, 0
    first = bad[0]
    if on_unknown == "error":
        raise UnknownDataSourceError(
            f"row {first['_row']} of {first['_file']}: data_source {first['data_source']!r} has no reward "
            f"scorer ({len(bad)} such row(s) in all; scorers: {sorted(known)}); set reward.default_scorer or "
            "custom_reward_function.path, or data.unknown_data_source=skip to drop these rows"
        )
    logger.warning(
        "skipped %d rows whose data_source has no reward scorer (first: row %d of %s, %r)",
        len(bad),
        first["_row"],
        first["_file"],
        first["data_source"],
    )
    return [r for r in rows if r["data_source"] in known], len(bad)


def collate_prompts(
    items: list[dict], pad_token_id: int, pad_to: int | None = None, uids: list[str] | None = None
) -> dict:
    """Left-pad prompts into ``{"tensors", "non_tensors", "meta_info"}`` (the DataProto parts).

    Tensors: ``input_ids``, ``attention_mask`` (int64, [B, P]) and ``position_ids =
    clamp(cumsum(attention_mask) - 1, min=0)``; P is the longest prompt, or ``pad_to``. Non-tensors
    (numpy object arrays): ``data_source``, ``reward_model``, ``extra_info``, ``raw_prompt``, ``uid`` and, for
    items that carry it, ``data_row`` ("row 11 of train.parquet": the item's file and row there) and ``env_name``
    (``""`` for an item without one).
    """
    width = max(len(it["input_ids"]) for it in items)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({width} tokens)")
        width = pad_to
    b = len(items)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        input_ids[i, width - n :] = torch.tensor(it["input_ids"], dtype=torch.long)
        attention_mask[i, width - n :] = 1
    if uids is None:
        uids = [str(uuid.uuid4()) for _ in items]
    non_tensors = {
        "data_source": object_array([it["data_source"] for it in items]),
        "reward_model": object_array([it["reward_model"] for it in items]),
        "extra_info": object_array([it["extra_info"] for it in items]),
        "raw_prompt": object_array([it["raw_prompt"] for it in items]),
        "uid": object_array(list(uids)),
    }
    if all("data_row" in it for it in items):
        non_tensors["data_row"] = object_array([it["data_row"] for it in items])
    if any("env_name" in it for it in items):
        non_tensors["env_name"] = object_array([it.get("env_name", "") for it in items])
    return {
        "tensors": {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
        },
        "non_tensors": non_tensors,
        "meta_info": {},
    }


class PromptDataLoader(ResumableLoader):
    """Shuffled (by ``seed`` and epoch), resumable batches of ``collate_prompts`` dicts.

    ``uid`` is deterministic: derived from ``(seed, epoch, dataset row)``, so a resumed run hands out
    the same uids as the original one.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_to_max_length: bool = False,
        pad_token_id: int | None = None,
    ):
        pad = dataset.tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None:
            raise ValueError("the tokenizer has no pad token; pass pad_token_id")
        pad_to = dataset.max_prompt_length if pad_to_max_length else None

        def collate(items, epoch, rows):
            uids = [str(uuid.uuid5(_UID_NAMESPACE, f"{seed}/{epoch}/{r}")) for r in rows]
            return collate_prompts(items, pad, pad_to=pad_to, uids=uids)

        super().__init__(dataset, batch_size, collate, shuffle=shuffle, seed=seed, drop_last=drop_last)


def to_dataproto(batch: dict):
    """Build a ``DataProto`` from a ``collate_prompts`` dict."""
    return DataProto.from_dict(batch["tensors"], batch["non_tensors"], batch["meta_info"])
