"""What one device should hold during a colocated RL step: an estimate to put beside measured peaks, and the
largest micro-batch that fits a device (`size_colocated_run`, the CLI ``python -m benchmarks.size_run``).

A pure function of a transformers config and the run's settings: parameters are counted on the meta device (any
architecture and size, no memory), the rest is arithmetic. Terms (bytes; ``P`` parameters, ``W`` FSDP ranks
sharing the training state, ``pb`` / ``cb`` / ``rb`` the bytes of the param / compute / rollout dtype):

    train state     P * 4 * pb / W                     params, grads and both AdamW moments, all in the param
                                                       dtype (model.dtype; torch's AdamW keeps its moments in the
                                                       parameters' dtype: fp32 only when the params are)
    fsdp gather     W > 1: (root + 2 * largest layer) * cb + largest layer * (cb + 4 if cb != 4 else cb)
                                                       FSDP2 units are the decoder layers plus the root (what is
                                                       outside them: embeddings, final norm, an untied head). The
                                                       root stays unsharded from forward to the end of backward;
                                                       one layer computes while the next is prefetched; one
                                                       layer's unsharded gradient in the compute dtype and its
                                                       fp32 copy for the reduce-scatter (reduce_dtype float32).
                                                       The root's own reduce-scatter comes last, once the
                                                       activations are freed, so it is not added
                    W = 1 (no FSDP; mixed precision is autocast): P * cb when cb != pb, the compute-dtype
                                                       copies of the weights that the forward saves for backward;
                                                       0 when the dtypes agree
    reference       P * pb / W                         frozen copy for the KL term (actor.use_kl_loss): an FSDP
                                                       engine of its own (workers/roles/reference.py, optim=None),
                                                       in model.dtype, sharded over the same W ranks when W > 1;
                                                       never offloaded. A LoRA actor loads none (its base is it)
    rollout weights (P - root) * rb / tp + root * rb   the rollout engine's own copy on every colocated rank,
                                                       resident in both stages; the native engine with
                                                       rollout.tensor_model_parallel_size = tp > 1 splits the
                                                       layers and replicates embeddings, the final norm and the
                                                       head (and each layer's norms: not counted, a few H)
    KV cache        max_num_seqs * max_model_len * 2 * layers * kv_heads / tp * head_dim * rb
                                                       the native engine's static cache, allocated while it
                                                       generates; released between rollouts unless
                                                       rollout.free_cache_engine is false (then held in the update)
    sampling logits 4 * max_num_seqs * V               one fp32 [slots, V] row of logits per running request
    decode graphs   cuda_graphs: 4 * 4 * S * V + S * L * (rb + 1 + kv_heads * rb) + max(S * heads * L * (2 rb + 4),
                    4 * S * I * rb)                    (S = max_num_seqs, L = max_model_len) the native engine's
                                                       CUDA-graph pool (workers/rollout/native/graphs.py), held
                                                       through the generation: the sampler's peak of 4 fp32
                                                       [S, V] buffers (logits, log-softmax, exp, cumsum) and one
                                                       step's key mask plus the larger of attention's scores and
                                                       the MLP's intermediates. 0 where auto leaves graphs off
                                                       (rollout_tp > 1, a mixture of experts). Not counted: the
                                                       [b, V] logits a top-k/top-p graph keeps per bucket, and
                                                       smaller buckets' blocks kept beside the largest's
    activations     tokens * sum over layers of the per-token bytes below + 3 * min(response tokens, chunk) * V * 4
                    + V * H * 4
                    dense layer: (4 H + 2 Q + 3 I) * cb
                    MoE layer:   (4 H + 2 Q + k * (3 Im + 2 H) + 3 Is) * cb + E * (cb + 4)
                                                       saved inputs of the norms, projections, attention and MLP
                                                       per token and layer (Q = heads * head_dim, = H for most
                                                       dense models); a MoE layer (num_experts E,
                                                       num_experts_per_tok k, moe_intermediate_size Im, a shared
                                                       expert's Is; dense where decoder_sparse_step /
                                                       mlp_only_layers say so) computes k experts per token: the
                                                       token's k copies in and out, each expert's gate/up/product,
                                                       and the router's logits plus their fp32 softmax; the
                                                       chunked vocabulary head (workers/engine/vocab_head.py)
                                                       holds about three fp32 [chunk, V] buffers while it
                                                       recomputes a chunk in backward (``chunk_tokens``: 256 MiB
                                                       each), and an fp32 accumulator of the head's gradient
                    with model.activation_checkpointing (HF gradient checkpointing of every decoder layer): the
                    layers keep only their input, tokens * layers * H * cb, and one layer's full activations
                    (the largest) exist while it is recomputed in backward; the head term is unchanged

and per stage: ``gen`` = reference + rollout weights + KV cache + the sampling logits + the decode graphs, plus
the train state unless the colocated trainer is offloaded while the engine generates (the hybrid engine's
rollout role does); ``update_actor`` = train state + reference + rollout weights + gather + activations of one
micro-batch (+ the KV cache and the decode graphs when the cache is not freed).

Where the code's choices enter: the FSDP engine keeps its parameters in ``model.dtype`` (float32 by default) and
computes in bf16 on CUDA (``EngineConfig.mixed_precision`` None: FSDP2's ``MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)`` when W > 1, autocast when W = 1); the rollout engine's dtype ``auto`` is bf16
on CUDA. The residual stream is counted in the compute dtype: true under FSDP2's bf16 parameters; under
autocast (W = 1) it is fp32 (the embedding's output), which the activation-checkpointing term then undercounts.
A Megatron actor (the only one the code lets use rollout tp > 1) shards its state by tp x pp x dp and is not
described by the train-state and gather terms here.

Checked on an H200 (Qwen2-0.5B shape, 256 samples of <= 256 tokens, a 16,384-token micro-batch, one rank;
BENCHMARKS.md, the GPU check), before the chunked head: gen 4.34 GiB measured against 3.84 estimated,
update_actor 73.6 against 71.6 when the vocabulary term was five fp32 [response tokens, V] buffers (46 GiB of it)
and the one-rank gather term was two copies of the embedding (now the whole model's bf16 copy: +0.4 GiB). That
is the only measured point (without decode graphs): the MoE, sharded-reference, activation-checkpointing,
rollout-tp and decode-graph terms are read from the code, not measured on a GPU. On the CPU, the tensors a tiny fp32 Qwen3-MoE forward saves for backward
grow with k and Im, not E, as the MoE term says, but hold four intermediate-sized tensors per dense MLP and per
routed expert where the model counts three (tests/workers/test_memory_estimate.py); the model keeps three, which
the GPU point fits. Allocator fragmentation, the CUDA context and the eager sampler's temporaries (decode
graphs off) are not modelled (`size_colocated_run` keeps a margin for them); a measured peak well above the estimate points at
something held that should not be.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

GIB = float(1 << 30)
CHUNK_BYTES = 256 << 20  # one fp32 [chunk x vocab] buffer of the chunked vocabulary head
VOCAB_HEAD_BUFFERS = (
    3  # [chunk x vocab] fp32 buffers alive at once in its backward: logits, softmax, gradient
)


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk of the vocabulary head, so that one fp32 [chunk x vocab] buffer takes ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a causal LM by FSDP unit (tied weights once): ``total``; ``root``, what lies outside the
    decoder layers (embeddings, final norm, an untied head: FSDP2's root unit); the largest decoder layer."""

    total: int
    root: int
    largest_layer: int


