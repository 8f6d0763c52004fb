"""FSDP2 training engine: one model (actor, critic or reference) sharded over a data-parallel device mesh.

Conventions
-----------
* Data: each DP rank calls every method with *its own shard* of the batch (the role worker splits it), as a
  dict of tensors or a ``DataProto`` (``.batch`` + ``.meta_info``). Keys follow dataproto/BATCH_LAYOUT.md.
  Collective methods (everything that runs the model, `full_state_dict_iter`, checkpoints) must be called on
  every rank in the same order.
* Padding: sequences are unpadded and packed into one row per micro-batch (`packing.pack_sequences`); no
  compute is spent on pad tokens. Logits are projected only at the positions that predict response tokens.
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
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from workers.engine import distributed as du
from workers.engine.attention import VARLEN_ATTENTION, register_varlen_attention
from workers.engine.checkpoint import (
    export_hf,
    load_checkpoint,
    load_module_state,
    module_state,
    save_checkpoint,
)
from workers.engine.packing import (
    entropy_from_logits,
    log_probs_from_logits,
    pack_sequences,
    plan_micro_batches,
    restore_order,
    scatter_response,
)
from workers.engine.train_steps import (
    call_loss_fn,
    mask_counts,
    minibatch_order,
    response_loss_mask,
    step_metrics,
)
from workers.models.loading import is_value_model, load_model

# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (or constant), global-norm gradient clipping."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0  # linear warm-up: lr * (step + 1) / warmup_steps for step < warmup_steps
    warmup_ratio: float = 0.0  # used when warmup_steps == 0: warmup_steps = ratio * total_steps
    lr_schedule: str = "constant"  # "constant" or "cosine" (needs total_steps)
    total_steps: int | None = None
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float | None = 1.0  # max global grad norm; None or <= 0 disables clipping

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(
                f"OptimConfig.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}"
            )
        if self.lr_schedule == "cosine" and not self.total_steps:
            raise ValueError("OptimConfig.lr_schedule='cosine' needs total_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class EngineConfig:
    model_path: str
    value_head: bool = False  # critic: scalar head, `compute_values` / values in train_step
    param_dtype: str = "float32"  # dtype the parameters (and optimizer state) are kept in
    mixed_precision: bool | None = None  # bf16 compute with fp32 reduce; None: on for CUDA, off on CPU
    activation_checkpointing: bool = False
    attn_implementation: str = "auto"  # auto: flash_attention_2 if installed on CUDA, else hyflow_varlen
    use_fsdp: bool | None = None  # None: FSDP2 when torch.distributed has world size > 1
    reshard_after_forward: bool = True
    seed: int = 0  # same on every rank: a fresh value head is initialised identically everywhere
    trust_remote_code: bool = False
    config_overrides: dict = field(default_factory=dict)
    optim: OptimConfig | None = field(default_factory=OptimConfig)  # None: forward-only (reference model)


@dataclass
class LossContext:
    """What ``loss_fn`` needs besides the micro-batch tensors. Counts cover the whole mini-batch (one optimizer
    step) over all DP ranks; gradients are SUMMED over ranks, so losses are normalised by these counts only."""

    global_num_tokens: float  # sum of the loss mask over the mini-batch, all DP ranks
    global_num_seqs: int  # rows with at least one loss-mask token in the mini-batch, all DP ranks
    dp_size: int
    dp_rank: int
    epoch: int
    mini_batch_index: int
    micro_batch_index: int
    num_micro_batches: int
    temperature: float

    @property
    def global_batch_info(self) -> dict[str, Any]:
        """For ``algorithms.aggregation.agg_loss(..., global_batch_info=ctx.global_batch_info)``. ``dp_size`` is
        1 there on purpose: this engine SUMS gradients over ranks instead of averaging them."""
        return {"global_tokens": self.global_num_tokens, "global_seqs": self.global_num_seqs, "dp_size": 1}


LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossContext], Any]


def as_tensor_dict(data: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta_info) from a dict of tensors or a DataProto-like object with ``.batch``/``.meta_info``."""
    if isinstance(data, Mapping):
        return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}, {}
    if hasattr(data, "batch"):
        batch = data.batch
        keys = batch.keys() if hasattr(batch, "keys") else []
        return {k: batch[k] for k in keys}, dict(getattr(data, "meta_info", None) or {})
    raise TypeError(f"expected a dict of tensors or a DataProto, got {type(data).__name__}")


