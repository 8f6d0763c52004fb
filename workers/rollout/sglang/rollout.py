"""``SGLangRollout``: hyflow's ``RolloutEngine`` over an in-process ``sglang.Engine`` (GPU, or CPU for tests).

Same interface and ``meta_info`` contract as the native engine (``workers/rollout/base.py``,
``workers/rollout/native/engine.py``), so the rollout worker can hold either:

* ``generate_sequences(DataProto) -> DataProto``: left-padded ``input_ids`` (or ``prompts``) and
  ``attention_mask`` ``[B, P]`` in; out the keys of ``dataproto/BATCH_LAYOUT.md``: ``prompts``,
  right-padded ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``
  (float32, 1 through the EOS / stop token), ``rollout_log_probs`` (float32, 0 on padding; absent when
  ``logprobs`` is off), built by ``workers.rollout.batch.rollout_dataproto``. Sampling
  settings come from ``meta_info`` (see ``workers.rollout.sampling.sampling_from_meta``) with the configured
  ``SamplingParams`` as defaults. With ``n > 1`` every row (tensors and non-tensor columns) is
  repeated n times, interleaved (a, a, b, b). Output ``meta_info`` = input meta + ``eos_token_id``,
  ``pad_token_id``, ``timing_s/gen``, ``rollout/generated_tokens``, ``rollout/tokens_per_s``.
* ``async generate(prompt_ids, sampling_params)``: one ``GenerationOutput`` through
  ``Engine.async_generate`` (a list of n when ``sampling_params.n > 1``).
* ``update_weights(named_tensors)``: HF-named tensors (on the engine's ``device``) through ``Engine.update_weights_from_tensor`` in
  size-bounded buckets (``bucket_mb``, each sent with ``flush_cache=False``), then one
  ``Engine.flush_cache()``. SGLang >= 0.5.21 accepts tensors only inside a weight-update session
  (``begin_weight_update()`` ... ``end_weight_update()``); older versions have no such methods. The
  adapter opens the session when the engine has it.
* ``release_memory(weights=False)`` / ``resume_memory(kv_cache=True)``: ``release_memory_occupation``
  / ``resume_memory_occupation`` with tags ``"kv_cache"``, ``"weights"`` (when asked) and
  ``"cuda_graph"`` (when ``release_cuda_graph``), after waiting until the engine is idle (SGLang
  asserts that, and its scheduler dies otherwise). Frees memory only on an engine started with
  ``enable_memory_saver=True`` (the CUDA default here; on CPU there is no memory saver, so the calls
  run their control flow and free nothing). Released weights hold garbage after
  ``resume_memory()``: refill them with ``update_weights`` before generating. The colocated order that
  keeps peak memory low is ``resume_memory(kv_cache=False)`` -> ``update_weights`` ->
  ``resume_memory()``.
* ``flush_cache()``, ``shutdown()`` (stops exactly the engine's processes).

If an engine process dies, calls raise ``SGLangEngineDied`` naming the engine and the last request
instead of hanging or taking this process down (``lifecycle.py``).

``device="cpu"`` runs SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``torch_native`` attention, no
CUDA graphs, no memory saver) with the import shims of ``cpu_shim/``; ``make sglang-cpu`` installs it.
sglang is imported only when an engine is built; on a machine without it the constructor raises an
``ImportError`` that says how to install it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dataproto import DataProto
from workers.rollout.base import RolloutEngine, rollout_dtype, rollout_seed
from workers.rollout.batch import prompt_rows, rollout_dataproto
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta, token_id_list
from workers.rollout.sglang.convert import (
    ROUTE_RECORDING_ARCHITECTURES,
    RouteLayout,
    architecture,
    expand_requests,
    is_moe_config,
    output_to_generation,
)
from workers.rollout.sglang.convert import route_layout as layout_of_config
from workers.rollout.sglang.lifecycle import EngineLifecycle
from workers.weight_sync.buckets import bucket_mb_to_bytes, flatten_bucket, iter_buckets

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "on a CUDA machine: pip install -e '.[sglang]'; for the CPU engine (tests, CI): make sglang-cpu"
)
CPU_SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"

KV_CACHE = "kv_cache"  # sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE
WEIGHTS = "weights"  # sglang.srt.constants.GPU_MEMORY_TYPE_WEIGHTS
CUDA_GRAPH = "cuda_graph"  # sglang.srt.constants.GPU_MEMORY_TYPE_CUDA_GRAPH

WEIGHT_LOAD_FORMATS = ("tensor", "flattened_bucket")


def import_sglang(device: str = "cuda", tp_size: int = 1):
    """The ``sglang`` module, or an ImportError saying how to get it; ``device="cpu"`` prepares the CPU engine."""
    if device == "cpu":
        prepare_cpu_engine(tp_size)
    try:
        import sglang
    except ImportError as err:
        raise ImportError(f"SGLang is not installed ({err}); {INSTALL_HINT}") from err
    return sglang


def prepare_cpu_engine(tp_size: int = 1) -> None:
    """Set this process (and the engine processes it spawns) up for SGLang's CPU engine.

    Must run before sglang is first imported: SGLang reads ``SGLANG_USE_CPU_ENGINE`` into module
    constants. Puts ``cpu_shim/`` (stand-ins for ``sgl_kernel`` and ``torchvision``, which have no CPU
    build) first on ``sys.path`` and ``PYTHONPATH``; never on a machine with CUDA, which needs the real ones.
    With ``tp_size > 1`` each TP rank gets its own cores (``SGLANG_CPU_OMP_THREADS_BIND``, unless set):
    SGLang otherwise allows only one rank per NUMA node.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "device='cpu' SGLang uses import shims for sgl_kernel/torchvision that must not shadow the real "
            "packages on a CUDA machine; use device='cuda' there"
        )
    if "sglang" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise RuntimeError(
            "sglang was imported before prepare_cpu_engine(): set SGLANG_USE_CPU_ENGINE=1 before importing it"
        )
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp_size:
            raise ValueError(
                f"tp_size={tp_size} on CPU needs a core per rank; this process may use {len(cores)}"
            )
        per = len(cores) // tp_size
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{cores[r * per]}-{cores[r * per + per - 1]}" for r in range(tp_size)
        )
    shim = str(CPU_SHIM_DIR)
    if shim not in sys.path:
        sys.path.insert(0, shim)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in paths:  # the scheduler and detokenizer are spawned processes
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *paths])


