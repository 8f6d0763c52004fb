"""SFT warm-start data: chat-templated prompt + solution text, loss on the solution tokens only."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from recipes.data.reading import read_rows, render_prompt, tokenize_texts

logger = logging.getLogger("recipes.data")


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
