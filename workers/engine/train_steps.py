"""What both training engines (FSDP2, Megatron-core) run the same way: `EngineSteps`, the mixin that gives
them ``compute_log_prob`` / ``compute_values`` / ``train_step`` (the mini-batch loop, the clipped optimizer step
that skips a non-finite gradient norm, the metrics) and ``state_dict`` / ``load_state_dict``, plus the pieces
of a step: the loss mask, the seeded mini-batch order, the global token/sequence counts a loss normalises by,
and the checked call of the user's ``loss_fn``. An engine supplies the passes themselves (`_forward`,
`_backward_mini_batch`), its data-parallel group, its gradients and their norm, and its model state."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from workers.engine.base import (
    FORWARD_KEYS,
    EngineConfig,
    LossContext,
    LossFn,
    MegatronConfig,
    as_tensor_dict,
    require_keys,
)


@dataclass
class EngineCall:
    """The batch and the settings of one engine call (``compute_*`` or ``train_step``)."""

    tensors: dict[str, torch.Tensor]
    temperature: float  # divides the logits
    micro_batch_size: int | None  # rows per micro-batch, or
    max_token_len: int | None  # a token budget per micro-batch
    # mixture of experts: the batch column of expert routes every forward replays (None: the routers choose)
    replay_routes: str | None = None

    @property
    def rows(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def response_length(self) -> int:
        return self.tensors["responses"].shape[1]


def read_call(
    data, where: str, temperature: float | None, micro_batch_size: int | None, max_token_len: int | None
) -> EngineCall:
    """An `EngineCall` from a dict of tensors or a DataProto: the temperature and micro-batching given as
    arguments, else from ``meta_info`` (``temperature`` (default 1); ``max_token_len`` when
    ``use_dynamic_bsz``, else ``micro_batch_size``)."""
    tensors, meta = as_tensor_dict(data)
    require_keys(tensors, *FORWARD_KEYS, where=where)
    temperature = float(temperature if temperature is not None else meta.get("temperature", 1.0))
    if micro_batch_size is None and max_token_len is None:
        if meta.get("use_dynamic_bsz"):
            max_token_len = meta.get("max_token_len")
        else:
            micro_batch_size = meta.get("micro_batch_size")
    return EngineCall(tensors, temperature, micro_batch_size, max_token_len)


def response_loss_mask(tensors: dict[str, torch.Tensor], key: str, response_length: int) -> torch.Tensor:
    """``tensors[key]`` as float, or the response part of the attention mask when the batch has no such key."""
    if key in tensors:
        return tensors[key].float()
    return tensors["attention_mask"][:, -response_length:].float()


def minibatch_order(n: int, *, shuffle: bool, seed: int, global_step: int, epoch: int) -> torch.Tensor:
    """Row order of one epoch: a permutation seeded by (seed, step, epoch), so resumed runs repeat it."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + global_step * 7919 + epoch)
    return torch.randperm(n, generator=g)


def mask_counts(mask: torch.Tensor) -> torch.Tensor:
    """[tokens, sequences with a token] of a mini-batch's loss mask (float64, to be SUM-reduced over DP)."""
    return torch.tensor([float(mask.sum()), float((mask.sum(dim=1) > 0).sum())], dtype=torch.float64)


def call_loss_fn(loss_fn, outputs, batch, ctx) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss_fn(outputs, batch, ctx)`` -> (scalar loss, metrics as floats); a wrong return type is an error."""
    ret = loss_fn(outputs, batch, ctx)
    loss, m = ret if isinstance(ret, tuple) else (ret, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"loss_fn must return a scalar tensor (or (tensor, metrics)), got {loss!r}")
    return loss, {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in (m or {}).items()}


def step_metrics(
    losses: list[float],
    grad_norms: list[float],
    lrs: list[float],
    skipped_now: int,
    skipped_steps: int,
    global_step: int,
    extra: dict[str, list[float]],
) -> dict[str, Any]:
    """The metrics of one ``train_step`` call: means over its optimizer steps (grad norm over applied ones)."""
    applied = [g for g in grad_norms if math.isfinite(g)]
    metrics: dict[str, Any] = {
        "loss": sum(losses) / len(losses),
        "grad_norm": sum(applied) / len(applied) if applied else float("nan"),
        "lr": lrs[-1],  # the learning rate of the last step of this call
        "skipped": skipped_now,
        "skipped_steps": skipped_steps,
        "global_step": global_step,
        "losses": losses,
        "grad_norms": grad_norms,
    }
    for k, v in extra.items():
        metrics[k] = sum(v) / len(v)
    return metrics


def module_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, trainable_only: bool = False
) -> dict:
    """{"model": ..., "optim": ...} of a (possibly FSDP-sharded) module, in DCP form; ``trainable_only``: the
    parameters that train (LoRA adapters), not the frozen ones, which the model path restores."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    if trainable_only:  # a frozen weight tied to another (the output head) escapes ignore_frozen_params
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in trainable}
    return {"model": msd} if optimizer is None else {"model": msd, "optim": osd}


