"""The native engine's decode step replayed as CUDA graphs.

A decode step of a small model on a GPU is hundreds of small kernels, each launched from Python: the launches,
not the memory reads, set its time (BENCHMARKS.md "On a GPU": 1-2% of the HBM bound). A CUDA graph records
the kernels of one step once and replays them with one launch. A graph replays fixed shapes at fixed
addresses, so the step runs over:

* **static buffers**: the running rows' tokens, positions, uniform numbers and per-row temperatures are copied
  into device buffers of ``max_num_seqs`` rows before each replay (one host-to-device copy per buffer), and the
  sampled tokens and their log-probs are read back after it (the step's one host read);
* **buckets**: a graph per (batch bucket, key-length bucket, sampling mode). The batch is padded up to its
  bucket (1, 2, 4, 8, then steps of 16 up to ``max_num_seqs``; padding rows decode token 0 at position 0 of
  their free slot, which any later prefill overwrites) and attention reads every row's cache up to the
  key-length bucket (powers of two from 64 up to ``max_model_len``) under a mask made on the device
  (``NativeCausalLM.decode_static``). Graphs are captured when a bucket is first used, all into one shared
  memory pool, and kept until the weights or the KV cache move;
* **fixed addresses**: the weights live in one flat buffer and the KV cache in two tensors, which
  ``update_weights`` and ``load_adapter`` copy into in place, so a weight update needs no re-capture. Releasing
  the weights or the cache (``release_memory``) drops the graphs with their pool; each graph also checks the
  addresses it was captured over before every replay and is re-captured if they changed.

Sampling is in the graph for greedy rows and plain temperature sampling (``sampler.temperature_sample``), the
same numbers as the eager sampler for the same uniforms. A batch with top-k or top-p rows replays the forward
graph and samples its logits eagerly (``BatchSampler``: its candidate count depends on the batch's settings).

``replay="eager"`` runs the very same static step without capturing it: what a CUDA graph would replay, for a
machine without CUDA (the CPU tests) and for telling a capture problem from a static-step problem on a GPU.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.rollout.native.model import NativeCausalLM
from workers.rollout.native.sampler import BatchSampler, clip_uniforms, greedy_sample, temperature_sample

SMALLEST_KV_BUCKET = 64
REPLAYS = ("cuda", "eager")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


def kv_buckets(max_model_len: int) -> list[int]:
    """Powers of two from ``SMALLEST_KV_BUCKET`` below ``max_model_len``, then ``max_model_len``."""
    sizes, t = [], SMALLEST_KV_BUCKET
    while t < max_model_len:
        sizes.append(t)
        t *= 2
    return [*sizes, max_model_len]


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket that holds ``n``."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is larger than the largest bucket {buckets[-1]}")
    return buckets[i]


def graph_refusal(model: NativeCausalLM) -> str | None:
    """Why this model's decode step cannot be captured, or None."""
    if model.tp_group is not None:
        return (
            "tensor parallelism: the row-parallel all-reduces would have to be captured too (NCCL inside the "
            "graph), which no test here can check; the engine runs TP replicas without graphs"
        )
    if model.spec.moe_layers:
        return (
            "a mixture of experts: its tokens are sorted into expert groups of data-dependent sizes and its "
            "routes are recorded to host lists every step"
        )
    return None


@dataclass
class _Graph:
    run: Callable[[], None]  # replays the step: a CUDA graph's replay, or the step itself when eager
    outputs: list[torch.Tensor]  # what a replay leaves: (tokens, log-probs), or (logits,) to sample eagerly
    addresses: tuple[int, ...]  # the weights' and the KV cache's addresses the graph was captured over
    handle: object = None  # the torch.cuda.CUDAGraph (kept alive with its pool memory)


