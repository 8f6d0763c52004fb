"""Data plumbing for the recipes: resumable prompt batches, fixed validation batches, SFT batches.

Prompt batches come from ``recipes.data.PromptDataLoader`` (shuffled per ``(data.seed, epoch)``, with
deterministic ``uid``s), so ``loader.state_dict()`` saved in a checkpoint resumes with exactly the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from dataproto import DataProto
from recipes.config import ConfigError
from recipes.data import PromptDataLoader, PromptDataset, SFTDataset, to_dataproto
from recipes.data.loader import ResumableLoader
from recipes.data.prompts import UnknownDataSourceError, UnknownEnvNameError
from recipes.sections import RecipeConfig
from workers.reward import SCORERS
from workers.rollout.batch import RolloutRow, build_rollout_batch


def scored_data_sources(cfg: RecipeConfig) -> set[str] | None:
    """The data sources the reward worker can score; None: all of them (a custom function or default scorer)."""
    if cfg.custom_reward_function.path or cfg.reward.default_scorer:
        return None
    return set(SCORERS)


def env_names(cfg: RecipeConfig) -> tuple[str, ...] | None:
    """The values a row's ``env_name`` may hold (``env.env_names()``); None: a recipe without an agent env."""
    env = getattr(cfg, "env", None)
    return None if env is None else tuple(env.env_names())


def prompt_dataset(cfg: RecipeConfig, run, files: list[str], max_samples: int | None) -> PromptDataset:
    """Prompts of ``files``; a row no reward scorer covers is an error naming file and row, or skipped
    (``data.unknown_data_source``), and a row whose ``env_name`` is none of the agent env's (``env.env_names()``:
    a mixed env's ``env.envs``, or ``""`` / ``env.loop``) an error naming file, row and the known names -- here
    at load time, before Ray starts, rather than at the step that samples it."""
    d = cfg.data
    try:
        return PromptDataset(
            files,
            run.tokenizer,
            max_prompt_length=d.max_prompt_length,
            prompt_key=d.prompt_key,
            max_samples=max_samples,
            data_sources=scored_data_sources(cfg),
            unknown_data_source=d.unknown_data_source,
            env_names=env_names(cfg),
        )
    except (UnknownDataSourceError, UnknownEnvNameError) as err:
        raise ConfigError(str(err)) from None


def train_loader(cfg: RecipeConfig, run, pad_to_max_length: bool = False) -> PromptDataLoader:
    """``pad_to_max_length``: every prompt batch ``data.max_prompt_length`` wide, so prompts of different
    batches stack (an asynchronous rollout stream regroups them)."""
    d = cfg.data
    ds = prompt_dataset(cfg, run, run.train_files, d.train_max_samples)
    return PromptDataLoader(
        ds,
        batch_size=d.train_batch_size,
        shuffle=d.shuffle,
        seed=d.seed,
        drop_last=True,
        pad_to_max_length=pad_to_max_length,
    )


def val_batches(cfg: RecipeConfig, run) -> list[DataProto]:
    """The held-out prompts in file order, in batches of data.val_batch_size (None: one batch)."""
    d = cfg.data
    ds = prompt_dataset(cfg, run, run.val_files, d.val_max_samples)
    size = d.val_batch_size or len(ds)
    loader = PromptDataLoader(ds, batch_size=min(size, len(ds)), shuffle=False, seed=d.seed, drop_last=False)
    return [to_dataproto(b) for b in loader]


def total_steps(cfg: RecipeConfig, loader: PromptDataLoader) -> int:
    t = cfg.trainer
    return t.total_training_steps if t.total_training_steps is not None else t.total_epochs * len(loader)


def prompt_batches(loader: PromptDataLoader) -> Iterator[DataProto]:
    """Batches forever, epoch after epoch, from the loader's current position (resumable)."""
    while True:
        for batch in loader:
            yield to_dataproto(batch)


# ----------------------------------------------------------------------------------------------------------------
# SFT warm start: (prompt, solution) pairs laid out like a rollout (dataproto/BATCH_LAYOUT.md)
# ----------------------------------------------------------------------------------------------------------------


SFT_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def collate_sft_layout(items: list[tuple[list[int], list[int]]], pad_token_id: int) -> DataProto:
    """(prompt, solution + EOS) pairs as a rollout batch (``build_rollout_batch``, the one builder of the layout):
    left-padded ``prompts``, right-padded ``responses``, ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``response_mask`` -- what ``ActorWorker.sft_step`` trains on."""
    tensors = build_rollout_batch([RolloutRow(p, a) for p, a in items], pad_token_id=pad_token_id)
    return DataProto.from_dict({k: tensors[k] for k in SFT_KEYS})


def sft_loader(cfg, run) -> ResumableLoader:
    """Shuffled batches of the training split's demonstrations (``extra_info.solution``) in the rollout layout."""
    s = cfg.sft
    ds = SFTDataset(
        run.train_files,
        run.tokenizer,
        max_length=s.max_length,
        prompt_key=cfg.data.prompt_key,
        max_samples=s.max_samples,
    )
    pad = run.tokenizer.pad_token_id
    return ResumableLoader(
        ds,
        batch_size=min(s.batch_size, len(ds)),
        collate=lambda items, epoch, rows: collate_sft_layout(items, pad),
        shuffle=s.shuffle,
        seed=s.seed,
        drop_last=True,
    )


def sft_batches(loader: ResumableLoader) -> Iterator[DataProto]:
    while True:
        yield from loader
