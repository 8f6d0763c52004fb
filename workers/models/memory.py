"""What one device should hold during a colocated RL step: an estimate to put beside measured peaks.

Terms (bytes; ``P`` parameters, ``W`` FSDP ranks sharing the training state):

    train state     P * (param + grad + 2 * 4) / W     fp32 AdamW moments; params and grads in the engine dtype
    fsdp gather     2 * largest unit * compute bytes   mixed precision or W > 1: one FSDP unit unsharded in the
                                                       compute dtype, plus its gradient, during backward (the
                                                       root unit holds the embedding, the largest one)
    reference       P * param bytes                    frozen copy for the KL term (actor.use_kl_loss)
    rollout weights P * rollout bytes                  the rollout engine's own copy (one per colocated rank)
    KV cache        max_num_seqs * max_model_len * 2 * layers * kv_heads * head_dim * rollout bytes
                                                       the native engine's static cache, allocated while it
                                                       generates (released between rollouts by default)
    activations     tokens * layers * (6 H + 3 I) * compute bytes + 3 * min(response tokens, chunk) * V * 4
                    + V * H * 4                        saved inputs of the norms, projections, attention and MLP
                                                       per token and layer; the chunked vocabulary head
                                                       (workers/engine/vocab_head.py) holds about three fp32
                                                       [chunk, V] buffers while it recomputes a chunk in
                                                       backward (``chunk_tokens``: 256 MiB each), and an fp32
                                                       accumulator of the head's gradient

and per stage: ``gen`` = reference + rollout weights + KV cache + the sampling logits, plus the train state
unless the colocated trainer is offloaded while the engine generates (the hybrid engine's rollout role does);
``update_actor`` = train state + reference + rollout weights + gather + activations of one micro-batch.

Checked on an H200 (Qwen2-0.5B shape, 256 samples of <= 256 tokens, a 16,384-token micro-batch; BENCHMARKS.md,
the GPU check), before the chunked head: gen 4.34 GiB measured against 3.84 estimated, update_actor 73.6
against 71.6 when the vocabulary term was five fp32 [response tokens, V] buffers (46 GiB of it). Allocator fragmentation, the CUDA
context and sampling temporaries are not modelled; a measured peak well above the estimate points at something
held that should not be.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = float(1 << 30)
CHUNK_BYTES = 256 << 20  # one fp32 [chunk x vocab] buffer of the chunked vocabulary head
VOCAB_HEAD_BUFFERS = (
    3  # [chunk x vocab] fp32 buffers alive at once in its backward: logits, softmax, gradient
)


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk of the vocabulary head, so that one fp32 [chunk x vocab] buffer takes ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def num_params(config) -> int:
    """Parameters of the causal LM that ``config`` (a transformers config) describes, tied weights once;
    counted on the meta device, so any architecture and size costs no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def activation_bytes(config, tokens: int, response_tokens: int, compute_bytes: int = 4) -> int:
    """Saved activations of one micro-batch's forward + backward (see the module docstring)."""
    per_token = config.num_hidden_layers * (6 * config.hidden_size + 3 * config.intermediate_size)
    vocab = config.vocab_size
    head = (
        4 * VOCAB_HEAD_BUFFERS * min(response_tokens, chunk_tokens(vocab)) * vocab
        + 4 * vocab * config.hidden_size
    )
    return compute_bytes * tokens * per_token + head


def kv_bytes(config, seqs: int, max_len: int, dtype: torch.dtype) -> int:
    """Static KV cache of ``seqs`` slots of ``max_len`` positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return seqs * max_len * per_token


@dataclass
class MemoryEstimate:
    """Bytes per term and per stage for one device (see the module docstring)."""

    params: int
    train_state: int
    fsdp_gather: int
    reference: int
    rollout_weights: int
    kv_cache: int
    sampling_logits: int
    activations: int

    trainer_offloaded_in_gen: bool = True

    @property
    def gen(self) -> int:
        resident = 0 if self.trainer_offloaded_in_gen else self.train_state
        return resident + self.reference + self.rollout_weights + self.kv_cache + self.sampling_logits

    @property
    def update_actor(self) -> int:
        return self.train_state + self.reference + self.rollout_weights + self.fsdp_gather + self.activations

    def gib(self) -> dict[str, float]:
        """Every term and both stages in GiB (the parameter count as is)."""
        terms = {
            k: v / GIB for k, v in asdict(self).items() if k not in ("params", "trainer_offloaded_in_gen")
        }
        return {
            "params": float(self.params),
            **terms,
            "gen": self.gen / GIB,
            "update_actor": self.update_actor / GIB,
        }


def estimate_colocated_step(
    config,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype = torch.float32,
    rollout_dtype: torch.dtype = torch.float32,
    fsdp_world: int = 1,
    reference: bool = False,
    max_num_seqs: int,
    max_model_len: int,
    micro_batch_tokens: int,
    micro_batch_response_tokens: int,
    trainer_offloaded_in_gen: bool = True,
) -> MemoryEstimate:
    """The estimate for one rank of a colocated step (actor + rollout engine [+ reference]) of the causal LM
    ``config``; ``micro_batch_*``: the largest micro-batch of the update (its real tokens and the response
    tokens among them)."""
    p = num_params(config)
    pb, cb, rb = param_dtype.itemsize, compute_dtype.itemsize, rollout_dtype.itemsize
    gathered = fsdp_world > 1 or compute_dtype != param_dtype
    return MemoryEstimate(
        params=p,
        train_state=p * (2 * pb + 8) // fsdp_world,
        fsdp_gather=2 * config.vocab_size * config.hidden_size * cb if gathered else 0,
        reference=p * pb if reference else 0,
        rollout_weights=p * rb,
        kv_cache=kv_bytes(config, max_num_seqs, max_model_len, rollout_dtype),
        sampling_logits=4 * max_num_seqs * config.vocab_size,
        activations=activation_bytes(config, micro_batch_tokens, micro_batch_response_tokens, cb),
        trainer_offloaded_in_gen=trainer_offloaded_in_gen,
    )
