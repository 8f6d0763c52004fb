"""The native rollout engine: continuous batching over a static slot KV cache, batched sampling.

Scheduling (one ``step()``):

1. requests whose caller gave up (cancelled ``generate``) leave the queue / the running batch;
2. waiting requests are admitted while free slots remain (``max_num_seqs``), prefilled longest first in
   packed chunks (at most ``max_prefill_tokens`` prompt tokens per forward, no padding in the matmuls)
   and sample their first token;
3. one batched decode forward runs every running request at its own position and samples its next token;
4. requests that hit a stop token id / EOS, a stop string or their token budget leave at once and the
   slots of the rest are compacted (the last slots move into the holes).

So requests join and leave the running batch at every step. ``generate_batch`` drives steps
synchronously; ``await generate(...)`` queues a request and a background asyncio task keeps stepping
(each step on a worker thread, so the event loop stays free) while anything is pending: requests from
many concurrent agents share decode steps.

Finished outputs: ``token_ids`` include the stop / EOS token that ended the sample (as HF ``generate``
does); when a stop string ends it, ``token_ids`` end with the token that completed the string and
``text`` ends with the stop string itself (any characters of that token past it are cut from ``text``).
Log-probs: see ``sampler.py`` (temperature-scaled, before top-k/top-p truncation).

Tensor parallelism: ``NativeEngine(model, tokenizer, config, tp_group=group)`` on each of the group's ranks
shards the model over them (``model.py``). The ranks run the engine in lockstep (SPMD): the same requests in
the same order, the same ``update_weights`` names in the same order. Their logits are identical (the
all-reduced stream feeds replicated norms and lm_head), yet each rank's request seeds may differ (a seed
drawn from ``os.urandom``), so TP rank 0 samples and broadcasts its tokens and log-probs every step; the other
ranks accept those, which keeps their scheduling (stops, lengths, slots) identical.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from workers.models import load_config, load_model, pad_token_id_of, resolve_dtype
from workers.models.loading import build_on_meta, can_build_on_meta
from workers.models.meta_init import full_tensors, use_placeholders
from workers.rollout.base import RolloutEngine, rollout_dtype, rollout_seed
from workers.rollout.batch import prompt_rows, rollout_dataproto
from workers.rollout.native.graphs import REPLAYS, DecodeGraphs, graph_refusal
from workers.rollout.native.model import NativeCausalLM
from workers.rollout.native.sampler import BatchSampler
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta, token_id_list

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Sizes and defaults of a NativeEngine."""

    max_num_seqs: int = 64  # KV cache slots = most requests decoding at once; the rest wait
    max_model_len: int | None = None  # prompt + response tokens per request; None: min(max positions, 4096)
    max_prefill_tokens: int = 8192  # prompt tokens per prefill forward (a longer prompt runs alone)
    dtype: torch.dtype | None = None  # None: the model's dtype
    device: str | None = None  # None: the model's device
    eos_token_ids: Sequence[int] | None = None  # None: generation config + model config + tokenizer; [] none
    pad_token_id: int | None = None  # None: tokenizer's pad id, else its EOS id, else 0
    response_length: int | None = None  # generate_sequences pads responses to this (None: longest)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # defaults for generate_sequences
    seed: int | None = None  # draws seeds for requests that bring none; None: from os.urandom
    detokenize: bool = True  # fill GenerationOutput.text when a tokenizer is present
    step_in_thread: bool = True  # async API: run each step on a worker thread
    compile: bool = False  # torch.compile the layer blocks around attention (NativeCausalLM.compile_blocks)
    # decode steps replayed as CUDA graphs (graphs.py): None (auto) = on with a CUDA device for the models that
    # can be captured (not under tensor parallelism, not a mixture of experts); True asks for them and raises
    # naming why they cannot be had
    cuda_graphs: bool | None = None
    # "cuda": capture; "eager": run the same static, bucketed step uncaptured (no CUDA here: the CPU tests; on a
    # GPU: tells a capture problem from a static-step problem)
    graph_replay: str = "cuda"

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"EngineConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"EngineConfig.max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.graph_replay not in REPLAYS:
            raise ValueError(f"EngineConfig.graph_replay must be one of {REPLAYS}, got {self.graph_replay!r}")