def load_module_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict,
    *,
    trainable_only: bool = False,
) -> None:
    # strict off with trainable_only: the frozen parameters are absent from the state by design
    options = StateDictOptions(strict=not trainable_only)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={}, options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )


class EngineSteps:
    """The methods both engines share (see the module docstring); an engine sets the attributes below and
    implements the hooks."""

    config: EngineConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None  # None: forward only
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    global_step: int
    skipped_steps: int
    dp_size: int
    dp_rank: int
    device: torch.device
    is_value_model: bool
    _offloaded: bool  # parameters moved off the device (train_step refuses until reload)

    # -- construction and replica layout (`TrainEngine`): defaults for an engine whose every rank is a replica --

    @classmethod
    def from_config(cls, config: EngineConfig, parallel: MegatronConfig) -> Self:
        """The engine of this rank; ``parallel`` (model-parallel sizes) is for engines that use it."""
        return cls(config)  # type: ignore[call-arg]  # the engines' own __init__ takes the config

    @classmethod
    def model_parallel_size(cls, parallel: MegatronConfig) -> int:
        """1: every rank holds a whole replica (FSDP shards parameters, but each rank computes on its own data)."""
        return 1

    def dispatch_place(self, rank: int) -> tuple[int, bool]:
        """Every rank is its own replica (dp rank = group rank, even for an unsharded forward-only engine whose
        ``dp_size`` is 1), and every rank is collected."""
        return rank, True

    def replica_coords(self) -> dict[str, int]:
        return {}

    # -- hooks ----------------------------------------------------------------------------------------------

    def _forward(self, call: EngineCall, calculate_entropy: bool) -> dict[str, torch.Tensor]:
        """Outputs ([B, R] each, CPU, input row order) of a forward-only pass over ``call``'s batch."""
        raise NotImplementedError

    def _backward_mini_batch(
        self, call: EngineCall, rows: list[int], loss_fn: LossFn, context, calculate_entropy: bool
    ) -> tuple[torch.Tensor, list[dict[str, float]]]:
        """Forward and backward passes over mini-batch ``rows`` of ``call`` (gradients left summed over DP
        ranks); ``context(micro_batch_index=, num_micro_batches=)`` is each micro-batch's `LossContext`.
        Returns this rank's summed loss (float64) and the metrics of each micro-batch."""
        raise NotImplementedError

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors (clipping scales them in place)."""
        raise NotImplementedError

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients, every element counted once."""
        raise NotImplementedError

    def _model_state(self) -> dict:
        """Model (+ optimizer) state for DCP; keys unique per distinct shard, replicas share keys."""
        raise NotImplementedError

    def _load_model_state(self, state: dict) -> None:
        raise NotImplementedError

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group; None where there is nothing to reduce over (one replica)."""
        raise NotImplementedError

    def dp_all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced over the data-parallel group (on the device: NCCL reduces CUDA tensors only); the
        result on CPU. Identity with one replica."""
        group = self.dp_group
        if group is not None:
            t = t.to(self.device)
            dist.all_reduce(t, op=op, group=group)
        return t.cpu()

    # -- forward --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_log_prob(
        self,
        data,
        *,
        temperature: float | None = None,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        replay_routes: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``responses`` under the model: {"log_probs": [B, R]} (+ "entropy" [B, R]), fp32, on
        CPU, zeros at response padding, rows in the input order. ``temperature`` divides the logits (default:
        meta_info["temperature"] or 1). Micro-batching: ``max_token_len`` (token budget) or
        ``micro_batch_size`` rows; defaults from meta_info (use_dynamic_bsz/max_token_len/micro_batch_size).
        A mixture-of-experts model also returns its routes (`moe.MoEForward.outputs`); ``replay_routes`` names the
        batch column of routes its routers replay."""
        if self.is_value_model:
            raise TypeError("compute_log_prob on a value-head model; use compute_values")
        where = f"{type(self).__name__}.compute_log_prob"
        call = read_call(data, where, temperature, micro_batch_size, max_token_len)
        call.replay_routes = replay_routes
        return self._forward(call, calculate_entropy)

    @torch.no_grad()
    def compute_values(
        self, data, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Critic values {"values": [B, R]}: value of response token j is the head output at the position
        that predicts it (P + j - 1), as in verl; zeros at response padding."""
        if not self.is_value_model:
            raise TypeError("compute_values needs EngineConfig(value_head=True)")
        call = read_call(data, f"{type(self).__name__}.compute_values", 1.0, micro_batch_size, max_token_len)
        return self._forward(call, False)

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
        replay_routes: str | None = None,
    ) -> dict[str, Any]:
        """One or more optimizer steps over this rank's shard of the batch.

        ``mini_batch_size`` is rows *of this rank's shard* per optimizer step (default: all rows, one step per
        epoch); every rank must have the same number of mini-batches. Each mini-batch is split into
        micro-batches (``max_token_len`` token budget or ``micro_batch_size`` rows; defaults from meta_info).
        For each micro-batch::

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
        call = read_call(
            data, f"{type(self).__name__}.train_step", temperature, micro_batch_size, max_token_len
        )
        call.replay_routes = replay_routes
        n = call.rows
        mbs = mini_batch_size or n
        if n % mbs:
            raise ValueError(f"train_step: {n} rows on this rank is not a multiple of mini_batch_size={mbs}")
        num_mini = n // mbs
        check = self.dp_all_reduce(torch.tensor([num_mini, -num_mini]), dist.ReduceOp.MAX)
        if int(check[0]) != -int(check[1]):
            raise ValueError(
                f"train_step: DP ranks have different numbers of mini-batches (max {int(check[0])}, min "
                f"{-int(check[1])}); each rank must get the same number of rows"
            )
        loss_mask = response_loss_mask(call.tensors, loss_mask_key, call.response_length)

        self.model.train()
        losses, grad_norms, lrs, skipped_now = [], [], [], 0
        extra: dict[str, list[float]] = {}
        for epoch in range(epochs):
            order = minibatch_order(
                n, shuffle=shuffle, seed=self.config.seed, global_step=self.global_step, epoch=epoch
            )
            for mi in range(num_mini):
                rows = order[mi * mbs : (mi + 1) * mbs].tolist()
                counts = self.dp_all_reduce(mask_counts(loss_mask[rows]))
                context = functools.partial(
                    LossContext,
                    global_num_tokens=float(counts[0]),
                    global_num_seqs=int(counts[1]),
                    dp_size=self.dp_size,
                    dp_rank=self.dp_rank,
                    epoch=epoch,
                    mini_batch_index=mi,
                    temperature=call.temperature,
                )
                self.optimizer.zero_grad(set_to_none=True)
                step_loss, micro_metrics = self._backward_mini_batch(
                    call, rows, loss_fn, context, calculate_entropy
                )
                for m in micro_metrics:
                    for k, v in m.items():
                        extra.setdefault(k, []).append(v)
                losses.append(float(self.dp_all_reduce(step_loss)))
                lrs.append(self.optimizer.param_groups[0]["lr"])
                grad_norm, applied = self._clip_and_step()
                grad_norms.append(grad_norm)
                skipped_now += 0 if applied else 1
        return step_metrics(losses, grad_norms, lrs, skipped_now, self.skipped_steps, self.global_step, extra)

    @torch.no_grad()
    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip to ``optim.grad_clip`` and step; a non-finite norm drops the gradients instead (the optimizer
        and the LR schedule do not advance; ``skipped_steps`` counts it). Returns (pre-clip norm, applied)."""
        optimizer, schedule, optim = self.optimizer, self.lr_scheduler, self.config.optim
        assert optimizer is not None and schedule is not None and optim is not None  # train_step checked it
        norm = self.grad_norm()
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return norm, False
        clip = optim.grad_clip
        if clip and clip > 0 and norm > clip:
            torch._foreach_mul_(self._grads(), clip / (norm + 1e-6))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return norm, True

    # -- state (workers/engine/checkpoint.py) ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """The whole training state for DCP: the model shards (+ optimizer) and, under ``train``, the step
        counters and the LR schedule (the same on every rank: DCP writes them once)."""
        schedule = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        train = {
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": schedule,
        }
        return {**self._model_state(), "train": train}

    def load_state_dict(self, state: dict) -> None:
        self._load_model_state(state)
        train = state["train"]
        self.global_step, self.skipped_steps = train["global_step"], train["skipped_steps"]
        if self.lr_scheduler is not None and train["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(train["lr_scheduler"])
