"""FSDP2 training engine: one model (actor, critic or reference) sharded over a data-parallel device mesh, a
`TrainEngine` (workers/engine/base.py) whose ``compute_*`` / ``train_step`` loop and state dict are shared with
the Megatron engine (`train_steps.EngineSteps`); this module holds the FSDP passes and sharding.

Conventions
-----------
* Data: each DP rank calls every method with *its own shard* of the batch (the role worker splits it), as a
  dict of tensors or a ``DataProto`` (``.batch`` + ``.meta_info``). Keys follow dataproto/BATCH_LAYOUT.md.
  Collective methods (everything that runs the model, `full_state_dict_iter`, checkpoints) must be called on
  every rank in the same order.
* Padding: sequences are unpadded and packed into one row per micro-batch (`packing.pack_sequences`); no
  compute is spent on pad tokens. Logits are projected only at the positions that predict response tokens.
  Rows of a micro-batch with the same prompt (a GRPO group) share one copy of it (``share_prompts``, with the
  ``hyflow_varlen`` attention): the same log-probs, values and gradients, the prompt computed once.
* Gradients: ``loss_fn`` returns each micro-batch's share of the *global* loss (normalised by counts over the
  whole mini-batch across all DP ranks, which the engine passes in `LossContext`). The engine back-propagates
  each micro-batch loss as is, gradients accumulate (sum) over micro-batches, and FSDP's reduce-scatter SUMS
  over ranks (``set_gradient_divide_factor(1.0)``, no averaging). The result is the gradient of the full
  mini-batch loss, independent of micro-batch size, token budget and DP size.
* A step whose global gradient norm is not finite is not applied: gradients are dropped, the optimizer and
  LR schedule do not advance, and ``skipped_steps`` is incremented.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from workers import distributed as du
from workers.engine.base import EngineConfig, LossFn
from workers.engine.lora import adapter_named_tensors, add_adapters, base_name, merged_named_tensors
from workers.engine.moe import expert_load, is_moe
from workers.engine.moe_forward import OLD_ROUTES, ROLLOUT_ROUTES, MoEForward
from workers.engine.optim import build_optimizer
from workers.engine.packing import (
    group_rows_by_prompt,
    pack_sequences,
    plan_micro_batches,
    restore_order,
    scatter_response,
)
from workers.engine.train_steps import EngineCall, EngineSteps, call_loss_fn, load_module_state, module_state
from workers.engine.vocab_head import head_computes_log_probs
from workers.models.attention import VARLEN_ATTENTION, register_varlen_attention
from workers.models.loading import build_on_meta, can_build_on_meta, is_value_model, load_model
from workers.models.meta_init import materialize
from workers.models.packed_kernels import resolve_packed_kernel

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


class _BuildArgs(TypedDict):
    """The keywords `FSDPEngine` passes to ``build_on_meta`` / ``load_model``."""

    value_head: bool
    dtype: str | torch.dtype
    attn_implementation: str | None
    trust_remote_code: bool
    config_overrides: dict | None


def moves_with_state(key: str, group: dict) -> bool:
    """Whether an optimizer state tensor follows the state to another device (offload / reload). AdamW's step
    counter stays a CPU scalar unless the group is fused or capturable, whose kernels read it on the
    parameters' device (a fused step left on the CPU failed the second update on CUDA: the GPU check's
    grpo_step)."""
    return key != "step" or bool(group.get("fused") or group.get("capturable"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (its ``_no_split_modules`` classes): FSDP2's units, and what compiles."""
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in layer_names]


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (forward and backward), before FSDP2 shards it: FSDP's
    gathers stay outside the compiled code, and one graph with a dynamic token count serves every layer and
    every packed micro-batch. Attention is a graph break with the varlen kernel. Compiles on first use."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"model.compile: {type(model).__name__} names no decoder layers (_no_split_modules) to compile"
        )
    for layer in layers:
        layer.compile(dynamic=True)