class Request:
    """One sample being generated (a call with ``n`` samples makes ``n`` of these)."""

    __slots__ = (
        "prompt",
        "params",
        "rng",
        "stop_ids",
        "max_new",
        "tokens",
        "logprobs",
        "versions",
        "finish_reason",
        "text",
        "slot",
        "seq_len",
        "future",
        "aborted",
        "text_len",
        "max_stop_len",
        "routes",
    )

    def __init__(self, prompt: list[int], params: SamplingParams, rng, stop_ids: frozenset, max_new: int):
        self.prompt = prompt
        self.params = params
        self.rng = rng  # random.Random for sampled requests, None for greedy ones
        self.stop_ids = stop_ids
        self.max_new = max_new
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the engine's weight version when each token was sampled
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.slot = -1
        self.seq_len = 0  # positions of this request held in its KV slot
        self.future: asyncio.Future[GenerationOutput] | None = None  # set for an asyncio caller (generate)
        self.aborted = False
        self.text_len = 0
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        # mixture of experts: each forward's [tokens, MoE layers, top-k] expert ids of this request's positions
        self.routes: list[torch.Tensor] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> GenerationOutput:
        return GenerationOutput(
            token_ids=list(self.tokens),
            log_probs=list(self.logprobs) if self.params.logprobs else None,
            finish_reason=self.finish_reason or "abort",
            text=self.text,
            versions=list(self.versions),
            routes=torch.cat(self.routes) if self.routes else None,
        )