def _flattened_bucket_api():
    """(FlattenedTensorMetadata class, serialize function, multi-dtype support) from sglang."""
    import_sglang()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:  # moved into a submodule in some versions
        from sglang.srt.utils.common import MultiprocessingSerializer
    multi_dtype = bool(getattr(FlattenedTensorBucket, "supports_multi_dtypes", False))
    return FlattenedTensorMetadata, MultiprocessingSerializer.serialize, multi_dtype


@dataclass
class SGLangRolloutConfig:
    """How to start the SGLang engine and how to talk to it.

    Engine fields map to ``sglang.srt.server_args.ServerArgs`` (``model_path``, ``tp_size``,
    ``mem_fraction_static``, ``dtype``, ``random_seed`` <- ``seed``, ``enable_memory_saver``,
    ``enable_deterministic_inference`` <- ``deterministic``, ``attention_backend``, ``base_gpu_id``,
    ``log_level``, ``trust_remote_code``); ``engine_kwargs`` passes any other ServerArgs field.
    """

    model_path: str
    device: str = "cuda"  # "cpu": SGLang's CPU engine (tests, CI; see prepare_cpu_engine)
    tp_size: int = 1
    mem_fraction_static: float = 0.5  # share of GPU memory for weights + KV cache (colocated: leave room)
    dtype: str = "auto"
    seed: int = 0
    bucket_mb: float = 512.0  # weight update bucket bound, MiB
    weight_load_format: str = "tensor"  # "tensor" or "flattened_bucket" (one IPC handle per bucket)
    # required for release_memory / resume_memory to free anything; None: on for CUDA, off for CPU
    # (torch_memory_saver has only CUDA hooks)
    enable_memory_saver: bool | None = None
    release_cuda_graph: bool = False  # also release the "cuda_graph" tag (newer SGLang versions)
    deterministic: bool = False  # enable_deterministic_inference: needed for seeded sampling
    attention_backend: str | None = None  # None: SGLang's choice on CUDA, "torch_native" on CPU
    base_gpu_id: int = 0
    log_level: str = "error"
    trust_remote_code: bool = False
    response_length: int | None = None  # pad responses to this (None: meta_info's, else the longest)
    pad_token_id: int | None = None  # None: meta_info["pad_token_id"], else the tokenizer's
    eos_token_ids: list[int] | None = None  # reported in meta_info; None: generation config + tokenizer
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # mixture of experts: record each position's experts (GenerationOutput.routes; the engine starts with
    # enable_return_routed_experts and every request asks for them). None: for an MoE model whose config.json is
    # in model_path and whose SGLang class records them (convert.ROUTE_RECORDING_ARCHITECTURES); True: required
    # (an error where that does not hold); False: never
    record_routes: bool | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.enable_memory_saver is None:
            self.enable_memory_saver = self.device == "cuda"
        elif self.enable_memory_saver and self.device == "cpu":
            raise ValueError(
                "enable_memory_saver=True needs CUDA (torch_memory_saver); set it False for device='cpu'"
            )
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.weight_load_format not in WEIGHT_LOAD_FORMATS:
            raise ValueError(
                f"weight_load_format must be one of {WEIGHT_LOAD_FORMATS}, got {self.weight_load_format!r}"
            )
        bucket_mb_to_bytes(self.bucket_mb)  # validates
        if isinstance(self.sampling, Mapping):
            self.sampling = SamplingParams(**self.sampling)

    def route_layout(self) -> RouteLayout | None:
        """The layout of the routes this engine records (see ``record_routes``), or None where it records none."""
        if self.record_routes is False:
            return None
        hf = _hf_config(self.model_path)
        reason = None
        if hf is None:
            reason = f"no config.json in {self.model_path}"
        elif not is_moe_config(hf):
            reason = "the model is dense"
        elif architecture(hf) not in ROUTE_RECORDING_ARCHITECTURES:
            reason = (
                f"SGLang's {architecture(hf)} records no per-layer routes (its TopK has no layer_id; recorded for "
                f"{', '.join(ROUTE_RECORDING_ARCHITECTURES)})"
            )
        if reason is None:
            assert hf is not None
            return layout_of_config(hf)
        if self.record_routes:
            raise ValueError(f"record_routes=True, but {reason}")
        return None

    def server_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``sglang.Engine(**kwargs)`` (= ``ServerArgs`` fields)."""
        kwargs: dict[str, Any] = dict(
            model_path=self.model_path,
            device=self.device,
            tp_size=self.tp_size,
            mem_fraction_static=self.mem_fraction_static,
            dtype=self.dtype,
            random_seed=self.seed,
            enable_memory_saver=self.enable_memory_saver,
            base_gpu_id=self.base_gpu_id,
            log_level=self.log_level,
            trust_remote_code=self.trust_remote_code,
        )
        if self.deterministic:
            kwargs["enable_deterministic_inference"] = True
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        elif self.device == "cpu":
            kwargs["attention_backend"] = "torch_native"  # SGLang's CPU kernels are not on the registries
        if self.route_layout() is not None:
            kwargs["enable_return_routed_experts"] = True  # creates SGLang's RoutedExpertsCapturer
        clash = sorted(set(kwargs) & set(self.engine_kwargs))
        if clash:
            raise ValueError(f"engine_kwargs repeats field(s) {clash} that have their own config entries")
        kwargs.update(self.engine_kwargs)
        if self.device == "cpu":
            kwargs.setdefault("disable_cuda_graph", True)
            # an idle CPU scheduler otherwise busy-polls its sockets: a whole core for as long as the engine lives
            kwargs.setdefault("sleep_on_idle", True)
        return kwargs


class SGLangRollout(RolloutEngine):
    """Rollout engine adapter over ``sglang.Engine`` (see the module docstring for the contract)."""

    # Not an adapter-loading engine (``loads_adapters`` False): a LoRA actor's syncs stream the merged weights.
    # SGLang 0.5.20 has adapters from tensors (``Engine.load_lora_adapter_from_tensors``), but on the CPU its
    # engine does not start with ``enable_lora=True``: every LoRA layer pins host memory
    # (``sglang/srt/lora/layers.py``: ``torch.tensor(..., pin_memory=True)``, 11 such sites in ``srt/lora``),
    # which raises "pin_memory=True requires a CUDA or other accelerator backend" without one. On CUDA it would
    # start; that path is untested here, so it stays off rather than shipping unverified.

    # Routes (R3): for a Qwen3-MoE / Qwen2-MoE model (the MoE classes the trainer replays that SGLang records for)
    # the engine starts with enable_return_routed_experts and every request asks for them; decoded into
    # GenerationOutput.routes with the native engine's alignment (convert.decode_routed_experts). For Mixtral and
    # OLMoE, SGLang 0.5.20 records no per-layer routes (convert.ROUTE_RECORDING_ARCHITECTURES): the adapter warns
    # at start and brings none, and a trainer told to replay them stops at its first step, naming the missing
    # column (workers/engine/moe_forward.py). Verified at the unit level only: SGLang's CPU engine does not run
    # an MoE model (docs/moe.md).
    records_routes = True

    def __init__(self, config: SGLangRolloutConfig, engine: Any | None = None):
        """Start an engine from ``config``; or wrap ``engine``, already built (its processes then unknown)."""
        self.config = config
        name = f"{config.model_path} (device {config.device}, tp_size {config.tp_size})"
        if engine is None:
            sglang = import_sglang(config.device, config.tp_size)
            kwargs = config.server_kwargs()
            self.life = EngineLifecycle.start(lambda **handlers: sglang.Engine(**kwargs, **handlers), name)
        else:
            self.life = EngineLifecycle(engine, name, processes=[])
        self.engine = self.life.engine
        self.released_tags: set[str] = set()
        self._pad_token_id = config.pad_token_id
        self._eos_token_ids = None if config.eos_token_ids is None else token_id_list(config.eos_token_ids)
        self._tokenizer: Any = None  # a Hugging Face tokenizer, looked up on first use
        self._warned_seed = False
        self._routes = config.route_layout()
        if self._routes is None and config.record_routes is None:
            hf = _hf_config(config.model_path)
            if hf is not None and is_moe_config(hf):
                logger.warning(
                    "SGLang engine %s: a mixture of experts (%s) for which SGLang records no per-layer routes; "
                    "its outputs bring none (actor.moe.routing_replay=rollout cannot replay them)",
                    name,
                    architecture(hf),
                )
        self.weight_version = 0  # the policy version of the loaded weights (update_weights' ``version``)

    @classmethod
    def from_config(cls, model, rollout, tokenizer, *, rank: int = 0, tp_group=None) -> SGLangRollout:
        """The engine of one rank (`RolloutEngine.from_config`) on this process's device: CUDA, or SGLang's CPU
        engine (tests, CI), whose KV cache is sized for ``max_num_seqs`` whole sequences (no GPU memory to size
        it from)."""
        # the training package and the model loaders: imported only where a worker builds an engine
        from workers.distributed import default_device
        from workers.models import pad_token_id_of

        device = default_device().type
        engine_kwargs: dict[str, Any] = {"max_running_requests": rollout.max_num_seqs}
        if device == "cpu":
            max_tokens = rollout.max_num_seqs * (rollout.prompt_length + rollout.response_length)
            engine_kwargs |= {"max_total_tokens": max_tokens, "chunked_prefill_size": min(max_tokens, 2048)}
        return cls(
            SGLangRolloutConfig(
                model_path=model.path,
                device=device,
                tp_size=rollout.tensor_parallel_size,
                mem_fraction_static=rollout.gpu_memory_utilization,
                dtype=rollout_dtype(model, rollout),
                seed=rollout_seed(rollout, rank),
                bucket_mb=rollout.weight_bucket_mb,
                trust_remote_code=model.trust_remote_code,
                response_length=rollout.response_length,
                pad_token_id=pad_token_id_of(tokenizer),
                sampling=SamplingParams(
                    max_new_tokens=rollout.response_length,
                    temperature=rollout.temperature,
                    top_p=rollout.top_p,
                    top_k=rollout.top_k,
                ),
                engine_kwargs=engine_kwargs,
            )
        )

    @classmethod
    def config_errors(cls, model, rollout) -> list[str]:
        errors = []
        if importlib.util.find_spec("sglang") is None:
            errors.append(
                f"rollout.name={rollout.name} needs the sglang package: `make sglang-cpu` (CPU engine, for tests "
                "and CI) or `pip install -e '.[sglang]'` on a CUDA machine"
            )
        if rollout.compile:  # SGLang compiles (and captures CUDA graphs) by its own server arguments
            errors.append(
                f"rollout.compile=true compiles the native engine; rollout.name={rollout.name} does not take it "
                "(SGLang's own torch.compile is its enable_torch_compile server argument)"
            )
        if rollout.cuda_graphs is True:  # SGLang captures its own CUDA graphs
            errors.append(
                f"rollout.cuda_graphs=true replays the native engine's decode steps as CUDA graphs; rollout.name="
                f"{rollout.name} does not take it (SGLang captures its own CUDA graphs on a GPU unless its "
                "disable_cuda_graph server argument says not to); use rollout.cuda_graphs=auto or false"
            )
        return errors

    @classmethod
    def inference_options(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(SGLangRolloutConfig) if f.name != "model_path")

    @classmethod
    def for_inference(cls, model_path: str, tokenizer, **options) -> SGLangRollout:
        """An engine started from ``SGLangRolloutConfig(model_path, **options)``."""
        return cls(SGLangRolloutConfig(model_path=model_path, **options))

    @property
    def device(self) -> torch.device:
        """This process's current GPU, or the CPU for SGLang's CPU engine."""
        if self.config.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """SGLang's adapter reads its replies on its engine's loop: agents' requests must run there."""
        return self.engine.loop

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate for every prompt row; the batch layout of ``dataproto/BATCH_LAYOUT.md``."""
        t0 = time.perf_counter()
        meta = dict(prompts.meta_info)
        pad = self._resolve_pad_token_id(meta)
        params, response_length = sampling_from_meta(meta, self.config.sampling, self.config.response_length)
        self._check_seed(params)

        id_lists = prompt_rows(prompts, pad)
        self._check_prompt_lengths(id_lists)
        input_ids, sampling, source = expand_requests(id_lists, params)
        version = self.weight_version  # weights change only between calls: one version per call
        raw = self.life.call(
            f"generate_sequences of {len(input_ids)} requests (prompt lengths {_lengths(input_ids)})",
            lambda: self.engine.generate(
                input_ids=input_ids, sampling_params=sampling, **self._request_kwargs(params)
            ),
        )
        if isinstance(raw, Mapping):  # a single request comes back as a dict, a batch as a list
            raw = [raw]
        if len(raw) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(raw)} outputs for {len(input_ids)} requests")
        outputs = [self._output(r, params, len(ids)) for r, ids in zip(raw, input_ids)]
        for o in outputs:
            o.versions = [version] * len(o.token_ids)
        generated = sum(len(o.token_ids) for o in outputs)
        elapsed = time.perf_counter() - t0
        meta.update(
            {
                "eos_token_id": self._resolve_eos_token_ids(),
                "pad_token_id": pad,
                "timing_s/gen": elapsed,
                "rollout/generated_tokens": generated,
                "rollout/tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            }
        )
        return rollout_dataproto(
            prompts, source, input_ids, outputs, pad_token_id=pad, response_length=response_length, meta=meta
        )

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput | list[GenerationOutput]:
        """One request through ``Engine.async_generate``: one output, or a list of n when ``n > 1``
        (sample i of a seeded request uses seed + i)."""
        params = sampling_params if sampling_params is not None else self.config.sampling
        self._check_seed(params)
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty")
        self._check_prompt_lengths([ids])
        input_ids, sampling, _ = expand_requests([ids], params)
        single = params.n == 1
        raw = await self.life.acall(
            f"async generate of {params.n} sample(s) for a {len(ids)}-token prompt",
            self.engine.async_generate(
                input_ids=input_ids[0] if single else input_ids,
                sampling_params=sampling[0] if single else sampling,
                **self._request_kwargs(params),
            ),
        )
        raw = [raw] if isinstance(raw, Mapping) else list(raw)
        if len(raw) != params.n:
            raise RuntimeError(f"SGLang returned {len(raw)} outputs for {params.n} samples")
        outs = [self._output(r, params, len(ids)) for r in raw]
        return outs if params.n > 1 else outs[0]

    def _request_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The ``Engine.generate`` / ``async_generate`` keywords besides the prompts and sampling params."""
        kwargs: dict[str, Any] = {"return_logprob": params.logprobs}
        if self._routes is not None:
            # meta_info["routed_experts"], every position from the first (routed_experts_start_len=0)
            kwargs["return_routed_experts"] = True
        return kwargs

    def _output(self, raw: Mapping[str, Any], params: SamplingParams, prompt_length: int) -> GenerationOutput:
        return output_to_generation(
            raw, want_log_probs=params.logprobs, routes=self._routes, prompt_length=prompt_length
        )

    # ------------------------------------------------------------------ weights and memory
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        flush_cache: bool = True,
        abort_running: bool = False,
    ) -> dict:
        """Load HF-named tensors into the engine, ``bucket_mb`` at a time; returns bucket stats. ``version``
        (the trainer's update count) then becomes ``weight_version``, which later outputs' tokens record.

        Tensors should already be on the engine's ``device`` (``tensor`` format sends CUDA IPC handles, one
        serialization per TP rank, done by ``Engine.update_weights_from_tensor``). Weights change only
        between calls here, so there is nothing running to abort (``abort_running`` is refused). One bucket is
        materialised at a time; every bucket is sent with ``flush_cache=False`` and the prefix cache is
        flushed once at the end (``flush_cache=False`` skips that). SGLang's model loader raises on
        names the model does not have.
        """
        if abort_running:
            raise ValueError(
                "SGLangRollout: weights change only between calls; abort_running is not supported"
            )
        if WEIGHTS in self.released_tags:
            raise RuntimeError("weights are released; call resume_memory() before update_weights()")
        bucket_bytes = bucket_mb_to_bytes(self.config.bucket_mb)
        stats = {"buckets": 0, "tensors": 0, "bytes": 0, "max_bucket_bytes": 0}
        with self._weight_update_session():
            for bucket in iter_buckets(named_tensors, bucket_bytes):
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                self._send_bucket(bucket, stats["buckets"])
                stats["buckets"] += 1
                stats["tensors"] += len(bucket)
                stats["bytes"] += size
                stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], size)
        if flush_cache and stats["buckets"]:
            self.flush_cache()
        if version is not None:
            self.weight_version = int(version)
        return stats

    @contextlib.contextmanager
    def _weight_update_session(self):
        """SGLang >= 0.5.21 loads tensors only between begin_weight_update() and end_weight_update();
        0.5.20 and older have neither method and load them directly."""
        if not hasattr(self.engine, "begin_weight_update"):
            yield
            return
        _check_result(
            "begin_weight_update", self.life.call("begin_weight_update", self.engine.begin_weight_update)
        )
        try:
            yield
        finally:
            _check_result(
                "end_weight_update", self.life.call("end_weight_update", self.engine.end_weight_update)
            )

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], index: int) -> None:
        what = f"update_weights_from_tensor (bucket {index}, {len(bucket)} tensors from {bucket[0][0]})"
        if self.config.weight_load_format == "tensor":
            result = self.life.call(
                what,
                lambda: self.engine.update_weights_from_tensor(
                    named_tensors=bucket, load_format=None, flush_cache=False
                ),
            )
            _check_result("update_weights_from_tensor", result)
            return
        # flattened_bucket: one buffer per bucket (per dtype on SGLang versions without multi-dtype
        # buckets), serialized once per TP rank by us -- Engine passes the list through unchanged.
        metadata_cls, serialize, multi_dtype = _flattened_bucket_api()
        for group in [bucket] if multi_dtype else _split_by_dtype(bucket):
            flat = flatten_bucket(group)
            metadata = [
                metadata_cls(
                    name=m.name,
                    shape=torch.Size(m.shape),
                    dtype=m.dtype,
                    start_idx=m.offset,
                    end_idx=m.end,
                    numel=m.nbytes,
                )
                for m in flat.metas
            ]
            payload = {"flattened_tensor": flat.buffer, "metadata": metadata}
            serialized = [serialize(payload) for _ in range(self.config.tp_size)]
            result = self.life.call(
                what,
                functools.partial(
                    self.engine.update_weights_from_tensor,
                    named_tensors=serialized,
                    load_format="flattened_bucket",
                    flush_cache=False,
                ),
            )
            _check_result("update_weights_from_tensor", result)

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache, and the weights too when ``weights``; the engine must be idle.

        CUDA-graph memory is released as well when ``config.release_cuda_graph`` is set.
        """
        tags = (
            [KV_CACHE]
            + ([WEIGHTS] if weights else [])
            + ([CUDA_GRAPH] if self.config.release_cuda_graph else [])
        )
        tags = [t for t in tags if t not in self.released_tags]
        if tags:
            self.life.wait_idle()  # SGLang asserts idleness here; its scheduler dies otherwise
            self.life.call(
                f"release_memory_occupation {tags}", lambda: self.engine.release_memory_occupation(tags=tags)
            )
            self.released_tags.update(tags)

    def resume_memory(self, kv_cache: bool = True) -> None:
        """Re-allocate released weights (to be refilled by ``update_weights``) and, when ``kv_cache``,
        the KV cache (and CUDA graphs)."""
        tags = [t for t in (WEIGHTS, CUDA_GRAPH, KV_CACHE) if t in self.released_tags]
        if not kv_cache:
            tags = [t for t in tags if t == WEIGHTS]
        if tags:
            self.life.call(
                f"resume_memory_occupation {tags}", lambda: self.engine.resume_memory_occupation(tags=tags)
            )
            self.released_tags.difference_update(tags)

    def flush_cache(self) -> None:
        """Drop SGLang's radix prefix cache (stale after a weight change), once the engine is idle."""
        self.life.wait_idle()

    def shutdown(self) -> None:
        """Stop the engine's own processes (SGLang's ``Engine.shutdown`` would kill every child of this
        process, Ray's included)."""
        self.life.shutdown()

    # ------------------------------------------------------------------ helpers
    def _tokenizer_or_none(self):
        if self._tokenizer is None:
            self._tokenizer = getattr(getattr(self.engine, "tokenizer_manager", None), "tokenizer", None)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.config.model_path, trust_remote_code=self.config.trust_remote_code
            )
        return self._tokenizer

    def _resolve_pad_token_id(self, meta_info: Mapping[str, Any]) -> int:
        if meta_info.get("pad_token_id") is not None:
            return int(meta_info["pad_token_id"])
        if self._pad_token_id is None:
            tokenizer = self._tokenizer_or_none()
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is None:
                raise ValueError(
                    f"tokenizer of {self.config.model_path} has neither a pad nor an eos token; set "
                    "SGLangRolloutConfig.pad_token_id or meta_info['pad_token_id']"
                )
            self._pad_token_id = int(pad)
        return self._pad_token_id

    def _resolve_eos_token_ids(self) -> list[int]:
        """The ids SGLang stops on by default: generation config + model config + tokenizer EOS."""
        if self._eos_token_ids is None:
            from transformers import AutoConfig, GenerationConfig

            ids: list[int] = []
            path, trust = self.config.model_path, self.config.trust_remote_code
            try:
                ids += token_id_list(GenerationConfig.from_pretrained(path).eos_token_id)
            except OSError:  # no generation_config.json
                pass
            ids += token_id_list(AutoConfig.from_pretrained(path, trust_remote_code=trust).eos_token_id)
            ids += token_id_list(self._tokenizer_or_none().eos_token_id)
            self._eos_token_ids = sorted(set(ids))
        return list(self._eos_token_ids)

    def _check_prompt_lengths(self, id_lists: list[list[int]]) -> None:
        """SGLang rejects a whole batch for one prompt that does not fit its context; name the rows instead."""
        context = getattr(getattr(self.engine, "tokenizer_manager", None), "context_len", None)
        if context is None:
            return
        long = [(i, len(ids)) for i, ids in enumerate(id_lists) if len(ids) >= context]
        if long:
            rows = ", ".join(f"row {i} ({n} tokens)" for i, n in long[:8])
            raise ValueError(
                f"prompt {rows} does not fit the SGLang engine's context length of {context} tokens "
                f"(model {self.config.model_path}); shorten it or raise engine_kwargs['context_length']"
            )

    def _check_seed(self, params: SamplingParams) -> None:
        if params.seed is not None and not self.config.deterministic and not self._warned_seed:
            self._warned_seed = True
            logger.warning(
                "SamplingParams.seed is set but the SGLang engine was started without "
                "enable_deterministic_inference (SGLangRolloutConfig.deterministic=False); SGLang ignores "
                "sampling_seed then, so seeded requests are not reproducible"
            )


def _hf_config(model_path: str) -> dict[str, Any] | None:
    """The model's ``config.json`` (None where ``model_path`` is not a local folder holding one)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text())


def _lengths(id_lists: list[list[int]]) -> str:
    lengths = [len(ids) for ids in id_lists]
    return ", ".join(map(str, lengths[:8])) + (", ..." if len(lengths) > 8 else "")


def _split_by_dtype(bucket: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in bucket:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def _check_result(what: str, result: Any) -> None:
    """SGLang's weight calls return ``(success, message)``; raise on failure."""
    success, message = None, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        success, message = result
    elif isinstance(result, Mapping) and "success" in result:
        success, message = bool(result["success"]), result.get("message")
    if success is False:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def config_from_dict(cfg: Mapping[str, Any]) -> SGLangRolloutConfig:
    """An ``SGLangRolloutConfig`` from a plain mapping (e.g. an OmegaConf node); unknown keys are an error."""
    names = {f.name for f in dataclasses.fields(SGLangRolloutConfig)}
    unknown = sorted(set(cfg) - names)
    if unknown:
        raise KeyError(f"unknown SGLang rollout config key(s) {unknown}; known: {sorted(names)}")
    return SGLangRolloutConfig(**dict(cfg))