class FSDPEngine(EngineSteps):
    """Model + optimizer + schedule on this rank; FSDP2-sharded over ``dp`` when world size > 1."""

    supports_lora: ClassVar[bool] = True  # lora, adapter_state_iter, base_model_mode
    supports_compile: ClassVar[bool] = True  # compile_layers
    supports_moe: ClassVar[bool] = True  # moe_forward.MoEForward around each micro-batch
    reshards_for_generation: ClassVar[bool] = False  # full tensors only (full_state_dict_iter)
    process_global_parallel_state: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, device_mesh=None):
        self.config = config
        self.device = du.default_device()
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"FSDPEngine takes a 1-D data-parallel device mesh, got {device_mesh.ndim}-D"
                )
            self.dp_size, self.dp_rank = device_mesh.size(), device_mesh.get_local_rank()
        else:
            self.dp_size, self.dp_rank = du.world_size(), du.rank()
        use_fsdp = config.use_fsdp if config.use_fsdp is not None else self.dp_size > 1
        if use_fsdp and not du.is_dist():
            raise RuntimeError(
                "EngineConfig.use_fsdp=True needs an initialised torch.distributed process group"
            )
        if not use_fsdp and self.dp_size > 1 and config.optim is not None:
            raise ValueError(
                f"EngineConfig.use_fsdp=False with {self.dp_size} ranks would train unsynchronised replicas; "
                "use FSDP (use_fsdp=None/True) or a forward-only engine (optim=None)"
            )
        self.use_fsdp = use_fsdp
        if not use_fsdp:
            self.dp_size, self.dp_rank = 1, 0  # an unsharded replica reduces nothing across ranks
        self.mixed_precision = (
            config.mixed_precision if config.mixed_precision is not None else self.device.type == "cuda"
        )
        self.global_step = 0  # applied optimizer steps
        self.skipped_steps = 0  # steps dropped for a non-finite gradient norm
        self._offloaded = False

        attn = config.attn_implementation
        if attn == "auto":
            attn = VARLEN_ATTENTION
            if self.device.type == "cuda":
                try:
                    import flash_attn  # noqa: F401

                    attn = "flash_attention_2"
                except ImportError:
                    pass
        # the kernel of hyflow_varlen's packed rows (None: another attention implementation attends)
        self.packed_attention: str | None = None
        if attn == VARLEN_ATTENTION:
            register_varlen_attention()
            self.packed_attention = resolve_packed_kernel(
                config.packed_attention, self.device, trains=config.optim is not None
            )
        self.attn_implementation = attn
        # shared prompts need attention that keeps each response from its siblings: hyflow_varlen's sdpa or flex
        # kernel, without sliding windows (checked once the model is built)
        self.share_prompts = config.share_prompts and self.packed_attention in ("sdpa", "flex")

        build = _BuildArgs(
            value_head=config.value_head,
            dtype=config.param_dtype,
            attn_implementation=attn,
            trust_remote_code=config.trust_remote_code,
            config_overrides=config.config_overrides,
        )
        # Sharded: built on the meta device, then each rank fills only its own shards (no rank ever holds the
        # whole model). Otherwise (one replica, or weights that cannot be read piece by piece) loaded whole.
        self.lora = config.lora if config.lora is not None and config.lora.enabled else None
        # peft renames the parameters, which the meta-device fill reads by their checkpoint names: with LoRA
        # each rank loads the whole base once, then shards it.
        meta_init = (
            use_fsdp
            and self.lora is None
            and can_build_on_meta(config.model_path, value_head=config.value_head)
        )
        with torch.random.fork_rng(devices=[]):  # seeded init of any new weights; caller's RNG untouched
            torch.manual_seed(config.seed)
            if meta_init:
                model, source = build_on_meta(config.model_path, **build)
            else:
                model = load_model(config.model_path, device="cpu", **build)
            architecture = type(model).__name__  # what an HF export loads it as (not peft's wrapper)
            if self.lora is not None:
                if config.value_head:
                    raise ValueError("LoRA is for the policy; a value model (critic) trains in full")
                model = add_adapters(model, self.lora)
        self.is_value_model = is_value_model(model)
        # torch types a Module's attributes as Tensor | Module: the model is an HF one, or peft's wrapper of one
        # (which forwards the config and the checkpointing switches to the model it wraps)
        hf_model = cast("PreTrainedModel", model)
        if hasattr(model, "config"):
            hf_model.config.use_cache = False
            layer_types = getattr(hf_model.config, "layer_types", None) or ()
            if getattr(hf_model.config, "use_sliding_window", False) or "sliding_attention" in layer_types:
                self.share_prompts = False
        if config.activation_checkpointing:
            ac_kwargs = {"use_reentrant": False}
            if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=ac_kwargs)
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ac_kwargs)

        if config.compile:
            compile_layers(model)
        if self.use_fsdp:
            self.device_mesh = device_mesh or self._make_mesh()
            self._shard(model)
            if meta_init:
                materialize(model, source, device=self.device)
        else:
            self.device_mesh = device_mesh
            model.to(self.device)
        self.model = model
        self.is_moe = is_moe(model)
        self.hf_config = hf_model.config
        self.hf_config.architectures = [architecture]
        self.generation_config = getattr(model, "generation_config", None)
        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    # -- setup ----------------------------------------------------------------------------------------------

    def _make_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.dp_size,), mesh_dim_names=("dp",))

    def _shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.mixed_precision
            else MixedPrecisionPolicy()
        )
        layers = decoder_layers(model)
        if not layers:
            warnings.warn(
                f"workers/engine/fsdp_engine.py: no decoder layers ({getattr(model, '_no_split_modules', None)}) "
                f"found in {type(model).__name__}; sharding the root module only",
                stacklevel=2,
            )
        kw = dict(
            mesh=self.device_mesh, mp_policy=mp, reshard_after_forward=self.config.reshard_after_forward
        )
        for layer in layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        # Gradient convention: SUM over DP ranks (the loss is already normalised by global counts). Divide
        # factor 1 with sum-only collectives: a plain ReduceOp.SUM reduce-scatter (gloo has no PREMUL_SUM/AVG).
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    # -- small helpers --------------------------------------------------------------------------------------

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.device_mesh.get_group() if self.use_fsdp else None

    def _autocast(self):
        if self.mixed_precision and not self.use_fsdp and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _plan(
        self,
        tensors: Mapping[str, torch.Tensor],
        response_length: int,
        micro_batch_size: int | None,
        max_token_len: int | None,
    ) -> list[list[int]]:
        """Micro-batches for this rank, padded with empty ones so that every DP rank runs the same count. With
        shared prompts a token budget keeps each prompt's rows together (``plan_micro_batches``)."""
        lengths = tensors["attention_mask"].sum(dim=1).tolist()
        groups = None
        if self.share_prompts and max_token_len is not None:
            prompt_len = tensors["input_ids"].shape[1] - response_length
            by_prompt = group_rows_by_prompt(tensors["input_ids"], tensors["attention_mask"], prompt_len)
            groups = [(len(prompt), rows) for prompt, rows in by_prompt.items()]
        plan = partial(
            plan_micro_batches,
            lengths,
            micro_batch_size=micro_batch_size,
            max_token_len=max_token_len,
            prompt_groups=groups,
        )
        parts = plan()
        k = int(self.dp_all_reduce(torch.tensor(len(parts)), dist.ReduceOp.MAX).item())
        if k > len(parts):
            parts = plan(min_num_micro_batches=k)
            parts += [[] for _ in range(k - len(parts))]
        return parts

    @staticmethod
    def _rows(tensors: Mapping[str, torch.Tensor], idx: list[int]) -> dict[str, torch.Tensor]:
        index = torch.tensor(idx, dtype=torch.long)
        return {k: v.index_select(0, index.to(v.device)) for k, v in tensors.items()}

    def _to_device(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}

    # -- forward --------------------------------------------------------------------------------------------

    def _forward_micro(
        self,
        micro: Mapping[str, torch.Tensor],
        response_length: int,
        temperature: float,
        calculate_entropy: bool,
        replay_routes: str | None = None,
    ) -> tuple[dict[str, torch.Tensor], MoEForward | None]:
        """Packed forward of one micro-batch; outputs are [b, R] (zeros at response padding). A mixture of experts
        also gives its `MoEForward` (routes, router losses), replaying the column ``replay_routes`` if named."""
        packed = pack_sequences(
            micro["input_ids"], micro["attention_mask"], response_length, share_prompts=self.share_prompts
        )
        moe = MoEForward(self.model, packed, micro, replay_routes) if self.is_moe else None
        with self._autocast(), moe.routing() if moe is not None else contextlib.nullcontext():
            if self.is_value_model:
                out = self.model(**packed.model_kwargs(self.packed_attention))
                values = out.logits[0, :, 0].index_select(0, packed.keep_index).float()
                return {"values": scatter_response(values, packed.response_valid)}, moe
            with head_computes_log_probs(self.model, packed.labels, temperature, calculate_entropy):
                out = self.model(
                    **packed.model_kwargs(self.packed_attention), logits_to_keep=packed.keep_index
                )
        pair = out.logits[0]  # [n, 2]: log-probs and entropies of the kept (response-predicting) positions
        result = {"log_probs": scatter_response(pair[:, 0], packed.response_valid)}
        if calculate_entropy:
            result["entropy"] = scatter_response(pair[:, 1], packed.response_valid)
        return result, moe

    def _dummy_forward(self, template: Mapping[str, torch.Tensor], response_length: int) -> torch.Tensor:
        """A forward on one real row whose loss is 0: keeps this rank in step with ranks that have more
        micro-batches (every FSDP forward/backward is collective)."""
        micro = {k: v[:1] for k, v in template.items()}
        out, moe = self._forward_micro(micro, response_length, 1.0, False)
        zero = sum(v.sum() for v in out.values()) * 0.0
        assert isinstance(zero, torch.Tensor)  # out is never empty (log-probs or values)
        return zero + sum(lg.sum() for lg in moe.logits) * 0.0 if moe is not None else zero

    def _forward(self, call: EngineCall, calculate_entropy: bool) -> dict[str, torch.Tensor]:
        keys = ("input_ids", "attention_mask", "responses", ROLLOUT_ROUTES, OLD_ROUTES)
        tensors = {k: call.tensors[k] for k in keys if k in call.tensors}
        response_length = call.response_length
        parts = self._plan(tensors, response_length, call.micro_batch_size, call.max_token_len)
        self.model.eval()
        chunks: dict[str, list[torch.Tensor]] = {}
        dev = self._to_device(tensors)
        for part in parts:
            if not part:
                self._dummy_forward(dev, response_length)
                continue
            out, moe = self._forward_micro(
                self._rows(dev, part),
                response_length,
                call.temperature,
                calculate_entropy,
                call.replay_routes,
            )
            if moe is not None:
                out.update(moe.outputs())
            for k, v in out.items():
                chunks.setdefault(k, []).append(v.cpu())
        return {k: restore_order(v, [p for p in parts if p]) for k, v in chunks.items()}

    # -- training -------------------------------------------------------------------------------------------

    def _backward_mini_batch(
        self, call: EngineCall, rows: list[int], loss_fn: LossFn, context, calculate_entropy: bool
    ) -> tuple[torch.Tensor, list[dict[str, float]]]:
        mini = self._rows(call.tensors, rows)
        parts = self._plan(mini, call.response_length, call.micro_batch_size, call.max_token_len)
        mini_dev = self._to_device(mini)
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        metrics = []
        for ui, part in enumerate(parts):
            if not part:
                self._dummy_forward(mini_dev, call.response_length).backward()
                continue
            micro = self._rows(mini_dev, part)
            outputs, moe = self._forward_micro(
                micro, call.response_length, call.temperature, calculate_entropy, call.replay_routes
            )
            ctx = context(micro_batch_index=ui, num_micro_batches=len(parts))
            loss, m = call_loss_fn(loss_fn, outputs, micro, ctx)
            if moe is not None:
                loss, m = self._with_router_losses(loss, m, moe, len(parts) * ctx.dp_size)
            loss.backward()
            step_loss += loss.detach().double()
            metrics.append(m)
        return step_loss, metrics

    def _with_router_losses(
        self, loss: torch.Tensor, metrics: dict[str, float], moe: MoEForward, shares: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss plus the configured router losses (each of the mini-batch's ``shares`` micro-batches,
        over all DP ranks, adds its part of their mean), and their values and the route mismatch as metrics."""
        cfg = self.config.moe
        balance, z = moe.losses()
        if cfg.aux_loss_coef:
            loss = loss + cfg.aux_loss_coef * balance / shares
        if cfg.z_loss_coef:
            loss = loss + cfg.z_loss_coef * z / shares
        metrics = {**metrics, "moe/aux_loss": float(balance.detach()), "moe/z_loss": float(z.detach())}
        load = expert_load(moe.own_routes(), moe.num_experts)
        metrics["moe/expert_load_max_over_mean"] = load["moe/expert_load_max_over_mean"]
        unreplayed = moe.unreplayed_share()
        if unreplayed is not None:
            metrics["moe/unreplayed_share"] = unreplayed
        diff = moe.mismatch_by_layer()
        if diff is not None:
            metrics["moe/route_mismatch"] = float(diff.mean())
            metrics.update({f"moe/route_mismatch/layer_{i}": float(d) for i, d in enumerate(diff)})
        return loss, metrics

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            g = p.grad
            grads.append(g.to_local() if isinstance(g, DTensor) else g)
        return grads

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (each element lives on exactly one rank under FSDP2)."""
        grads = self._grads()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch._foreach_norm([g.float() for g in grads])
            sq = torch.stack(norms).pow(2).sum().to(self.device)
        return float(self.dp_all_reduce(sq).sqrt())

    # -- weights out ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict_iter(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) parameter by parameter, then persistent buffers. Under FSDP each
        parameter is all-gathered on its own (peak extra memory = one full parameter), so every rank must
        consume the iterator to the end. Tied weights appear once (under their first name)."""
        if self.lora is not None:  # the adapters folded into the base weights, under the base's names
            yield from merged_named_tensors(self.model, device=device, dtype=dtype)
        else:
            for name, p in self.model.named_parameters():
                t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                yield name, t.to(device=device, dtype=dtype or t.dtype)
        for mod_name, mod in self.model.named_modules():
            for bname, buf in mod.named_buffers(recurse=False):
                if bname in getattr(mod, "_non_persistent_buffers_set", set()):
                    continue
                name = f"{mod_name}.{bname}" if mod_name else bname
                b = buf.full_tensor() if isinstance(buf, DTensor) else buf
                yield (
                    base_name(name) if self.lora is not None else name,
                    b.to(device=device, dtype=dtype or b.dtype),
                )

    def adapter_state_iter(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT file name, full tensor) of the LoRA adapter weights alone; collective like
        `full_state_dict_iter`. Raises without ``lora``."""
        if self.lora is None:
            raise RuntimeError("adapter_state_iter: this engine trains the full model (no lora)")
        return adapter_named_tensors(self.model, device=device, dtype=dtype)

    def base_model_mode(self):
        """A context in which the model computes the frozen base's outputs (LoRA adapters disabled): the
        reference model, without a copy of it. Raises without ``lora``."""
        if self.lora is None:
            raise RuntimeError(
                "base_model_mode: this engine trains the full model (no lora): no base is kept"
            )
        return cast("PeftModel", self.model).disable_adapter()  # add_adapters wrapped it (self.lora)

    # -- offload (time-sharing the device with rollout) -----------------------------------------------------

    def offload(self, optimizer: bool = True) -> None:
        """Move parameters (and optimizer state) to CPU to free the accelerator. No-op on CPU."""
        self._offloaded = True
        if self.device.type == "cpu":
            return
        self.model.to("cpu")
        if optimizer and self.optimizer is not None:
            self._move_optimizer(self.optimizer, "cpu")
        torch.cuda.empty_cache()

    def reload(self, optimizer: bool = True) -> None:
        """Bring parameters (and optimizer state) back to the device. No-op on CPU."""
        self._offloaded = False
        if self.device.type == "cpu":
            return
        self.model.to(self.device)
        if optimizer and self.optimizer is not None:
            self._move_optimizer(self.optimizer, self.device)

    @staticmethod
    def _move_optimizer(optimizer: torch.optim.Optimizer, device) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and moves_with_state(k, group):
                        state[k] = v.to(device, non_blocking=True)

    # -- checkpoints (workers/engine/checkpoint.py) ----------------------------------------------------------

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return self.dp_group

    def checkpoint_layout(self) -> dict:
        # DCP reshards FSDP shards to any DP size; a LoRA checkpoint holds the adapters only
        lora = None if self.lora is None else {"rank": self.lora.rank, "targets": self.lora.target_modules}
        return {"value_head": self.is_value_model, "lora": lora}

    def _model_state(self) -> dict:
        return module_state(self.model, self.optimizer, trainable_only=self.lora is not None)

    def _load_model_state(self, state: dict) -> None:
        load_module_state(self.model, self.optimizer, state, trainable_only=self.lora is not None)

    @property
    def num_params(self) -> int:
        """Parameter count of the full (unsharded) model; a DTensor reports its global numel."""
        return sum(p.numel() for p in self.model.parameters())
