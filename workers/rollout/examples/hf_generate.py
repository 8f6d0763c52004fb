"""A rollout engine over Hugging Face ``generate``: the whole `RolloutEngine` contract in one file.

It serves any causal LM transformers loads (architectures the native engine does not implement, remote code), at
the speed of HF ``generate``: one call per batch, no KV cache kept between calls, no continuous batching. Choose it
with ``rollout.name=workers.rollout.examples.hf_generate:HFGenerateEngine``; copy it to write your own engine
(docs/rollout_engines.md). ``tests/recipes/test_rollout_engine_contract.py`` trains ``recipes.grpo`` on it in both
placements, weight sync included.

What it declares: weights change only between calls (``swaps_weights_mid_generation = False``: a concurrent
receiver waits for the running generation), no tensor-parallel replicas, no adapters, any event loop. Limits:
one sampling seed per call (``seed`` of the call's first row, else the engine's seed stream), no stop strings,
``release_memory(weights=True)`` refused (it keeps its weights).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import torch
from transformers import GenerationConfig

from dataproto import DataProto
from workers.models import load_model, pad_token_id_of
from workers.rollout.base import RolloutEngine, rollout_dtype, rollout_seed
from workers.rollout.batch import prompt_rows, rollout_dataproto
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta, token_id_list


class HFGenerateEngine(RolloutEngine):
    """``model.generate`` behind the rollout contract."""

    def __init__(self, model, tokenizer, *, response_length: int, sampling: SamplingParams, seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id_of(tokenizer, model.config)
        eos = token_id_list(getattr(model.generation_config, "eos_token_id", None))
        self.eos_token_ids = sorted(set(eos + token_id_list(getattr(tokenizer, "eos_token_id", None))))
        self.response_length = response_length
        self.sampling = sampling
        self.seed = seed
        self.calls = 0
        self.weight_version = 0
        self._lock = threading.Lock()  # one generate or weight update at a time

    @classmethod
    def from_config(cls, model, rollout, tokenizer, *, rank: int = 0, tp_group=None) -> HFGenerateEngine:
        from workers.distributed import default_device

        hf_model = load_model(
            model.path,
            dtype=rollout_dtype(model, rollout),
            trust_remote_code=model.trust_remote_code,
            device=default_device(),
        )
        sampling = SamplingParams(
            max_new_tokens=rollout.response_length,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
        )
        return cls(
            hf_model,
            tokenizer,
            response_length=rollout.response_length,
            sampling=sampling,
            seed=rollout_seed(rollout, rank),
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- generation ----------------------------------------------------------------------------------

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """One ``generate`` call for ``prompts`` (left-padded into one batch), one sample each."""
        if params.stop:
            raise ValueError("HFGenerateEngine does not support stop strings")
        greedy = params.temperature <= 0
        # top_k 0 and -1: the whole vocabulary
        sampling = (
            {}
            if greedy
            else {"temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0)}
        )
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            **sampling,
            eos_token_id=sorted(set(self.eos_token_ids) | set(params.stop_token_ids or [])) or None,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed if params.seed is not None else self.seed + self.calls)
            self.calls += 1
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
            )
            version = self.weight_version
        new = out.sequences[:, width:].cpu()
        # the log-prob of each sampled token under the temperature-scaled distribution, before top-k/top-p
        logits = torch.stack(out.logits, dim=1).float().cpu() / (1.0 if greedy else params.temperature)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        stops = set(config.eos_token_id or [])
        outputs = []
        for row, lps in zip(new.tolist(), log_probs.tolist()):
            n = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            outputs.append(
                GenerationOutput(
                    token_ids=row[:n],
                    log_probs=lps[:n] if params.logprobs else None,
                    finish_reason="stop" if row[n - 1] in stops else "length",
                    versions=[version] * n,
                )
            )
        return outputs

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = dict(prompts.meta_info)
        params, response_length = sampling_from_meta(meta, self.sampling, self.response_length)
        pad = int(meta.get("pad_token_id", self.pad_token_id))
        source = [i for i in range(len(prompts)) for _ in range(params.n)]
        prompt_of = prompt_rows(prompts, pad)
        rows = [prompt_of[i] for i in source]
        outputs = self._generate(rows, replace(params, n=1))
        meta.update({"eos_token_id": self.eos_token_ids, "pad_token_id": pad})
        return rollout_dataproto(
            prompts, source, rows, outputs, pad_token_id=pad, response_length=response_length, meta=meta
        )

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput | list[GenerationOutput]:
        params = sampling_params or self.sampling
        outputs = await asyncio.to_thread(self._generate, [list(prompt_ids)] * params.n, replace(params, n=1))
        return outputs if params.n > 1 else outputs[0]

    # ---- weights and memory --------------------------------------------------------------------------

    def update_weights(self, named_tensors, *, version=None, flush_cache=True, abort_running=False) -> None:
        if abort_running:
            raise ValueError("HFGenerateEngine: weights change only between calls; nothing runs to abort")
        state = self.model.state_dict(keep_vars=True)  # tied names included
        unknown = []
        with self._lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    unknown.append(name)
                    continue
                state[name].data.copy_(tensor)
            if version is not None:
                self.weight_version = int(version)
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown}")

    def named_weights(self):
        return list(self.model.state_dict().items())

    def release_memory(self, weights: bool = False) -> None:
        """Nothing to free: no KV cache outlives a ``generate`` call."""
        if weights:
            raise NotImplementedError("HFGenerateEngine keeps its weights (release_memory(weights=True))")

    def resume_memory(self, kv_cache: bool = True) -> None:
        """Nothing to re-allocate (see ``release_memory``)."""
