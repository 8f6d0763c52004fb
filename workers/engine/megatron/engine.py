"""Megatron-core training engine: a Qwen2/Llama GPTModel (local layer spec) with tensor, pipeline and data
parallelism from ``megatron.core.parallel_state`` and Megatron's forward/backward schedules (1F1B when
pp > 1). It is a `TrainEngine` (workers/engine/base.py) like the FSDP engine, sharing its ``compute_*`` /
``train_step`` loop and state dict (`train_steps.EngineSteps`), so role workers switch with
``strategy=megatron``.

Conventions (the same as ``workers/engine/fsdp_engine.py``)
------------------------------------------------------------
* Every rank calls every method with its DP shard of the batch; ranks of one TP/PP group (same
  ``dp_rank``) must pass the same rows. Results (log-probs, metrics) are returned on every rank.
* ``loss_fn(outputs, micro_batch, ctx)`` returns each micro-batch's share of the global mini-batch loss
  (normalised by ``ctx.global_num_tokens`` over all DP ranks); gradients are summed over micro-batches and
  DP ranks, so the update does not depend on micro-batch size, TP, PP or DP.
* Optimizer: torch AdamW on each rank's parameter shards (elementwise, so it equals AdamW on the full
  model), global-norm clipping with the norm taken over unique elements (TP-replicated norms and the
  tied-embedding copy on the last stage counted once), linear warm-up / cosine schedule from
  ``OptimConfig``. Megatron's distributed optimizer and DDP buffers are not used: they need CUDA (see
  ``cpu_compat.py``), and plain ``.grad`` tensors keep the engine identical on CPU and GPU.

Sequences: each row's real tokens (a contiguous block in ``attention_mask``) are moved to the front and
right-padded to the longest row of the mini-batch, so positions are 0..len-1 as in HF and the causal
mask keeps padding out of every real token's attention (Megatron's rotary embedding ignores
``position_ids``, so left padding would shift positions). No packing: the local spec's attention has no
variable-length kernel.

Critics (``value_head=True``): the HF ``*ForTokenClassification`` score head replaces the vocabulary
projection on the last stage (replicated over TP); ``compute_values`` and value ``train_step`` as in FSDP.

Checkpoints and HF export: workers/engine/checkpoint.py, as for any `TrainEngine` (atomic ``step_N`` directory,
content hashes). Each (TP, PP) shard's model and optimizer state is keyed by its ranks
(``tp<t>_pp<p>.model...``), so DP replicas share keys and DCP writes one copy; a checkpoint resumes on the
same TP/PP sizes (checked at load) and any DP size.

Not implemented here: sequence parallelism, virtual pipeline stages, context/expert parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist

from workers import distributed as du
from workers.engine.base import EngineConfig, LossFn, MegatronConfig
from workers.engine.megatron import cpu_compat
from workers.engine.megatron.hf_conversion import (
    ModelShape,
    hf_chunks,
    hf_chunks_from_megatron,
    megatron_from_hf_chunks,
    param_specs,
)
from workers.engine.optim import build_optimizer
from workers.engine.packing import entropy_from_logits
from workers.engine.train_steps import EngineCall, EngineSteps, call_loss_fn, load_module_state, module_state
from workers.models.loading import load_model, resolve_dtype
from workers.weight_sync.reshard import Resharder
from workers.weight_sync.reshard_plan import GenLayout, ReshardPlan, TrainLayout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig


def _ensure_process_group() -> None:
    """Megatron's parallel_state needs torch.distributed even for one process: a 1-rank gloo group."""
    if du.is_dist():
        return
    if "WORLD_SIZE" in os.environ:
        du.init_distributed()
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _init_parallel_state(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(
                f"Megatron parallel state is already initialised with (tp, pp)={have}; this engine asks for "
                f"({tp}, {pp}). Engines in one process must share tensor/pipeline sizes."
            )
        return
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size = {tp} * {pp}"
        )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def transformer_config(shape: ModelShape, tp: int, pp: int, dtype: torch.dtype):
    """Megatron TransformerConfig of a Qwen2/Llama model (RMSNorm, SwiGLU, RoPE, GQA, no dropout)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten from the HF checkpoint
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # loss_fn already normalises: the schedule must not rescale it
    )


class ValueHead(torch.nn.Module):
    """The critic's scalar head in place of GPTModel's vocabulary projection (same call signature);
    replicated on every TP rank: its input, the final-norm hidden states, is not split."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class MegatronEngine(EngineSteps):
    """One actor/reference model on this rank as a Megatron GPTModel shard (stage ``pp_rank``, TP rank
    ``tp_rank``), with the FSDP engine's interface."""

    supports_lora: ClassVar[bool] = False
    supports_compile: ClassVar[bool] = False
    supports_moe: ClassVar[bool] = False  # its HF conversion maps dense decoder layers only
    reshards_for_generation: ClassVar[bool] = True  # reshard_plan, generation_shard_iter, reshard_stats
    process_global_parallel_state: ClassVar[bool] = True  # megatron.core.parallel_state

    @classmethod
    def from_config(cls, config: EngineConfig, parallel: MegatronConfig) -> MegatronEngine:
        return cls(config, parallel)

    @classmethod
    def model_parallel_size(cls, parallel: MegatronConfig) -> int:
        """tensor x pipeline parallel size: the ranks of one replica."""
        return parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size

    def dispatch_place(self, rank: int) -> tuple[int, bool]:
        """The ranks of one TP x PP group share a chunk; every rank returns the same outputs (broadcast from
        the last pipeline stage), and one rank per replica, tp rank 0 of the last stage, is collected."""
        return self.dp_rank, self.tp_rank == 0 and self.is_last

    def replica_coords(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank}

    def __init__(self, config: EngineConfig, parallel: MegatronConfig | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        self.config = config
        self.parallel = parallel = parallel or MegatronConfig()
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        _ensure_process_group()
        _init_parallel_state(tp, pp)
        self.ps = ps
        self.tp, self.pp = tp, pp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == pp - 1
        self.device = du.default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if cpu_compat.needed():
            cpu_compat.install(config.seed, self.tp_rank)
        else:  # Megatron's own seeding of its CUDA RNG tracker (per-TP-rank streams)
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.global_step = 0
        self.skipped_steps = 0
        self._offloaded = False
        self.is_value_model = bool(config.value_head)
        self.use_fsdp = False  # role workers report it; gradients are reduced by this engine itself
        self._resharders: dict = {}  # generation TP size -> Resharder (weight sync, HF export)

        self.dtype = resolve_dtype(config.param_dtype)
        with torch.random.fork_rng(devices=[]):  # a fresh value head is initialised from the seed
            torch.manual_seed(config.seed)
            hf_model = load_model(
                config.model_path,
                value_head=config.value_head,
                dtype=self.dtype,
                device="cpu",
                config_overrides=config.config_overrides,
            )
        # torch types Module attributes as Tensor | Module; an HF model's ``config`` is a PretrainedConfig
        self.hf_config = cast("PretrainedConfig", hf_model.config)
        self.hf_config.architectures = [type(hf_model).__name__]  # what an HF export loads it as
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.shape = ModelShape.from_hf_config(hf_model.config, value_head=self.is_value_model)
        self.shape.check_parallel(tp, pp)
        self.specs = param_specs(self.shape, pp, self.dtype)
        full = {n: p.detach() for n, p in hf_model.named_parameters()}
        chunks = hf_chunks(full, self.specs, self.tp_rank, tp, self.pp_rank)
        if self.shape.tie_word_embeddings and pp > 1 and self.is_last:
            chunks["model.embed_tokens.weight"] = full["model.embed_tokens.weight"].chunk(tp, dim=0)[
                self.tp_rank
            ]
        local = megatron_from_hf_chunks(chunks, self.shape, tp, self.pp_rank, pp)
        del hf_model, full, chunks

        self.tconfig = transformer_config(self.shape, tp, pp, self.dtype)
        with cpu_compat.cpu_device_scope(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = GPTModel(
                config=self.tconfig,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=self.shape.vocab_size,
                max_sequence_length=self.shape.max_position_embeddings,
                pre_process=self.is_first,
                post_process=self.is_last,
                share_embeddings_and_output_weights=self.shape.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_base=self.shape.rope_theta,
                parallel_output=False,  # full-vocab logits on every TP rank (gathered by Megatron)
            )
        if self.is_value_model and self.is_last:
            model.output_layer = ValueHead(self.shape.hidden_size, self.dtype)
        self._load_local(model, local)
        model.to(self.device)
        self.model = model

        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    # -- weights in / out ----------------------------------------------------------------------------------

    @staticmethod
    def _load_local(model: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
        own = model.state_dict()
        missing = [k for k in own if k not in local and not k.endswith("_extra_state")]
        unexpected = [k for k in local if k not in own]
        if missing or unexpected:
            raise RuntimeError(
                f"HF -> Megatron conversion mismatch: Megatron parameters without a source {missing}, "
                f"converted tensors Megatron does not have {unexpected}"
            )
        with torch.no_grad():
            for name, tensor in local.items():
                if tuple(own[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: converted shape {tuple(tensor.shape)} != {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron parameters (local names, detached views)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def hf_shard(self) -> dict[str, torch.Tensor]:
        """This rank's training chunks in HF naming: what ``ReshardPlan.held`` describes, the input of
        ``workers/weight_sync/reshard.py``."""
        return hf_chunks_from_megatron(self.megatron_state(), self.shape, self.tp, self.pp_rank, self.pp)

    def reshard_plan(self, tp_g: int = 1):
        """The plan that moves this engine's weights to ``tp_g``-way generation replicas on the same ranks."""
        world = dist.get_world_size()
        return ReshardPlan(
            self.specs, TrainLayout(self.pp, self.tp, self.dp_size), GenLayout(tp_g, world // tp_g)
        )

    def _resharder(self, tp_g: int):
        """One Resharder (and its process groups) per generation TP size, created on first use: a
        collective, so every rank must make the same first call."""
        if tp_g not in self._resharders:
            self._resharders[tp_g] = Resharder(self.reshard_plan(tp_g), "regrouped")
        return self._resharders[tp_g]

    @torch.no_grad()
    def generation_shard_iter(
        self, tp_g: int = 1, bucket_bytes: int = 64 << 20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's generation chunk) for ``tp_g``-way generation replicas on the same ranks,
        by the 3D-HybridEngine reshard (all-gathers inside micro-DP groups only, in buckets); with
        ``tp_g == 1`` full tensors, what the native rollout engine's ``update_weights`` takes. Collective:
        every rank must consume it to the end."""
        yield from self._resharder(tp_g).named_tensors(self.hf_shard(), bucket_bytes)

    def reshard_stats(self, tp_g: int = 1):
        """Byte and memory counts of the last ``generation_shard_iter(tp_g)`` on this rank."""
        return self._resharder(tp_g).stats

    @torch.no_grad()
    def full_state_dict_iter(
        self,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) on every rank (``generation_shard_iter`` with tp_g=1; copies, since a
        rank alone in its group would otherwise get its live parameters). Collective."""
        for name, tensor in self.generation_shard_iter(1, bucket_bytes):
            yield name, tensor.to(device=device, dtype=dtype or tensor.dtype, copy=True)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.ps.get_data_parallel_group() if self.dp_size > 1 else None

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.specs)

    # -- batches -------------------------------------------------------------------------------------------

    def _prepare(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Front-aligned tokens and, per response token, the position whose logits predict it."""
        ids, mask = tensors["input_ids"], tensors["attention_mask"].bool()
        n, total = ids.shape
        r = tensors["responses"].shape[1]
        lengths = mask.sum(dim=1)
        first = mask.float().argmax(dim=1)
        cols = torch.arange(total).unsqueeze(0)
        block = (cols >= first.unsqueeze(1)) & (cols < (first + lengths).unsqueeze(1))
        if not torch.equal(block, mask):
            bad = int((block != mask).any(dim=1).nonzero()[0])
            raise ValueError(f"row {bad}: attention_mask is not one contiguous block of real tokens")
        seq = max(1, int(lengths.max()))
        tokens = torch.zeros(n, seq, dtype=ids.dtype)
        src = (first.unsqueeze(1) + torch.arange(seq).unsqueeze(0)).clamp(max=total - 1)
        tokens = torch.where(
            torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1), ids.gather(1, src), tokens
        )
        prompt_len = mask[:, : total - r].sum(dim=1)
        resp_len = mask[:, total - r :].sum(dim=1)
        j = torch.arange(r).unsqueeze(0)
        valid = j < resp_len.unsqueeze(1)
        if bool((valid.any(dim=1) & (prompt_len == 0)).any()):
            raise ValueError(
                "a row with response tokens has an empty prompt: nothing predicts its first token"
            )
        pred_pos = (prompt_len.unsqueeze(1) + j - 1).clamp(min=0, max=seq - 1)
        return {
            "tokens": tokens,
            "position_ids": torch.arange(seq).unsqueeze(0).expand(n, seq).contiguous(),
            "pred_pos": pred_pos,
            "valid": valid,
            "labels": tensors["responses"],
        }

    @staticmethod
    def _micro_size(n: int, seq: int, micro_batch_size: int | None, max_token_len: int | None) -> int:
        """Rows per micro-batch: equal for all micro-batches (pipeline messages have a fixed shape), so the
        largest divisor of ``n`` within the request (token budget: ``max_token_len // padded length``)."""
        want = micro_batch_size or (max(1, max_token_len // max(seq, 1)) if max_token_len else n)
        want = max(1, min(want, n))
        while n % want:
            want -= 1
        return want

    def _response_outputs(self, logits, prep, temperature: float, calculate_entropy: bool):
        """log-probs (and entropy) of the response tokens from full-vocab logits [b, S, V]; for a critic the
        values [b, R] at the positions that predict the response tokens (as the FSDP engine)."""
        if self.is_value_model:
            values = logits[..., 0].float().gather(1, prep["pred_pos"])
            return {"values": values * prep["valid"].to(values.dtype)}
        index = prep["pred_pos"].unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        picked = logits.float().gather(1, index)
        if temperature != 1.0:
            picked = picked / temperature
        logp = torch.log_softmax(picked, dim=-1).gather(-1, prep["labels"].unsqueeze(-1)).squeeze(-1)
        valid = prep["valid"].to(logp.dtype)
        out = {"log_probs": logp * valid}
        if calculate_entropy:
            out["entropy"] = entropy_from_logits(picked) * valid
        return out

    def _run(self, micros, *, forward_only: bool, make_loss):
        """Megatron's forward/backward schedule over equal-shape micro-batches. ``make_loss(i, outputs)``
        returns (loss, metrics) for micro-batch i on the last stage. Returns the per-micro metrics dicts,
        broadcast from the last pipeline stage to every stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(list(enumerate(micros)))

        def step(data_iterator, model):
            i, prep = next(data_iterator)
            out = model(prep["tokens"], prep["position_ids"], attention_mask=None)

            def loss_func(logits):
                loss, metrics = make_loss(i, prep, logits)
                return loss, torch.ones((), dtype=torch.int), metrics

            return out, loss_func

        seq, b = micros[0]["tokens"].shape[1], micros[0]["tokens"].shape[0]
        with cpu_compat.cpu_device_scope():
            results = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=it,
                model=[self.model],
                num_microbatches=len(micros),
                seq_length=seq,
                micro_batch_size=b,
                forward_only=forward_only,
            )
        if self.pp > 1:
            box = [results if self.is_last else None]
            dist.broadcast_object_list(
                box,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
            results = box[0]
        return results

    def _split(self, tensors, prep, idx: list[int], rows: int):
        chunks = []
        for start in range(0, len(idx), rows):
            sel = torch.tensor(idx[start : start + rows])
            p = {k: v.index_select(0, sel).to(self.device) for k, v in prep.items()}
            t = {k: v.index_select(0, sel).to(self.device) for k, v in tensors.items()}
            chunks.append((p, t))
        return chunks

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocab logits [b, s, V] of unpadded sequences (one pipeline stage only: pp == 1)."""
        if self.pp > 1:
            raise RuntimeError("MegatronEngine.logits needs pp == 1 (stages hold different layers)")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        self.model.eval()
        with cpu_compat.cpu_device_scope():
            return self.model(input_ids.to(self.device), position_ids.to(self.device), attention_mask=None)

    # -- forward -----------------------------------------------------------------------------------------

    def _forward(self, call: EngineCall, calculate_entropy: bool) -> dict[str, torch.Tensor]:
        prep = self._prepare(call.tensors)
        n = prep["tokens"].shape[0]
        rows = self._micro_size(n, prep["tokens"].shape[1], call.micro_batch_size, call.max_token_len)
        parts = self._split({}, prep, list(range(n)), rows)
        self.model.eval()

        def make_loss(i, p, logits):
            out = self._response_outputs(logits, p, call.temperature, calculate_entropy)
            return logits.sum() * 0.0, {k: v.cpu() for k, v in out.items()}

        results = self._run([p for p, _ in parts], forward_only=True, make_loss=make_loss)
        return {k: torch.cat([r[k] for r in results]) for k in results[0]}

    # -- training ------------------------------------------------------------------------------------------

    def _backward_mini_batch(
        self, call: EngineCall, rows: list[int], loss_fn: LossFn, context, calculate_entropy: bool
    ) -> tuple[torch.Tensor, list[dict[str, float]]]:
        mini = {k: v[rows] for k, v in call.tensors.items()}
        prep = self._prepare(mini)
        size = self._micro_size(len(rows), prep["tokens"].shape[1], call.micro_batch_size, call.max_token_len)
        parts = self._split(mini, prep, list(range(len(rows))), size)

        def make_loss(i, p, logits):
            outputs = self._response_outputs(logits, p, call.temperature, calculate_entropy)
            ctx = context(micro_batch_index=i, num_micro_batches=len(parts))
            loss, metrics = call_loss_fn(loss_fn, outputs, parts[i][1], ctx)
            metrics["__loss"] = float(loss.detach())
            return loss, metrics

        results = self._run([p for p, _ in parts], forward_only=False, make_loss=make_loss)
        step_loss = torch.tensor(sum(res.pop("__loss") for res in results), dtype=torch.float64)
        self._reduce_grads()
        return step_loss, results

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    @torch.no_grad()
    def _reduce_grads(self) -> None:
        """Tied embedding: first and last stage hold copies whose gradients add up (Megatron's
        ``_allreduce_embedding_grads``); then SUM every gradient over the data-parallel group."""
        if self.shape.tie_word_embeddings and self.pp > 1 and (self.is_first or self.is_last):
            weight = cast("GPTModel", self.model).shared_embedding_or_output_weight()
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=self.ps.get_embedding_group())
        if self.dp_size > 1:
            grads = self._grads()
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.ps.get_data_parallel_group())
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def _counts_once(self, name: str, param: torch.nn.Parameter) -> bool:
        """Whether this rank's copy of ``param`` enters the global norm (each element counted once)."""
        # Norms (and a critic's value head) are the only TP-replicated weights of this model (Megatron's
        # `tensor_model_parallel` attribute is only set by its weight initialisers, which the engine skips).
        replicated = name.endswith("layernorm.weight") or (
            self.is_value_model and name.startswith("output_layer.")
        )
        if replicated and self.tp_rank != 0:
            return False  # replicated over TP: tp rank 0 counts it
        if self.shape.tie_word_embeddings and self.pp > 1 and self.is_last and name == "output_layer.weight":
            return False  # copy of stage 0's embedding
        return True

    def grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.model.named_parameters():
            if p.grad is not None and self._counts_once(name, p):
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        return float(sq.sqrt())

    # -- memory / lifecycle --------------------------------------------------------------------------------

    def offload(self, optimizer: bool = True) -> None:
        self._offloaded = True
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def reload(self, optimizer: bool = True) -> None:
        self._offloaded = False
        if self.device.type != "cpu":
            self.model.to(self.device)

    # -- checkpoints (workers/engine/checkpoint.py) ---------------------------------------------------------

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD  # all TP x PP x DP ranks of this engine

    def checkpoint_layout(self) -> dict:
        return {
            "value_head": self.is_value_model,
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
        }

    def _model_state(self) -> dict:
        return {f"tp{self.tp_rank}_pp{self.pp_rank}": module_state(self.model, self.optimizer)}

    def _load_model_state(self, state: dict) -> None:
        load_module_state(self.model, self.optimizer, state[f"tp{self.tp_rank}_pp{self.pp_rank}"])

    def destroy(self) -> None:
        """Tear down the resharding groups and Megatron's parallel state (another engine may follow)."""
        for resharder in self._resharders.values():
            resharder.destroy()
        self._resharders.clear()
        self.ps.destroy_model_parallel()