def _require(tensors: Mapping[str, torch.Tensor], *keys: str, where: str) -> None:
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise KeyError(
            f"{where}: batch is missing {missing} (has {sorted(tensors)}); see dataproto/BATCH_LAYOUT.md"
        )


def lr_lambda_for(cfg: OptimConfig) -> Callable[[int], float]:
    warmup = cfg.warmup_steps
    if warmup == 0 and cfg.warmup_ratio > 0 and cfg.total_steps:
        warmup = int(cfg.warmup_ratio * cfg.total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, cfg.total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


# ----------------------------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------------------------


class FSDPEngine:
    """Model + optimizer + schedule on this rank; FSDP2-sharded over ``dp`` when world size > 1."""

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
        if attn == VARLEN_ATTENTION:
            register_varlen_attention()
        self.attn_implementation = attn

        with torch.random.fork_rng(devices=[]):  # seeded init of any new weights; caller's RNG untouched
            torch.manual_seed(config.seed)
            model = load_model(
                config.model_path,
                value_head=config.value_head,
                dtype=config.param_dtype,
                attn_implementation=attn,
                trust_remote_code=config.trust_remote_code,
                device="cpu",
                config_overrides=config.config_overrides,
            )
        self.is_value_model = is_value_model(model)
        self.model_class_name = type(model).__name__
        if hasattr(model, "config"):
            model.config.use_cache = False
        if config.activation_checkpointing:
            ac_kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=ac_kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ac_kwargs)

        if self.use_fsdp:
            self.device_mesh = device_mesh or self._make_mesh()
            self._shard(model)
        else:
            self.device_mesh = device_mesh
            model.to(self.device)
        self.model = model
        self.model_config = getattr(model, "config", None)

        self.optimizer = None
        self.lr_scheduler = None
        if config.optim is not None:
            o = config.optim
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
            )
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda_for(o))
        else:
            self.model.requires_grad_(False)

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
        layer_names = set(getattr(model, "_no_split_modules", None) or [])
        layers = [m for m in model.modules() if type(m).__name__ in layer_names]
        if not layers:
            warnings.warn(
                f"workers/engine/fsdp_engine.py: no decoder layers ({layer_names}) found in "
                f"{type(model).__name__}; sharding the root module only",
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

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.use_fsdp:
            t = t.to(self.device)
            dist.all_reduce(t, op=op, group=self.device_mesh.get_group())
        return t

    def _autocast(self):
        if self.mixed_precision and not self.use_fsdp and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _plan(
        self, lengths: list[int], micro_batch_size: int | None, max_token_len: int | None
    ) -> list[list[int]]:
        """Micro-batches for this rank, padded with empty ones so that every DP rank runs the same count."""
        parts = plan_micro_batches(lengths, micro_batch_size=micro_batch_size, max_token_len=max_token_len)
        k = int(self._all_reduce(torch.tensor(len(parts)), dist.ReduceOp.MAX).item())
        if k > len(parts):
            parts = plan_micro_batches(
                lengths,
                micro_batch_size=micro_batch_size,
                max_token_len=max_token_len,
                min_num_micro_batches=k,
            )
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
    ) -> dict[str, torch.Tensor]:
        """Packed forward of one micro-batch; outputs are [b, R] (zeros at response padding)."""
        packed = pack_sequences(micro["input_ids"], micro["attention_mask"], response_length)
        with self._autocast():
            if self.is_value_model:
                out = self.model(**packed.model_kwargs())
                values = out.logits[0, :, 0].index_select(0, packed.keep_index).float()
                return {"values": scatter_response(values, packed.response_valid)}
            out = self.model(**packed.model_kwargs(), logits_to_keep=packed.keep_index)
        logits = out.logits[0].float()
        if temperature != 1.0:
            logits = logits / temperature
        result = {
            "log_probs": scatter_response(log_probs_from_logits(logits, packed.labels), packed.response_valid)
        }
        if calculate_entropy:
            result["entropy"] = scatter_response(entropy_from_logits(logits), packed.response_valid)
        return result

    def _dummy_forward(self, template: Mapping[str, torch.Tensor], response_length: int) -> torch.Tensor:
        """A forward on one real row whose loss is 0: keeps this rank in step with ranks that have more
        micro-batches (every FSDP forward/backward is collective)."""
        micro = {k: v[:1] for k, v in template.items()}
        out = self._forward_micro(micro, response_length, 1.0, False)
        return sum(v.sum() for v in out.values()) * 0.0

    @torch.no_grad()
    def _forward_batch(self, data, *, temperature, calculate_entropy, micro_batch_size, max_token_len, keys):
        tensors, meta = as_tensor_dict(data)
        _require(tensors, *keys, where=f"{type(self).__name__}.compute")
        temperature = float(temperature if temperature is not None else meta.get("temperature", 1.0))
        micro_batch_size, max_token_len = self._micro_args(meta, micro_batch_size, max_token_len)
        tensors = {k: tensors[k] for k in ("input_ids", "attention_mask", "responses")}
        response_length = tensors["responses"].shape[1]
        lengths = tensors["attention_mask"].sum(dim=1).tolist()
        parts = self._plan(lengths, micro_batch_size, max_token_len)
        self.model.eval()
        chunks: dict[str, list[torch.Tensor]] = {}
        dev = self._to_device(tensors)
        for part in parts:
            if not part:
                self._dummy_forward(dev, response_length)
                continue
            out = self._forward_micro(self._rows(dev, part), response_length, temperature, calculate_entropy)
            for k, v in out.items():
                chunks.setdefault(k, []).append(v.cpu())
        return {k: restore_order(v, [p for p in parts if p]) for k, v in chunks.items()}

    @staticmethod
    def _micro_args(meta: Mapping, micro_batch_size: int | None, max_token_len: int | None):
        if micro_batch_size is None and max_token_len is None:
            if meta.get("use_dynamic_bsz"):
                max_token_len = meta.get("max_token_len")
            else:
                micro_batch_size = meta.get("micro_batch_size")
        return micro_batch_size, max_token_len

    def compute_log_prob(
        self,
        data,
        *,
        temperature: float | None = None,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``responses`` under the model: {"log_probs": [B, R]} (+ "entropy" [B, R]), fp32, on
        CPU, zeros at response padding, rows in the input order. ``temperature`` divides the logits (default:
        meta_info["temperature"] or 1). Micro-batching: ``max_token_len`` (token budget, balanced) or
        ``micro_batch_size`` rows; defaults from meta_info (use_dynamic_bsz/max_token_len/micro_batch_size)."""
        if self.is_value_model:
            raise TypeError("compute_log_prob on a value-head model; use compute_values")
        return self._forward_batch(
            data,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            micro_batch_size=micro_batch_size,
            max_token_len=max_token_len,
            keys=("input_ids", "attention_mask", "responses"),
        )

    def compute_values(
        self, data, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Critic values {"values": [B, R]}: value of response token j is the head output at the position
        that predicts it (P + j - 1), as in verl; zeros at response padding."""
        if not self.is_value_model:
            raise TypeError("compute_values needs EngineConfig(value_head=True)")
        return self._forward_batch(
            data,
            temperature=1.0,
            calculate_entropy=False,
            micro_batch_size=micro_batch_size,
            max_token_len=max_token_len,
            keys=("input_ids", "attention_mask", "responses"),
        )

    # -- training -------------------------------------------------------------------------------------------

    def train_step(
        self,
        data,
        loss_fn: LossFn,
        *,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        epochs: int = 1,
        shuffle: bool = False,
        temperature: float | None = None,
        calculate_entropy: bool = False,
        loss_mask_key: str = "response_mask",
    ) -> dict[str, Any]:
        """One or more optimizer steps over this rank's shard of the batch.

        ``mini_batch_size`` is rows *of this rank's shard* per optimizer step (default: all rows, one step per
        epoch); every rank must have the same number of mini-batches. Each mini-batch is split into
        micro-batches (``max_token_len`` token budget, balanced, or ``micro_batch_size`` rows; defaults from
        meta_info). For each micro-batch::

            ret = loss_fn(outputs, micro_batch, ctx)   # ret: loss tensor, or (loss, {name: float})

        ``outputs``: {"log_probs": [b, R]} (+ "entropy" if ``calculate_entropy``) for a causal LM,
        {"values": [b, R]} for a critic; ``micro_batch``: every tensor of the batch for those b rows;
        ``ctx``: `LossContext` with the global token/sequence counts of the mini-batch over all DP ranks
        (tokens = sum of ``batch[loss_mask_key]``, default response_mask). The loss must be normalised by those
        global counts so that micro-batch losses summed over micro-batches and ranks give the mini-batch loss.

        Returns metrics: loss (mean over optimizer steps of the full mini-batch loss summed over all ranks),
        grad_norm (mean over applied steps, pre-clip), lr, skipped (this call), skipped_steps (total),
        global_step, plus per-step lists ``losses``/``grad_norms`` and loss_fn's own metrics (mean over
        micro-batches and ranks' local values).
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a forward-only engine (EngineConfig.optim=None)")
        if self._offloaded:
            raise RuntimeError("train_step while offloaded; call reload() first")
        tensors, meta = as_tensor_dict(data)
        _require(
            tensors, "input_ids", "attention_mask", "responses", where=f"{type(self).__name__}.train_step"
        )
        temperature = float(temperature if temperature is not None else meta.get("temperature", 1.0))
        micro_batch_size, max_token_len = self._micro_args(meta, micro_batch_size, max_token_len)
        n = tensors["input_ids"].shape[0]
        response_length = tensors["responses"].shape[1]
        mbs = mini_batch_size or n
        if n % mbs:
            raise ValueError(f"train_step: {n} rows on this rank is not a multiple of mini_batch_size={mbs}")
        num_mini = n // mbs
        check = self._all_reduce(torch.tensor([num_mini, -num_mini]), dist.ReduceOp.MAX)
        if int(check[0]) != -int(check[1]):
            raise ValueError(
                f"train_step: DP ranks have different numbers of mini-batches (max {int(check[0])}, min "
                f"{-int(check[1])}); each rank must get the same number of rows"
            )
        loss_mask_all = response_loss_mask(tensors, loss_mask_key, response_length)

        self.model.train()
        losses, grad_norms, lrs, skipped_now = [], [], [], 0
        extra: dict[str, list[float]] = {}
        for epoch in range(epochs):
            order = minibatch_order(
                n, shuffle=shuffle, seed=self.config.seed, global_step=self.global_step, epoch=epoch
            )
            for mi in range(num_mini):
                idx = order[mi * mbs : (mi + 1) * mbs].tolist()
                mini = self._rows(tensors, idx)
                mini_mask = loss_mask_all[idx]
                counts = self._all_reduce(mask_counts(mini_mask))
                lengths = mini["attention_mask"].sum(dim=1).tolist()
                parts = self._plan(lengths, micro_batch_size, max_token_len)
                mini_dev = self._to_device(mini)
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
                for ui, part in enumerate(parts):
                    if not part:
                        self._dummy_forward(mini_dev, response_length).backward()
                        continue
                    micro = self._rows(mini_dev, part)
                    outputs = self._forward_micro(micro, response_length, temperature, calculate_entropy)
                    ctx = LossContext(
                        global_num_tokens=float(counts[0]),
                        global_num_seqs=int(counts[1]),
                        dp_size=self.dp_size,
                        dp_rank=self.dp_rank,
                        epoch=epoch,
                        mini_batch_index=mi,
                        micro_batch_index=ui,
                        num_micro_batches=len(parts),
                        temperature=temperature,
                    )
                    loss, m = call_loss_fn(loss_fn, outputs, micro, ctx)
                    loss.backward()
                    step_loss += loss.detach().double()
                    for k, v in m.items():
                        extra.setdefault(k, []).append(v)
                step_loss = self._all_reduce(step_loss)
                lrs.append(self.optimizer.param_groups[0]["lr"])
                grad_norm, applied = self._clip_and_step()
                losses.append(float(step_loss))
                grad_norms.append(grad_norm)
                skipped_now += 0 if applied else 1

        return step_metrics(losses, grad_norms, lrs, skipped_now, self.skipped_steps, self.global_step, extra)

    def _local_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            g = p.grad
            grads.append(g.to_local() if isinstance(g, DTensor) else g)
        return grads

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (each element lives on exactly one rank under FSDP2)."""
        grads = self._local_grads()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch._foreach_norm([g.float() for g in grads])
            sq = torch.stack(norms).pow(2).sum().to(self.device)
        return float(self._all_reduce(sq).sqrt())

    @torch.no_grad()
    def _clip_and_step(self) -> tuple[float, bool]:
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return norm, False
        clip = self.config.optim.grad_clip
        if clip and clip > 0 and norm > clip:
            torch._foreach_mul_(self._local_grads(), clip / (norm + 1e-6))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return norm, True

    # -- weights out ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict_iter(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) parameter by parameter, then persistent buffers. Under FSDP each
        parameter is all-gathered on its own (peak extra memory = one full parameter), so every rank must
        consume the iterator to the end. Tied weights appear once (under their first name)."""
        for name, p in self.model.named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            t = t.to(device=device, dtype=dtype or t.dtype)
            yield name, t
        for mod_name, mod in self.model.named_modules():
            for bname, buf in mod.named_buffers(recurse=False):
                if bname in getattr(mod, "_non_persistent_buffers_set", set()):
                    continue
                name = f"{mod_name}.{bname}" if mod_name else bname
                b = buf.full_tensor() if isinstance(buf, DTensor) else buf
                yield name, b.to(device=device, dtype=dtype or b.dtype)

    # -- offload (time-sharing the device with rollout) -----------------------------------------------------

    def offload(self, optimizer: bool = True) -> None:
        """Move parameters (and optimizer state) to CPU to free the accelerator. No-op on CPU."""
        self._offloaded = True
        if self.device.type == "cpu":
            return
        self.model.to("cpu")
        if optimizer and self.optimizer is not None:
            self._move_optimizer("cpu")
        torch.cuda.empty_cache()

    def reload(self, optimizer: bool = True) -> None:
        """Bring parameters (and optimizer state) back to the device. No-op on CPU."""
        self._offloaded = False
        if self.device.type == "cpu":
            return
        self.model.to(self.device)
        if optimizer and self.optimizer is not None:
            self._move_optimizer(self.device)

    def _move_optimizer(self, device) -> None:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not (
                    k == "step" and v.device.type == "cpu" and v.dim() == 0
                ):
                    state[k] = v.to(device, non_blocking=True)

    # -- checkpoints (workers/engine/checkpoint.py) ----------------------------------------------------------

    def checkpoint_group(self):
        return self.device_mesh.get_group() if self.use_fsdp else None

    def checkpoint_layout(self) -> dict:
        return {"value_head": self.is_value_model}  # DCP reshards FSDP shards to any DP size

    def state_dict(self) -> dict:
        return module_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        load_module_state(self.model, self.optimizer, state)

    def save_checkpoint(self, root_dir: str, extra: dict | None = None, step: int | None = None) -> str:
        return save_checkpoint(self, root_dir, step=step, extra=extra)

    def load_checkpoint(self, path: str) -> dict:
        return load_checkpoint(self, path)

    def export_hf(self, out_dir: str, tokenizer=None) -> str | None:
        return export_hf(self, out_dir, tokenizer=tokenizer)

    @property
    def num_params(self) -> int:
        """Parameter count of the full (unsharded) model; a DTensor reports its global numel."""
        return sum(p.numel() for p in self.model.parameters())
