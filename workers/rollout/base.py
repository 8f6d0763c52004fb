"""The interface every rollout engine (native torch engine, SGLang adapter) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from dataproto import DataProto
from workers.rollout.sampling import GenerationOutput, SamplingParams


class RolloutEngine(ABC):
    """Generation for the controller (a batch of left-padded prompts) and for agents (one async request).

    Life cycle in a colocated RL step: ``resume_memory()`` -> ``update_weights(actor weights)`` ->
    ``generate_sequences`` / many concurrent ``generate`` calls -> ``release_memory()``.
    """

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded ``input_ids``/``attention_mask``/``position_ids`` (+ sampling settings in ``meta_info``)
        -> ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``,
        ``rollout_log_probs`` as laid out in ``dataproto/BATCH_LAYOUT.md``."""

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput | list[GenerationOutput]:
        """One request; concurrent calls are batched together. A list of ``n`` outputs when
        ``sampling_params.n > 1``, else one output."""

    @abstractmethod
    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache (and the weights when ``weights``) between rollouts."""

    @abstractmethod
    def resume_memory(self, kv_cache: bool = True) -> None:
        """Re-allocate released weights (to be refilled by ``update_weights``) and, when ``kv_cache``,
        the KV cache (else it comes back lazily / on a later call)."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the engine's weights in place; unknown names raise."""