def param_counts(config) -> ParamCounts:
    """`ParamCounts` of the causal LM that ``config`` (a transformers config) describes, built on the meta
    device. Decoder layers are the modules whose class the model names in ``_no_split_modules``, the units
    `workers.engine.fsdp_engine.decoder_layers` shards."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    total = sum(p.numel() for p in model.parameters())
    return ParamCounts(total=total, root=total - sum(layers), largest_layer=max(layers, default=0))


def num_params(config) -> int:
    """Parameters of the causal LM that ``config`` (a transformers config) describes, tied weights once;
    counted on the meta device, so any architecture and size costs no memory."""
    return param_counts(config).total


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_experts(config) -> int:
    """Routed experts per MoE layer (``num_experts``, or Mixtral's ``num_local_experts``); 0 for a dense model."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def moe_layers(config) -> list[bool]:
    """Which decoder layers are sparse (Qwen2/3-MoE's rule: not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; every layer for Mixtral-style configs without those keys)."""
    if num_experts(config) == 0:
        return [False] * config.num_hidden_layers
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


def layer_activation_bytes(config, compute_bytes: int) -> list[int]:
    """Saved activations per token of each decoder layer's forward, in bytes (the module docstring's dense and
    MoE layer terms)."""
    h = config.hidden_size
    attention = 4 * h + 2 * config.num_attention_heads * _head_dim(config)
    dense = compute_bytes * (attention + 3 * config.intermediate_size)
    out = []
    for sparse in moe_layers(config):
        if not sparse:
            out.append(dense)
            continue
        k = config.num_experts_per_tok
        im = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        routed = k * (3 * im + 2 * h)
        out.append(
            compute_bytes * (attention + routed + 3 * shared) + num_experts(config) * (compute_bytes + 4)
        )
    return out


def activation_bytes(
    config,
    tokens: int,
    response_tokens: int,
    compute_bytes: int = 4,
    *,
    activation_checkpointing: bool = False,
) -> int:
    """Saved activations of one micro-batch's forward + backward (see the module docstring)."""
    per_layer = layer_activation_bytes(config, compute_bytes)
    if activation_checkpointing:
        per_token = config.num_hidden_layers * config.hidden_size * compute_bytes + max(per_layer)
    else:
        per_token = sum(per_layer)
    vocab = config.vocab_size
    head = (
        4 * VOCAB_HEAD_BUFFERS * min(response_tokens, chunk_tokens(vocab)) * vocab
        + 4 * vocab * config.hidden_size
    )
    return tokens * per_token + head


def decode_graph_bytes(config, seqs: int, max_len: int, dtype: torch.dtype, tp: int = 1) -> int:
    """The native engine's CUDA-graph memory pool of ``seqs`` slots of ``max_len`` positions in ``dtype`` (the
    module docstring's decode graphs term); 0 where the engine captures none (``tp`` > 1, a mixture of experts:
    ``graphs.graph_refusal``)."""
    if tp > 1 or num_experts(config):
        return 0
    rb = dtype.itemsize
    # the logits, their log_softmax, its exp and the cumsum: fp32 [S, V] each
    logits_and_sampler = 4 * 4 * seqs * config.vocab_size
    mask = seqs * max_len * (rb + 1 + config.num_key_value_heads * rb)
    attention = seqs * config.num_attention_heads * max_len * (2 * rb + 4)
    mlp = 4 * seqs * config.intermediate_size * rb
    return logits_and_sampler + mask + max(attention, mlp)


def kv_bytes(config, seqs: int, max_len: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Static KV cache of ``seqs`` slots of ``max_len`` positions on one rank of a ``tp``-way replica (each rank
    holds its ``kv_heads / tp`` heads)."""
    per_token = 2 * config.num_hidden_layers * (config.num_key_value_heads // tp) * _head_dim(config)
    return seqs * max_len * per_token * dtype.itemsize


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
    decode_graphs: int = 0  # the native engine's CUDA-graph pool (rollout.cuda_graphs on)

    trainer_offloaded_in_gen: bool = True
    kv_cache_in_update: bool = False  # rollout.free_cache_engine false: the cache stays allocated

    @property
    def gen(self) -> int:
        resident = 0 if self.trainer_offloaded_in_gen else self.train_state
        return (
            resident
            + self.reference
            + self.rollout_weights
            + self.kv_cache
            + self.sampling_logits
            + self.decode_graphs
        )

    @property
    def update_actor(self) -> int:
        kv = self.kv_cache + self.decode_graphs if self.kv_cache_in_update else 0  # released together
        return (
            self.train_state
            + self.reference
            + self.rollout_weights
            + self.fsdp_gather
            + self.activations
            + kv
        )

    def terms(self, stage: str) -> dict[str, int]:
        """The terms that make up ``stage`` ("gen" or "update_actor"), in bytes."""
        if stage == "gen":
            names = ["reference", "rollout_weights", "kv_cache", "sampling_logits", "decode_graphs"]
            names = names if self.trainer_offloaded_in_gen else ["train_state", *names]
        elif stage == "update_actor":
            names = ["train_state", "reference", "rollout_weights", "fsdp_gather", "activations"]
            names = [*names, "kv_cache", "decode_graphs"] if self.kv_cache_in_update else names
        else:
            raise ValueError(f"stage must be 'gen' or 'update_actor', got {stage!r}")
        return {n: getattr(self, n) for n in names}

    def gib(self) -> dict[str, float]:
        """Every term and both stages in GiB (the parameter count as is)."""
        terms = {k: v / GIB for k, v in asdict(self).items() if k != "params" and not isinstance(v, bool)}
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
    activation_checkpointing: bool = False,
    rollout_tp: int = 1,
    free_cache_engine: bool = True,
    cuda_graphs: bool = True,
    counts: ParamCounts | None = None,
) -> MemoryEstimate:
    """The estimate for one rank of a colocated step (actor + rollout engine [+ reference]) of the causal LM
    ``config``; ``micro_batch_*``: the largest micro-batch of the update (its real tokens and the response
    tokens among them); ``rollout_tp``: rollout.tensor_model_parallel_size; ``cuda_graphs``: the native engine
    replays its decode steps as CUDA graphs (rollout.cuda_graphs; auto turns them on with CUDA, where this
    estimate applies, except under rollout tp > 1 or for a mixture of experts, which the term knows);
    ``counts``: `param_counts(config)` when the caller has it (it builds the model on the meta device)."""
    if rollout_tp < 1 or config.num_key_value_heads % rollout_tp:
        raise ValueError(f"rollout_tp={rollout_tp} must be >= 1 and divide num_key_value_heads")
    if rollout_tp > 1 and num_experts(config):
        raise ValueError("the native engine runs a mixture-of-experts model with rollout_tp=1 only")
    c = counts or param_counts(config)
    p = c.total
    pb, cb, rb = param_dtype.itemsize, compute_dtype.itemsize, rollout_dtype.itemsize
    if fsdp_world > 1:
        grad = cb + 4 if cb != 4 else cb
        gather = (c.root + 2 * c.largest_layer) * cb + c.largest_layer * grad
    else:
        gather = p * cb if compute_dtype != param_dtype else 0
    return MemoryEstimate(
        params=p,
        train_state=p * 4 * pb // fsdp_world,
        fsdp_gather=gather,
        reference=p * pb // fsdp_world if reference else 0,
        rollout_weights=(p - c.root) * rb // rollout_tp + c.root * rb,
        kv_cache=kv_bytes(config, max_num_seqs, max_model_len, rollout_dtype, rollout_tp),
        sampling_logits=4 * max_num_seqs * config.vocab_size,
        activations=activation_bytes(
            config,
            micro_batch_tokens,
            micro_batch_response_tokens,
            cb,
            activation_checkpointing=activation_checkpointing,
        ),
        decode_graphs=(
            decode_graph_bytes(config, max_num_seqs, max_model_len, rollout_dtype, rollout_tp)
            if cuda_graphs
            else 0
        ),
        trainer_offloaded_in_gen=trainer_offloaded_in_gen,
        kv_cache_in_update=not free_cache_engine,
    )


# -- sizing: the largest micro-batch that fits a device -----------------------------------------------------------

MARGIN = 0.10  # of the device's memory kept for allocator fragmentation, the CUDA context and temporaries
TOKEN_STEP = 512  # the token budget is a multiple of this


@dataclass
class RunSettings:
    """What decides one rank's memory in a colocated run, by the recipe keys that set it."""

    devices: int = 8  # trainer.n_gpus_per_node * trainer.nnodes: the FSDP world, every rank colocated
    param_dtype: torch.dtype = torch.float32  # model.dtype
    compute_dtype: torch.dtype = torch.bfloat16  # the FSDP engine's mixed precision on CUDA
    rollout_dtype: torch.dtype = torch.bfloat16  # rollout.dtype (auto: bfloat16 on CUDA)
    reference: bool = True  # actor.use_kl_loss (GRPO's KL term loads a reference)
    max_num_seqs: int = 64  # rollout.max_num_seqs
    prompt_length: int = 1024  # rollout.prompt_length
    response_length: int = 3072  # rollout.response_length; max_model_len = prompt + response
    activation_checkpointing: bool = False  # model.activation_checkpointing
    rollout_tp: int = 1  # rollout.tensor_model_parallel_size
    free_cache_engine: bool = True  # rollout.free_cache_engine
    # rollout.cuda_graphs (auto: on with CUDA; off under rollout tp > 1 or for a MoE)
    cuda_graphs: bool = True

    @property
    def max_model_len(self) -> int:
        return self.prompt_length + self.response_length

    def to_dict(self) -> dict:
        return {
            k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
            for k, v in asdict(self).items()
        }


@dataclass
class Sizing:
    """`size_colocated_run`'s answer: ``max_token_len`` the largest ``actor.ppo_max_token_len_per_gpu`` (a multiple
    of ``step``, at least one whole sequence) whose update fits ``limit_bytes`` = the device's memory less the
    margin, with the estimate at it; or ``max_token_len`` None and ``reason`` naming the stage and its largest
    terms, with the estimate at one sequence."""

    gib: float
    margin: float
    limit_bytes: int
    settings: RunSettings
    estimate: MemoryEstimate
    max_token_len: int | None
    step: int
    reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.max_token_len is not None

    def to_dict(self) -> dict:
        return {
            "gib": self.gib,
            "margin": self.margin,
            "limit_gib": self.limit_bytes / GIB,
            "settings": self.settings.to_dict(),
            "fits": self.fits,
            "max_token_len": self.max_token_len,
            "step": self.step,
            "reason": self.reason,
            "estimate_gib": self.estimate.gib(),
            **self.extra,
        }


def estimate_run(config, s: RunSettings, tokens: int, counts: ParamCounts | None = None) -> MemoryEstimate:
    """`estimate_colocated_step` for ``s`` at a micro-batch of ``tokens`` (its response share as in the settings)."""
    response = tokens * s.response_length // s.max_model_len  # the response share of a packed micro-batch
    return estimate_colocated_step(
        config,
        param_dtype=s.param_dtype,
        compute_dtype=s.compute_dtype,
        rollout_dtype=s.rollout_dtype,
        fsdp_world=s.devices,
        reference=s.reference,
        max_num_seqs=s.max_num_seqs,
        max_model_len=s.max_model_len,
        micro_batch_tokens=tokens,
        micro_batch_response_tokens=response,
        activation_checkpointing=s.activation_checkpointing,
        rollout_tp=s.rollout_tp,
        free_cache_engine=s.free_cache_engine,
        cuda_graphs=s.cuda_graphs,
        counts=counts,
    )


def _too_big(est: MemoryEstimate, stage: str, limit: int, what: str) -> str:
    terms = sorted(est.terms(stage).items(), key=lambda kv: -kv[1])
    total = getattr(est, stage)
    listed = ", ".join(f"{name} {b / GIB:.3g}" for name, b in terms if b >= 0.05 * total)
    return f"{stage} {total / GIB:.3g} GiB > {limit / GIB:.3g} GiB {what}: {listed} (GiB)"


def size_colocated_run(
    config,
    gib: float,
    settings: RunSettings | None = None,
    *,
    margin: float = MARGIN,
    step: int = TOKEN_STEP,
    counts: ParamCounts | None = None,
) -> Sizing:
    """The largest micro-batch token budget (``actor.ppo_max_token_len_per_gpu``) of a colocated run of ``config``
    on devices of ``gib`` GiB each, keeping ``margin`` of it free, or why none fits: the rollout stage alone is
    over (``gen``), or the update of one sequence of prompt + response tokens is (the packer refuses a budget
    below that). The estimate grows with the budget, so the answer is found by bisection."""
    s = settings or RunSettings()
    if not 0 <= margin < 1 or step < 1 or gib <= 0:
        raise ValueError(f"need gib > 0, 0 <= margin < 1 and step >= 1; got {gib}, {margin}, {step}")
    c = counts or param_counts(config)
    limit = int(gib * GIB * (1 - margin))
    one = s.max_model_len
    est = estimate_run(config, s, one, c)

    def answer(tokens: int | None, e: MemoryEstimate, reason: str = "") -> Sizing:
        return Sizing(gib, margin, limit, s, e, tokens, step, reason)

    if est.gen > limit:
        return answer(None, est, _too_big(est, "gen", limit, "while generating"))
    if est.update_actor > limit:
        return answer(None, est, _too_big(est, "update_actor", limit, f"at one {one}-token sequence"))

    def fits(m: int) -> bool:
        return estimate_run(config, s, m * step, c).update_actor <= limit

    lo, hi = 0, 1  # fits(lo) (or lo == 0), not fits(hi)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    tokens = lo * step if lo * step >= one else one  # at least one whole sequence (that fits, checked above)
    return answer(tokens, estimate_run(config, s, tokens, c))


def min_devices(
    config,
    gib: float,
    settings: RunSettings | None = None,
    *,
    margin: float = MARGIN,
    step: int = TOKEN_STEP,
    counts: ParamCounts | None = None,
    most: int = 1024,
) -> int | None:
    """The fewest devices (FSDP world, all colocated) at which `size_colocated_run` fits one sequence, or None
    up to ``most``: only the train state, the reference and the gather shrink with more devices."""
    s = settings or RunSettings()
    c = counts or param_counts(config)
    for n in range(1, most + 1):
        if size_colocated_run(config, gib, replace(s, devices=n), margin=margin, step=step, counts=c).fits:
            return n
    return None