class DecodeGraphs:
    """Captures and replays ``model``'s decode step per bucket (see the module docstring). Not thread-safe:
    the engine calls it under its model lock."""

    def __init__(self, model: NativeCausalLM, replay: str = "cuda", stats: dict | None = None):
        if replay not in REPLAYS:
            raise ValueError(f"replay must be one of {REPLAYS}, got {replay!r}")
        refusal = graph_refusal(model)
        if refusal is not None:
            raise ValueError(f"the decode step cannot be captured as CUDA graphs: {refusal}")
        if replay == "cuda" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {model.device}")
        self.model = model
        self.replay = replay
        self.batch_buckets = batch_buckets(model.max_num_seqs)
        self.kv_buckets = kv_buckets(model.max_model_len)
        n, dev = model.max_num_seqs, model.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.uniforms = torch.zeros(n, 1, dtype=torch.float32, device=dev)
        self.temps = torch.ones(n, 1, dtype=torch.float32, device=dev)
        self.greedy = torch.ones(n, dtype=torch.bool, device=dev)
        self._graphs: dict[tuple[int, int, str], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if replay == "cuda" else None
        self._sampler: BatchSampler | None = None  # the sampler whose settings the buffers hold
        # counted into the engine's stats (``stats``) when it passes them: one record, no copies
        self.stats = stats if stats is not None else {}
        for key in ("graph_captures", "graph_capture_s", "graph_replays", "graph_memory_bytes"):
            self.stats.setdefault(key, 0)

    @property
    def captured(self) -> list[tuple[int, int, str]]:
        """The (batch bucket, key-length bucket, mode) of every graph held now."""
        return sorted(self._graphs)

    def clear(self) -> None:
        """Drop every graph and its memory pool (before the weights or the KV cache are freed)."""
        self._graphs = {}
        self.stats["graph_memory_bytes"] = 0
        if self._pool is not None:
            self._pool = torch.cuda.graph_pool_handle()

    def metrics(self, since: dict) -> dict[str, float]:
        """The ``generate_sequences`` metrics of the graphs since the stats were ``since``: captures and their
        seconds (part of ``timing_s/gen``), replays, graphs held and the memory their pool took."""
        return {
            "timing_s/graph_capture": self.stats["graph_capture_s"] - since["graph_capture_s"],
            "rollout/num_graph_captures": self.stats["graph_captures"] - since["graph_captures"],
            "rollout/num_graph_replays": self.stats["graph_replays"] - since["graph_replays"],
            "rollout/max_graphs_held": len(self._graphs),
            "rollout/max_graph_memory_gib": self.stats["graph_memory_bytes"] / 2**30,
        }

    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        sampler: BatchSampler,
        uniforms: list[float] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the running rows (slots ``0..B-1``) and sample: (tokens [B], log-probs [B]) on the device."""
        B = len(tokens)
        b = bucket_for(self.batch_buckets, B)
        t = bucket_for(self.kv_buckets, max(positions) + 1)
        pad = b - B
        self.tokens[:b].copy_(torch.tensor(tokens + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        mode = "greedy" if sampler.all_greedy else "logits" if sampler.truncates else "sample"
        if mode == "sample":
            assert uniforms is not None, "a batch with sampled rows needs one uniform number per row"
            self.uniforms[:b, 0].copy_(torch.tensor(clip_uniforms(uniforms) + [0.0] * pad), non_blocking=True)
            if sampler is not self._sampler:  # the batch's settings change only when rows join or leave
                self.temps[:B].copy_(sampler.temps)
                self.temps[B:b].fill_(1.0)
                self.greedy[:b].copy_(torch.tensor(sampler.greedy_rows + [True] * pad))
                self._sampler = sampler
        graph = self._graph(b, t, mode)
        graph.run()
        self.stats["graph_replays"] += 1
        if mode == "logits":  # top-k / top-p rows: the forward was replayed, sampling runs here
            return sampler.sample(graph.outputs[0][:B], uniforms)
        return graph.outputs[0][:B], graph.outputs[1][:B]

    def _addresses(self) -> tuple[int, ...]:
        m = self.model
        k_cache, v_cache = m._kv_cache()
        assert m.store.flat is not None, "weights released"
        return (m.store.flat.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def _graph(self, b: int, t: int, mode: str) -> _Graph:
        addresses = self._addresses()
        graph = self._graphs.get((b, t, mode))
        if graph is not None and graph.addresses == addresses:
            return graph
        if any(g.addresses != addresses for g in self._graphs.values()):
            self.clear()  # the weights or the cache moved: every graph reads stale addresses
        t0 = time.perf_counter()
        graph = self._capture(b, t, mode, addresses)
        self.stats["graph_captures"] += 1
        self.stats["graph_capture_s"] += time.perf_counter() - t0
        self._graphs[b, t, mode] = graph
        return graph

    def _step(self, b: int, t: int, mode: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        model = self.model

        def step() -> tuple[torch.Tensor, ...]:
            logits = model.decode_static(self.tokens[:b], self.positions[:b], t)
            if mode == "greedy":
                return greedy_sample(logits)
            if mode == "sample":
                return temperature_sample(logits, self.temps[:b], self.uniforms[:b], self.greedy[:b])
            return (logits,)

        return step

    def _capture(self, b: int, t: int, mode: str, addresses: tuple[int, ...]) -> _Graph:
        step = self._step(b, t, mode)
        if self.replay == "eager":
            outputs: list[torch.Tensor] = []

            def run() -> None:
                outputs[:] = step()

            run()  # the warm-up run a capture makes
            return _Graph(run, outputs, addresses)
        # Warm up on a side stream (cuBLAS workspaces, compiled blocks' first call), then record the step into
        # the shared pool. The warm-up writes the keys/values the replay writes, at the same positions.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        reserved = torch.cuda.memory_reserved()
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: the engine steps on a worker thread while other threads of the process may use CUDA
        with torch.cuda.graph(cuda_graph, pool=self._pool, capture_error_mode="thread_local"):
            out = step()
        self.stats["graph_memory_bytes"] += max(0, torch.cuda.memory_reserved() - reserved)
        return _Graph(cuda_graph.replay, list(out), addresses, handle=cuda_graph)
