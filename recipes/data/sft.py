"""SFT warm-start data: chat-templated prompt + solution text, loss on the solution tokens only."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from recipes.data.loader import ResumableLoader
from recipes.data.reading import read_rows, render_prompt, tokenize_texts

logger = logging.getLogger("recipes.data")

IGNORE_INDEX = -100


class SFTDataset:
    """(prompt ids, response ids) pairs; the response is ``extra_info[response_key]`` + EOS.

    The prompt is rendered exactly as ``PromptDataset`` renders it for RL (chat template with the
    generation prompt), so the warm-started policy sees the same context at rollout time. The
    response is tokenised separately and ends with the tokenizer's EOS token (``<|im_end|>`` for
    the tiny model), which teaches the model to stop. Pairs longer than ``max_length`` in total are
    dropped and counted (``num_filtered_overlong``); malformed rows are skipped with a warning.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        max_length: int = 512,
        prompt_key: str = "prompt",
        response_key: str = "solution",
        max_samples: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.max_length = max_length
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos token")
        rows, self.num_malformed = read_rows(
            files, prompt_key, require_ground_truth=False, required_extra=(response_key,)
        )
        if max_samples is not None:
            rows = rows[:max_samples]
        prompts = tokenize_texts(tokenizer, [render_prompt(tokenizer, r[prompt_key]) for r in rows])
        responses = tokenize_texts(tokenizer, [r["extra_info"][response_key] for r in rows])
        self.items: list[tuple[list[int], list[int]]] = []
        self.num_filtered_overlong = 0
        for p, a in zip(prompts, responses):
            a = a + [eos]
            if len(p) + len(a) > max_length:
                self.num_filtered_overlong += 1
                continue
            self.items.append((p, a))
        if self.num_filtered_overlong:
            logger.warning(
                "filtered %d of %d SFT examples longer than max_length=%d tokens",
                self.num_filtered_overlong,
                len(rows),
                max_length,
            )
        if not self.items:
            raise ValueError(f"no usable SFT examples in {files}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.items[i]


def collate_sft(items: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (prompt, response) pairs.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` ([B, L] int64), ``loss_mask``
    ([B, L] float32, 1 where ``input_ids[b, t]`` is a response token to be predicted -- the logits at
    ``t - 1`` are scored against it) and ``labels`` (``input_ids`` with -100 outside the response,
    ready for a Hugging Face causal-LM ``labels=`` argument, which shifts internally).
    """
    width = max(len(p) + len(a) for p, a in items)
    b = len(items)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.float32)
    for i, (p, a) in enumerate(items):
        seq = p + a
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
        loss_mask[i, len(p) : len(seq)] = 1.0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    labels = torch.where(loss_mask.bool(), input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "labels": labels,
    }


class SFTDataLoader(ResumableLoader):
    """Shuffled (by ``seed`` and epoch), resumable batches of ``collate_sft`` dicts."""

    def __init__(
        self,
        dataset: SFTDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_token_id: int | None = None,
    ):
        pad = dataset.tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None:
            raise ValueError("the tokenizer has no pad token; pass pad_token_id")
        super().__init__(
            dataset,
            batch_size,
            lambda items, epoch, rows: collate_sft(items, pad),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
