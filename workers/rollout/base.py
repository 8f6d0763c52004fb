"""The contract every rollout engine implements, and what it declares so that callers never ask for its class.

An engine is one class plus a config value: ``rollout.name`` is a registered name (``native``, ``sglang``) or
``"package.module:Class"`` (`workers.rollout.registry`). The workers build it with `RolloutEngine.from_config`
and use it only through this interface; what differs between engines is declared here as capabilities:

* ``device``: where its weights live (the trainer streams weights there);
* ``swaps_weights_mid_generation``: a weight update may land between two decode steps of a running generation
  (and can abort the requests that started on the old weights); otherwise weights change only between calls,
  so a concurrent receiver waits for the running generation to finish;
* ``accepts_tp_group``: it can be one tensor-parallel replica over a torch.distributed group of the trainer's
  ranks (the 3D-HybridEngine, ``rollout.tensor_model_parallel_size > 1``);
* ``loads_adapters``: it can load LoRA adapters on top of its base weights (``load_adapter``); the trainer then
  sends the adapter alone, else the weights with the adapter merged in;
* ``records_routes``: for a mixture-of-experts model it reports the experts it routed every position to
  (`GenerationOutput.routes`, the batch column ``routed_experts``), which rollout routing replay needs;
* ``event_loop``: the asyncio loop concurrent ``generate`` calls must run on (None: any loop);
* ``release_memory`` / ``resume_memory`` / ``flush_cache``: how it frees memory and drops state that is stale
  after a weight change.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dataproto import DataProto
from workers.rollout.sampling import GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from workers.config import ModelConfig, RolloutConfig


class RolloutEngine(ABC):
    """Generation for the controller (a batch of left-padded prompts) and for agents (one async request).

    Life cycle in a colocated RL step: ``resume_memory()`` -> ``update_weights(actor weights)`` ->
    ``generate_sequences`` / many concurrent ``generate`` calls -> ``release_memory()``.
    """

    swaps_weights_mid_generation: ClassVar[bool] = False
    accepts_tp_group: ClassVar[bool] = False
    loads_adapters: ClassVar[bool] = False
    records_routes: ClassVar[bool] = False
    # the policy version (the trainer's step) of the loaded weights; tokens record it. Callers only read it (it may
    # be a read-only property): the engine's own update_weights / load_adapter set it from their ``version``
    weight_version: int = 0

    @classmethod
    @abstractmethod
    def from_config(
        cls, model: ModelConfig, rollout: RolloutConfig, tokenizer: Any, *, rank: int = 0, tp_group=None
    ) -> RolloutEngine:
        """The engine of one rank, its weights read from ``model.path``. Sampling streams are seeded from
        ``(rollout.seed, rank)`` (`rollout_seed`) so that data-parallel ranks draw different samples;
        ``tp_group``: this rank's tensor-parallel group (only where ``accepts_tp_group``)."""

    @classmethod
    def config_errors(cls, model: ModelConfig, rollout: RolloutConfig) -> list[str]:
        """What is wrong with the config for this engine (e.g. a missing package), checked before Ray starts;
        each message names the key."""
        return []

    @classmethod
    def inference_options(cls) -> tuple[str, ...]:
        """The keyword options `for_inference` accepts."""
        return ()

    @classmethod
    def for_inference(cls, model_path: str, tokenizer: Any, **options: Any) -> RolloutEngine:
        """A standalone engine over a checkpoint, outside an RL run (``RLM(backend=<rollout name>,
        backend_kwargs={"model_name": path, **options})``)."""
        raise NotImplementedError(f"{cls.__name__} has no standalone inference mode (for_inference)")

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device its weights live on."""

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop concurrent ``generate`` calls must run on, or None where any loop will do."""
        return None

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded ``input_ids``/``attention_mask`` (+ sampling settings in ``meta_info``) -> the batch of
        ``dataproto/BATCH_LAYOUT.md``, built by `workers.rollout.batch.build_rollout_batch`; ``meta_info``
        gains ``eos_token_id`` and ``pad_token_id``."""

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
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        flush_cache: bool = True,
        abort_running: bool = False,
    ) -> Any:
        """Copy Hugging Face-named tensors (on ``device``; any dtype: the engine casts them) into the engine's
        weights; unknown names raise. ``version`` then becomes ``weight_version``. ``flush_cache``:
        call ``flush_cache()`` at the end (a caller loading one stream in several calls passes False and
        flushes once). ``abort_running`` (only where ``swaps_weights_mid_generation``): the requests that
        started on the old weights finish at the swap with ``finish_reason == "abort"``; the call then returns
        how many. Otherwise engine-defined statistics (or None)."""

    def load_adapter(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        scaling: float,
        version: int | None = None,
        abort_running: bool = False,
    ) -> Any:
        """(Only where ``loads_adapters``.) Put a LoRA adapter on the base weights the engine loaded, in place of
        the previous adapter: ``named_tensors`` are PEFT's adapter tensors (``...q_proj.lora_A.weight`` [r, in],
        ``...lora_B.weight`` [out, r]); each wrapped weight computes ``W + scaling * B @ A``. ``version`` and
        ``abort_running`` as in ``update_weights``, whose return value this shares. A later ``update_weights``
        sets a new base."""
        raise NotImplementedError(f"{type(self).__name__} does not load adapters (loads_adapters is False)")

    def flush_cache(self) -> None:  # noqa: B027 (optional: most engines keep nothing across weights)
        """Drop what is stale after a weight change (a prefix cache); nothing by default."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's weights under their Hugging Face names, for tests and debugging."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights (named_weights)")

    def shutdown(self) -> None:  # noqa: B027 (optional: an engine that started nothing stops nothing)
        """Stop what the engine started (threads, processes)."""


def rollout_dtype(model: ModelConfig, rollout: RolloutConfig) -> str:
    """The name of the rollout engine's weight and KV-cache dtype: ``rollout.dtype``, where ``auto`` is bfloat16
    on CUDA (what every peer samples in: half the weight and KV bytes that decode streams) and the training dtype
    (``model.dtype``) on CPU, where bfloat16 matmuls are slower than float32 ones."""
    from workers.distributed import default_device

    if rollout.dtype != "auto":
        return rollout.dtype
    return "bfloat16" if default_device().type == "cuda" else model.dtype


def rollout_seed(rollout: RolloutConfig, rank: int) -> int:
    """The sampling seed of ``rank``'s engine: distinct per rank, fixed by ``rollout.seed``."""
    return rollout.seed * 1_000_003 + rank