class NativeEngine(RolloutEngine):
    """Generation engine for Hugging Face Qwen2/Qwen3/Llama/Mistral causal LMs, in plain torch.

    ``model``: a ``*ForCausalLM`` module (its weights are copied into the engine; the module itself is not
    used for generation and may be freed). ``tokenizer``: any Hugging Face tokenizer, needed only for stop
    strings, output text and default EOS/pad ids.
    """

    swaps_weights_mid_generation = True  # update_weights lands between two scheduler steps
    accepts_tp_group = True
    # LoRA: merged into the weights from a kept copy of each wrapped base weight (an exact unmerge: the next
    # adapter starts from the copy, not from subtracting the last one); decode runs at the base model's speed
    loads_adapters = True
    records_routes = True  # a mixture of experts' routes, recorded by NativeCausalLM for every forward

    def __init__(
        self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None, tp_group=None
    ):
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        cfg = model.config
        max_len = self.config.max_model_len or min(getattr(cfg, "max_position_embeddings", 4096), 4096)
        self.model = NativeCausalLM(
            model,
            max_model_len=max_len,
            max_num_seqs=self.config.max_num_seqs,
            dtype=self.config.dtype,
            device=self.config.device,
            tp_group=tp_group,
        )
        if self.config.compile:
            self.model.compile_blocks()
        # global rank of TP rank 0, the rank whose sampled tokens every TP rank takes
        self._sample_src = dist.get_global_rank(tp_group, 0) if self.model.tp_group is not None else None
        self.max_model_len = max_len
        self.vocab_size = self.model.spec.vocab_size
        if self.config.eos_token_ids is not None:
            eos = token_id_list(self.config.eos_token_ids)
        else:
            eos = token_id_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
            eos += token_id_list(getattr(cfg, "eos_token_id", None))
            if tokenizer is not None:
                eos += token_id_list(tokenizer.eos_token_id)
        self.eos_token_ids: list[int] = sorted(set(eos))
        pad = self.config.pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id: int = int(pad) if pad is not None else 0
        seed = self.config.seed if self.config.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._seed_rng = random.Random(seed)

        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # _running[i].slot == i before and after every step
        self._queue_lock = threading.Lock()  # guards _waiting (submitters vs the stepping thread)
        self._model_lock = threading.RLock()  # one step / weight update / memory change at a time
        self._decode_sampler: BatchSampler | None = None
        self._driver: asyncio.Task | None = None
        self._driver_loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: set[Request] = set()  # async requests whose callers still wait
        self._missing_weights: set[str] = set()  # HF names still to be loaded after resume_memory
        self._adapter_base: dict[
            str, torch.Tensor
        ] = {}  # LoRA: the base of every adapted weight (load_adapter)
        # The policy version of the weights (the trainer's update count, set by update_weights): every sampled
        # token records it, so a weight update between two decode steps shows in the output token by token.
        self.weight_version = 0
        # weight updates waiting for the lock: step() lets them in first (a lock is not fair: a thread that
        # steps back to back could keep an update from another thread waiting for many steps)
        self._updates_waiting = 0
        self.stats = {
            "steps": 0,
            "decode_steps": 0,
            "prefill_forwards": 0,
            "prompt_tokens": 0,
            "prefill_tokens": 0,  # prompt tokens computed: a prompt shared by several requests counts once
            "generated_tokens": 0,
            "prefill_time_s": 0.0,
            "decode_time_s": 0.0,  # wall time of decode forwards + sampling (synchronised by .tolist())
            "decode_kv_tokens": 0,  # cache positions attended over all decode steps (for bandwidth math)
            "graph_captures": 0,  # decode graphs captured (graphs.py), their seconds, replays and pool memory
            "graph_capture_s": 0.0,
            "graph_replays": 0,
            "graph_memory_bytes": 0,
            "graph_failures": 0,  # auto: a failed graph step turned the graphs off (a warning says why)
        }
        self.graphs = self._decode_graphs()

    def _decode_graphs(self) -> DecodeGraphs | None:
        want, replay = self.config.cuda_graphs, self.config.graph_replay
        if want is None:  # auto: where they can be had
            capturable = replay == "eager" or self.model.device.type == "cuda"
            want = capturable and graph_refusal(self.model) is None
        return DecodeGraphs(self.model, replay, stats=self.stats) if want else None

    @classmethod
    def from_pretrained(
        cls, path: str, tokenizer=None, config: EngineConfig | None = None, tp_group=None, **model_kwargs
    ):
        """Load a checkpoint (and its tokenizer unless one is given) and build an engine from it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = config or EngineConfig()
        model_kwargs.setdefault("dtype", config.dtype or "auto")
        model = AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, config, tp_group=tp_group)

    @classmethod
    def from_config(cls, model, rollout, tokenizer, *, rank: int = 0, tp_group=None) -> NativeEngine:
        """The engine of one rank (`RolloutEngine.from_config`): ``max_num_seqs`` slots of
        ``prompt_length + response_length`` tokens (at most the model's positions), ``rollout_dtype``, pad id
        from the tokenizer. A directory that can be built on the meta device keeps one copy of the weights,
        the engine's: its layout is made from a model without weights, then the weights are read in one tensor
        at a time (a random-init directory: the trainer's seeded weights)."""
        from workers.distributed import default_device

        hf_config = load_config(model.path, trust_remote_code=model.trust_remote_code)
        max_len = rollout.prompt_length + rollout.response_length
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        if max_pos:
            max_len = min(max_len, int(max_pos))
        cfg = EngineConfig(
            max_num_seqs=rollout.max_num_seqs,
            max_model_len=max_len,
            dtype=resolve_dtype(rollout_dtype(model, rollout)),
            device=str(default_device()),
            pad_token_id=pad_token_id_of(tokenizer, hf_config),
            response_length=rollout.response_length,
            seed=rollout_seed(rollout, rank),
            compile=rollout.compile,
            cuda_graphs=rollout.engine_cuda_graphs,  # rollout.cuda_graphs: auto -> None
        )
        load = dict(dtype=cfg.dtype, attn_implementation=None, trust_remote_code=model.trust_remote_code)
        if not can_build_on_meta(model.path):
            return cls(load_model(model.path, **load), tokenizer, cfg, tp_group=tp_group)
        hf_model, source = build_on_meta(model.path, **load)
        engine = cls(use_placeholders(hf_model), tokenizer, cfg, tp_group=tp_group)
        engine.update_weights(full_tensors(hf_model, source))
        return engine

    @classmethod
    def inference_options(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(EngineConfig))

    @classmethod
    def for_inference(cls, model_path: str, tokenizer, **options) -> NativeEngine:
        """``from_pretrained`` with ``EngineConfig(**options)``."""
        return cls.from_pretrained(model_path, tokenizer, EngineConfig(**options))

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- requests ------------------------------------------------------------------------------------

    def _check_weights(self) -> None:
        if not self.model.store.allocated:
            raise RuntimeError("weights are released; call resume_memory() and update_weights() first")
        if self._missing_weights:
            raise RuntimeError(
                "weights were released and not all reloaded by update_weights(); missing e.g. "
                f"{sorted(self._missing_weights)[:4]}"
            )

    def _new_request(self, prompt_ids, params: SamplingParams, index: int) -> Request:
        self._check_weights()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room under max_model_len={self.max_model_len}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (NativeEngine(model, tokenizer=...))")
        rng = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            # sample i of a request seeded s draws exactly like sample 0 of a request seeded s + i
            rng = random.Random(seed + index)
        stop_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids)
        max_new = min(params.max_new_tokens, self.max_model_len - len(prompt))
        return Request(prompt, params, rng, stop_ids, max_new)

    def add_request(
        self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> list[Request]:
        """Queue a request (its ``n`` samples) for the next ``step()``; low-level API for callers that
        drive ``step()`` themselves (``generate_batch`` and ``generate`` do this for you)."""
        params = sampling_params or self.config.sampling
        reqs = [self._new_request(prompt_ids, params, i) for i in range(params.n)]
        self._enqueue(reqs)
        return reqs

    def _enqueue(self, reqs: Iterable[Request]) -> None:
        with self._queue_lock:
            self._waiting.extend(reqs)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- one scheduler step --------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Admit + prefill waiting requests, run one decode step for the running batch; return the
        requests that finished in this step."""
        while self._updates_waiting:  # a weight update from another thread goes between two steps
            time.sleep(0.0005)
        with self._model_lock, torch.inference_mode():
            self._check_weights()
            self.model.allocate_kv()
            finished: list[Request] = []
            self._drop_aborted(finished)
            free = self.config.max_num_seqs - len(self._running)
            new: list[Request] = []
            if free > 0 and self._waiting:
                with self._queue_lock:
                    while self._waiting and len(new) < free:
                        new.append(self._waiting.popleft())
            if new:
                self._prefill(new, finished)
                self._evict()
            if self._running:
                self._decode(finished)
                self._evict()
            self.stats["steps"] += 1
            return finished

    def _drop_aborted(self, finished: list[Request]) -> None:
        if any(r.aborted for r in self._waiting):
            with self._queue_lock:
                kept: deque[Request] = deque()
                for r in self._waiting:
                    if r.aborted:
                        r.finish_reason = "abort"
                        finished.append(r)
                    else:
                        kept.append(r)
                self._waiting = kept
        if any(r.aborted for r in self._running):
            for r in self._running:
                if r.aborted:
                    r.finish_reason = "abort"
                    finished.append(r)
            self._evict()

    def _prefill(self, new: list[Request], finished: list[Request]) -> None:
        # Requests with the same prompt (group sampling: a prompt's rollout.n samples) share one prefill: the
        # first of them is computed, the others copy its keys/values into their own slots and sample from its
        # logits (the same numbers the forward would give them). Longest first, so a chunk holds prompts of
        # similar lengths (attention pads to the longest); the token budget counts each prompt once.
        groups: dict[tuple[int, ...], list[Request]] = {}
        for r in sorted(new, key=lambda r: len(r.prompt), reverse=True):
            groups.setdefault(tuple(r.prompt), []).append(r)
        sharing = list(groups.values())
        budget = self.config.max_prefill_tokens
        i = 0
        while i < len(sharing):
            j, total = i + 1, len(sharing[i][0].prompt)
            while j < len(sharing) and total + len(sharing[j][0].prompt) <= budget:
                total += len(sharing[j][0].prompt)
                j += 1
            chunk_groups = sharing[i:j]
            i = j
            t0 = time.perf_counter()
            slot0 = len(self._running)
            logits = self.model.prefill([g[0].prompt for g in chunk_groups], slot0)
            if self.model.last_routes is not None:  # a prompt's copies share its computed routes
                routes = self.model.last_routes.cpu().split([len(g[0].prompt) for g in chunk_groups])
                for g, prompt_routes in zip(chunk_groups, routes):
                    for r in g:
                        r.routes = [prompt_routes]
            # slots: the computed prompts first (slot0 + k), then each group's copies after them
            chunk = [g[0] for g in chunk_groups]
            rows = list(range(len(chunk)))
            for k, g in enumerate(chunk_groups):
                if len(g) > 1:
                    first = len(chunk)
                    chunk += g[1:]
                    rows += [k] * (len(g) - 1)
                    self.model.copy_slot(
                        slot0 + k, list(range(slot0 + first, slot0 + len(chunk))), len(g[0].prompt)
                    )
            for k, r in enumerate(chunk):
                r.slot = slot0 + k
                r.seq_len = len(r.prompt)
                self._running.append(r)
            if len(chunk) > len(chunk_groups):
                logits = logits[torch.tensor(rows, device=logits.device)]
            self.stats["prompt_tokens"] += sum(len(r.prompt) for r in chunk)
            self.stats["prefill_tokens"] += total
            self.stats["prefill_forwards"] += 1
            self._take(chunk, *self._sample(chunk, self._make_sampler(chunk), logits), finished)
            self.stats["prefill_time_s"] += time.perf_counter() - t0
        self._decode_sampler = None

    def _decode(self, finished: list[Request]) -> None:
        running = self._running
        t0 = time.perf_counter()
        if self._decode_sampler is None:
            self._decode_sampler = self._make_sampler(running)
        sampler = self._decode_sampler
        tokens, positions = [r.tokens[-1] for r in running], [r.seq_len for r in running]
        uniforms = self._uniforms(running, sampler)
        sampled = (
            self._graph_decode(tokens, positions, sampler, uniforms) if self.graphs is not None else None
        )
        if sampled is None:
            logits = self.model.decode(tokens, positions)
            if self.model.last_routes is not None:
                for r, step_routes in zip(running, self.model.last_routes.cpu().split(1)):
                    r.routes.append(step_routes)
            sampled = sampler.sample(logits, uniforms)
        for r in running:
            r.seq_len += 1
        self._take(running, *sampled, finished)
        self.stats["decode_time_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_kv_tokens"] += sum(r.seq_len for r in running)

    def _make_sampler(self, reqs: list[Request]) -> BatchSampler:
        return BatchSampler(
            [r.params.temperature for r in reqs],
            [r.params.top_k for r in reqs],
            [r.params.top_p for r in reqs],
            self.model.device,
        )

    def _graph_decode(self, tokens, positions, sampler, uniforms) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode step through the graphs; None when they failed under ``cuda_graphs`` auto (then the engine
        warns once and decodes eagerly from here on: auto means graphs where they work)."""
        assert self.graphs is not None
        try:
            sampled = self.graphs.decode(tokens, positions, sampler, uniforms)
        except Exception:
            if self.config.cuda_graphs:  # asked for by name: the failure is the caller's to see
                raise
            logger.warning(
                "native engine: the CUDA-graph decode step failed; decoding without graphs from now on "
                "(EngineConfig.cuda_graphs=True raises this error instead)",
                exc_info=True,
            )
            self.graphs.clear()
            self.graphs = None
            self.stats["graph_failures"] += 1
            return None
        return sampled

    @staticmethod
    def _uniforms(reqs: list[Request], sampler: BatchSampler) -> list[float] | None:
        """One draw from each request's own stream (a seeded request samples alike in any batch)."""
        return None if sampler.all_greedy else [r.rng.random() if r.rng else 0.0 for r in reqs]

    def _sample(
        self, reqs: list[Request], sampler: BatchSampler, logits
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sampler.sample(logits, self._uniforms(reqs, sampler))

    def _take(self, reqs: list[Request], tokens, logps, finished: list[Request]) -> None:
        """Append each request's sampled token and log-prob; finish the requests that stop."""
        if self._sample_src is not None:
            # One broadcast of (token, log-prob) pairs; float64 holds both exactly.
            both = torch.stack((tokens.double(), logps.double()))
            dist.broadcast(both, src=self._sample_src, group=self.model.tp_group)
            tokens, logps = both[0].long(), both[1].float()
        tokens, logps = tokens.tolist(), logps.tolist()
        self.stats["generated_tokens"] += len(reqs)
        for r, tok, lp in zip(reqs, tokens, logps):
            r.tokens.append(tok)
            r.versions.append(self.weight_version)
            if r.params.logprobs:
                r.logprobs.append(lp)
            if tok in r.stop_ids:
                r.finish_reason = "stop"
            elif r.params.stop and self._hit_stop_string(r):
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.max_new:
                r.finish_reason = "length"
            else:
                continue
            if r.text is None and self.tokenizer is not None and self.config.detokenize:
                r.text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
            finished.append(r)

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        start = max(0, r.text_len - r.max_stop_len - 8)  # only text the new token can have completed
        r.text_len = len(text)
        end = None
        for s in r.params.stop:
            at = text.find(s, start)
            if at != -1 and (end is None or at + len(s) < end):
                end = at + len(s)
        if end is None:
            return False
        r.text = text[:end]
        return True

    def _evict(self) -> None:
        """Drop finished requests from the running batch and compact the live ones into slots 0..B-1."""
        if all(r.finish_reason is None for r in self._running):
            return
        live = [r for r in self._running if r.finish_reason is None]
        n = len(live)
        taken = {r.slot for r in live if r.slot < n}
        holes = [s for s in range(n) if s not in taken]
        movers = [r for r in live if r.slot >= n]
        for r, hole in zip(movers, holes):
            self.model.move_slot(r.slot, hole, r.seq_len)
            r.slot = hole
        live.sort(key=lambda r: r.slot)
        self._running = live
        self._decode_sampler = None

    # ---- synchronous batch API -----------------------------------------------------------------------

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[GenerationOutput]]:
        """Generate for many prompts at once (continuous batching over all of them); returns, per prompt,
        its ``n`` outputs. ``sampling_params``: one for all prompts or one per prompt."""
        if self._driver is not None and not self._driver.done():
            raise RuntimeError("generate_batch cannot run while async generate() requests are in flight")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.config.sampling] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        groups = [[self._new_request(p, sp, i) for i in range(sp.n)] for p, sp in zip(prompts, params)]
        mine = {id(r) for g in groups for r in g}
        self._enqueue(r for g in groups for r in g)
        try:
            while mine:
                for r in self.step():
                    mine.discard(id(r))
        except BaseException:
            self._abort_now([r for g in groups for r in g])
            raise
        return [[r.output() for r in g] for g in groups]

    def _abort_now(self, reqs: list[Request]) -> None:
        """Take unfinished ``reqs`` out of the queue and the running batch at once (after an error)."""
        with self._model_lock:
            for r in reqs:
                r.aborted = True
            self._drop_aborted([])

    # ---- asyncio request API -------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput | list[GenerationOutput]:
        """Queue one request and wait for it; concurrent calls share the engine's decode steps. Returns a
        ``GenerationOutput``, or a list of ``n`` of them when ``sampling_params.n > 1`` (sample i of a
        request seeded s uses seed s + i). Cancelling the call aborts its samples at the next step."""
        params = sampling_params or self.config.sampling
        loop = asyncio.get_running_loop()
        reqs = [self._new_request(prompt_ids, params, i) for i in range(params.n)]
        futures = [loop.create_future() for _ in reqs]
        for r, future in zip(reqs, futures):
            r.future = future
        self._inflight.update(reqs)
        self._enqueue(reqs)
        if self._driver is None or self._driver.done() or self._driver_loop is not loop:
            self._driver_loop = loop
            self._driver = loop.create_task(self._drive())
        try:
            outs = [await future for future in futures]
        except asyncio.CancelledError:
            for r in reqs:
                r.aborted = True
            raise
        return outs if params.n > 1 else outs[0]

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.has_unfinished():
                if self.config.step_in_thread:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="native-engine")
                    finished = await loop.run_in_executor(self._executor, self.step)
                else:
                    finished = self.step()
                for r in finished:
                    self._inflight.discard(r)
                    if r.future is not None and not r.future.done():
                        r.future.set_result(r.output())
                await asyncio.sleep(0)  # let woken callers queue their next turn before the next step
        except BaseException as exc:
            # Every caller still waiting gets the error (or the cancellation); the engine is left idle.
            with self._model_lock:  # a step still running on the worker thread finishes first
                with self._queue_lock:
                    self._waiting.clear()
                self._running = []
                self._decode_sampler = None
            pending, self._inflight = self._inflight, set()
            for r in pending:
                r.finish_reason = r.finish_reason or "abort"
                if r.future is not None and not r.future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        r.future.cancel()
                    else:
                        r.future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError) or not pending:
                raise  # otherwise the callers hold the error; the task itself ends quietly

    # ---- controller batch API (DataProto) ------------------------------------------------------------

    def sampling_from_meta(self, meta: dict) -> tuple[SamplingParams, int | None]:
        """The sampling parameters of one ``generate_sequences`` call and the response width to pad to (the
        keys are documented in ``workers.rollout.sampling.sampling_from_meta``)."""
        return sampling_from_meta(meta, self.config.sampling, self.config.response_length)

    def generate_sequences(self, prompts):
        """Generate responses for a batch of left-padded prompts (``dataproto/BATCH_LAYOUT.md``).

        Reads ``batch['input_ids']`` (or ``batch['prompts']``) ``[B, P]`` and ``batch['attention_mask']``
        (the prompt of row i is its tokens where the mask is 1; without a mask, the tokens that are not
        the pad id); ``position_ids`` are recomputed from the mask. Sampling settings come from
        ``meta_info`` (see ``sampling_from_meta``) plus ``pad_token_id``. With ``n > 1`` the engine repeats
        every row n times, interleaved (a,a,b,b like ``DataProto.repeat``; other tensors and non-tensor
        columns too), so a caller that already repeated its rows passes n = 1.

        Returns a DataProto with ``prompts``, ``responses`` (right-padded with the pad id),
        ``input_ids``, ``attention_mask``, ``position_ids`` (``clamp(cumsum(mask) - 1, 0)``),
        ``response_mask`` (float32, 1 through the EOS/stop token), ``rollout_log_probs`` (float32, 0 on
        padding; absent when ``logprobs`` is off), built by `rollout_dataproto`, the input's other tensors and non-tensor columns, and ``meta_info`` = input meta +
        ``eos_token_id``, ``pad_token_id``, ``timing_s/gen`` and ``rollout/*`` counters.
        """
        t0 = time.perf_counter()
        meta = dict(prompts.meta_info)
        params, response_length = self.sampling_from_meta(meta)
        pad = int(meta.get("pad_token_id", self.pad_token_id))
        source = [i for i in range(len(prompts)) for _ in range(params.n)]
        prompt_of = prompt_rows(prompts, pad)
        rows = [prompt_of[i] for i in source]
        row_params = [
            replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            for j in range(len(rows))
        ]
        stats0 = dict(self.stats)
        outs = [group[0] for group in self.generate_batch(rows, row_params)]
        generated = sum(len(o.token_ids) for o in outs)
        elapsed = time.perf_counter() - t0
        meta.update(
            {
                "eos_token_id": self.eos_token_ids,
                "pad_token_id": pad,
                "timing_s/gen": elapsed,
                "rollout/generated_tokens": generated,
                "rollout/decode_steps": self.stats["decode_steps"] - stats0["decode_steps"],
                "rollout/tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            }
        )
        if self.graphs is not None:
            meta.update(self.graphs.metrics(since=stats0))
        return rollout_dataproto(
            prompts, source, rows, outs, pad_token_id=pad, response_length=response_length, meta=meta
        )

    # ---- memory and weights --------------------------------------------------------------------------

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished():
            raise RuntimeError(f"{what} while {self.num_running + self.num_waiting} requests are unfinished")

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache; with ``weights`` also the weights (then ``resume_memory()`` followed by
        ``update_weights`` with every parameter is needed before generating again)."""
        with self._model_lock:
            self._require_idle("release_memory")
            if self.graphs is not None:  # they read the cache (and the weights) being freed
                self.graphs.clear()
            self.model.free_kv()
            if weights:
                self.model.free_weights()
                self._missing_weights = set()
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, kv_cache: bool = True) -> None:
        """Re-allocate released weights (uninitialised until ``update_weights`` fills every name) and, when
        ``kv_cache``, the KV cache now (otherwise it is allocated by the next step)."""
        with self._model_lock:
            if not self.model.store.allocated:
                self.model.allocate_weights()
                self._missing_weights = self._canonical_names()
            if kv_cache:
                self.model.allocate_kv()

    def _canonical_names(self) -> set[str]:
        names = set(self.model.store.names)
        if self.model.spec.tie_word_embeddings:
            names.discard("lm_head.weight")  # loaded through model.embed_tokens.weight (same storage)
        return names

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        flush_cache: bool = True,  # nothing to flush: no prefix cache outlives a request
        abort_running: bool = False,
    ) -> int:
        """Copy ``(name, tensor)`` pairs (Hugging Face parameter names) into the engine's weights in place,
        between two scheduler steps: requests in flight continue on the new weights from the next step on
        (``version`` then becomes ``weight_version``, which every later token records), or, with
        ``abort_running``, the requests that started on the old weights finish at the next step with
        ``finish_reason == "abort"`` (queued ones not yet started run on the new weights). Returns how many
        were aborted.

        Tensors may be any dtype/device (they are cast); with tied embeddings either name updates both.
        Names the model does not have raise a KeyError naming them all (the known ones are applied);
        a shape mismatch raises a ValueError. With tensor parallelism a tensor may be the full HF tensor
        (this rank slices its part) or this rank's generation shard as the resharder delivers it
        (``reshard_plan.expected_gen_shard``); see ``NativeCausalLM.local_shard``."""
        self._adapter_base = {}  # new base weights: the next adapter goes on these
        return self._swap_in(named_tensors, version, abort_running, "update_weights")

    def _swap_in(self, named_tensors, version: int | None, abort_running: bool, method: str) -> int:
        unknown: list[str] = []
        with self._queue_lock:
            self._updates_waiting += 1
        try:
            aborted = self._apply_weights(named_tensors, version, abort_running, unknown)
        finally:
            with self._queue_lock:
                self._updates_waiting -= 1
        if unknown:
            raise KeyError(f"{method}: unknown parameter names {unknown}")
        return aborted

    def load_adapter(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        scaling: float,
        version: int | None = None,
        abort_running: bool = False,
    ) -> int:
        """The adapter merged into the weights: ``W = W_base + scaling * B @ A`` for each wrapped weight, from
        the base copy taken the first time a weight is adapted (the weights then hold the base: what the engine
        loaded, or the last ``update_weights``). Swapped in like ``update_weights``; returns how many requests
        were aborted."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            module, sep, part = name.rpartition(".lora_")
            if not sep or part not in ("A.weight", "B.weight"):
                raise KeyError(f"load_adapter: {name!r} is not a LoRA A/B weight (PEFT's names)")
            pairs.setdefault(module.removeprefix("base_model.model.") + ".weight", {})[part[0]] = tensor
        store = self.model.store
        unknown = [n for n in pairs if n not in store.names]
        halves = [n for n, ab in pairs.items() if len(ab) != 2]
        if unknown or halves:
            raise KeyError(f"load_adapter: unknown weights {unknown}, or A/B missing for {halves}")
        with self._model_lock, torch.no_grad():
            for name in pairs:
                if name not in self._adapter_base:
                    self._adapter_base[name] = store.target(name).clone()
        full = {name: tuple(self.model.full_shape(name)) for name in pairs}

        def merged():
            # made one weight at a time while the swap copies it in: no second copy of the model at once
            for name, ab in pairs.items():
                base = self._adapter_base[name]
                b, a = (ab[k].to(base.device, torch.float32) for k in "BA")
                if full[name] == tuple(base.shape):
                    weight = torch.addmm(base.float(), b, a, alpha=scaling)
                else:  # a tensor-parallel shard: this rank's part of B @ A
                    weight = base.float() + self.model.local_shard(name, scaling * (b @ a))
                yield name, weight.to(base.dtype)
            # what the previous adapter wrapped and this one does not goes back to its base
            yield from ((name, base) for name, base in self._adapter_base.items() if name not in pairs)

        return self._swap_in(merged(), version, abort_running, "load_adapter")

    def _apply_weights(
        self, named_tensors, version: int | None, abort_running: bool, unknown: list[str]
    ) -> int:
        store = self.model.store
        with self._model_lock, torch.no_grad():
            if not store.allocated:
                raise RuntimeError("weights are released; call resume_memory() before update_weights()")
            for name, tensor in named_tensors:
                if name not in store.names:
                    unknown.append(name)
                    continue
                store.target(name).copy_(self.model.local_shard(name, tensor))
                if name == "lm_head.weight" and self.model.spec.tie_word_embeddings:
                    name = "model.embed_tokens.weight"
                self._missing_weights.discard(name)
            if version is not None:
                self.weight_version = int(version)
            started = [r for r in self._running if not r.finished] if abort_running else []
            for r in started:
                r.aborted = True
            return len(started)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's weights under their Hugging Face names (views; tied names share storage; with tensor
        parallelism this rank's shards)."""
        store = self.model.store
        return [(name, store.target(name)) for name in store.names]

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
