"""Mixture-of-experts training support over Hugging Face MoE models: find the routers, record the experts they
choose, replay given routes (rollout routing replay, R3), the auxiliary router losses, and routing metrics.

**The router contract.** A router is found by its structure, never by its class or name list
(:func:`moe_routers`): a module whose class name ends with ``Router`` and that has an int ``top_k``, an int
``num_experts`` and a 2-D ``weight`` of ``num_experts`` rows. It is called on the flattened tokens
``[n, hidden]`` and returns ``(router_logits [n, E], router_scores [n, k], router_indices [n, k])`` where the
scores are the top-k of ``softmax(logits, fp32)`` over all experts, renormalised to sum to one when it
renormalises, in the router's own output dtype. Recording needs only the output's shape; replay also checks,
on each router's first call inside the context, that the router's own scores are exactly that function of its
logits, and refuses the router (``NotImplementedError``) otherwise.

Checked against transformers 5.25 (the first two items run in tests/workers/engine/test_moe_routing.py, the
rest read from the source only):

- ``Qwen3MoeTopKRouter`` (the tiny ``arch="moe"`` model), ``Qwen2MoeTopKRouter``, ``OlmoeTopKRouter``: the
  same code, renormalising when ``norm_topk_prob``, scores cast to the logits' dtype. Qwen2-MoE's router does
  not differ; its shared expert and the shared expert's sigmoid gate live in the sparse block, outside the
  router, so replay leaves them alone and Qwen2-MoE is supported. Its ``decoder_sparse_step`` /
  ``mlp_only_layers`` can make some layers dense: the routes' layer axis counts routers (sparse layers), in
  :func:`moe_routers` order, not decoder layers.
- ``MixtralTopKRouter``: no ``norm_topk_prob`` attribute, always renormalises, scores left in fp32. Routers
  without the attribute are taken to renormalise, and replayed scores take the router's own scores' dtype
  (for the Qwen/OLMoE routers, the logits' dtype).
- The Qwen3 code is also FlexOlmo's, Mellum's, Qwen3-Next's and Qwen3-Omni-MoE's thinker/talker routers';
  Mixtral's is MiniMax's; Qwen3-VL-MoE, Qwen3.5-MoE and Qwen3-Omni-MoE's text router always renormalise.
  GraniteMoe, Aria and GPT-OSS take the softmax of the top-k logits, which equals the renormalised top-k
  softmax, so they should pass the check. Refused by the check: sigmoid or bias-corrected routers
  (DeepSeek-V3, GLM-4-MoE, MiniMax-M2, ...), scaled ones, and Jamba's (no renormalisation and no flag; only
  caught when its top-k probabilities do not already sum to ~1 on the checked batch). Llama-4's router,
  which returns ``(scores, logits)``, fails the shape check.

A route tensor is ``int [n_tokens, n_routers, k]``: row ``i`` is the i-th row the routers see in one forward,
i.e. the forward's batch and sequence flattened (``input_ids.reshape(-1)`` order), or the packed tokens.

Hooks, not replaced forwards: both contexts register forward hooks and remove them on exit, even on an error,
so the routers' ``forward`` is never touched and other wrappers (accelerate, FSDP) compose. The replay hook is
prepended, so a recorder inside or outside a replay sees the routes the experts actually used. Each router is
assumed to run once per forward; a gradient-checkpointing recompute runs it again with the same result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

# The router output every function here relies on: (logits [n, E], scores [n, k], indices [n, k]).
RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (``modules()`` visits layers in registration order); empty if dense."""
    return [m for m in model.modules() if _looks_like_router(m)]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_routers(model))


def _looks_like_router(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    top_k, num_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    return (
        type(module).__name__.endswith("Router")
        and isinstance(top_k, int)
        and isinstance(num_experts, int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[0] == num_experts
    )


# nn.Module types unknown attributes as Tensor | Module; the router's are ints (moe_routers checked them).
def _top_k_of(router: nn.Module) -> int:
    return int(getattr(router, "top_k"))  # noqa: B009


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts"))  # noqa: B009


def _weight(router: nn.Module) -> torch.Tensor:
    weight = router.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _router_output(router: nn.Module, layer: int, output: Any) -> RouterOutput:
    """The router's output, checked against the contract, so an unsupported router fails by name here and not
    as a shape error deep inside the experts."""
    e, k = _num_experts(router), _top_k_of(router)
    ok = isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)
    if ok:
        logits, scores, indices = output
        n = logits.shape[0]
        ok = (
            logits.dim() == 2
            and logits.shape[1] == e
            and tuple(scores.shape) == (n, k)
            and tuple(indices.shape) == (n, k)
            and not indices.is_floating_point()
        )
    if not ok:
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in _as_tuple(output)]
        raise NotImplementedError(
            f"router of layer {layer} ({type(router).__name__}) returned {got}; hyflow's MoE support needs "
            f"(logits [n, {e}], scores [n, {k}], indices [n, {k}])"
        )
    return output


def _as_tuple(output: Any) -> tuple:
    return output if isinstance(output, tuple) else (output,)


# ---------------------------------------------------------------------------------------------------------
# Recording


class RouteRecord:
    """What :func:`record_routes` collected: each router's output of its latest call."""

    def __init__(self, n_layers: int) -> None:
        self._indices: list[torch.Tensor | None] = [None] * n_layers
        self._logits: list[torch.Tensor | None] = [None] * n_layers

    def _store(self, layer: int, logits: torch.Tensor, indices: torch.Tensor) -> None:
        # Overwritten on every call: the latest forward wins, and a checkpointing recompute writes the same ids.
        self._indices[layer] = indices.detach()
        self._logits[layer] = logits

    def routes(self) -> torch.Tensor:
        """``int64 [n_tokens, n_layers, k]``: the expert ids each router chose in the latest forward."""
        indices = self._complete(self._indices)
        if len({t.shape for t in indices}) != 1:
            raise RuntimeError(f"routers saw different token counts: {[tuple(t.shape) for t in indices]}")
        return torch.stack(indices, dim=1).long()

    def router_logits(self) -> list[torch.Tensor]:
        """Per layer ``[n_tokens, num_experts]``, still in the autograd graph (for the auxiliary losses)."""
        return self._complete(self._logits)

    @staticmethod
    def _complete(per_layer: list[torch.Tensor | None]) -> list[torch.Tensor]:
        missing = [i for i, t in enumerate(per_layer) if t is None]
        if missing:
            raise RuntimeError(
                f"no forward recorded for router layers {missing} (run the model inside the context)"
            )
        return [t for t in per_layer if t is not None]


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[RouteRecord]:
    """Collect every router's chosen experts (and logits) during the forwards inside the context."""
    routers = moe_routers(model)
    record = RouteRecord(len(routers))

    def hook_for(layer: int):
        def hook(router: nn.Module, args: Any, output: Any) -> None:
            logits, _, indices = _router_output(router, layer, output)
            record._store(layer, logits, indices)

        return hook

    with _hooks(routers, hook_for, prepend=False):
        yield record


@contextlib.contextmanager
def _hooks(routers: Sequence[nn.Module], hook_for: Any, prepend: bool) -> Iterator[None]:
    handles = []
    try:
        for layer, router in enumerate(routers):
            handles.append(router.register_forward_hook(hook_for(layer), prepend=prepend))
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------------------
# Routing replay (R3)


@contextlib.contextmanager
def routing_replay(model: nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Inside the context every router uses the experts ``routes[:, layer, :]`` instead of its own top-k.

    The router still computes its logits (so the forward is its own: dtype, bias, fp32 upcast), then its scores
    become ``softmax(logits, fp32)`` gathered at the given ids, renormalised when the router renormalises, in
    the router's score dtype: the gradient reaches the router weight through those scores. A row of ``-1``
    (no recorded route, e.g. padding) keeps the router's own top-k and scores.
    """
    routers = moe_routers(model)
    per_layer = _checked_routes(routers, routes)
    checked: set[int] = set()

    def hook_for(layer: int):
        def hook(router: nn.Module, args: Any, output: Any) -> RouterOutput:
            logits, own_scores, own_indices = _router_output(router, layer, output)
            if layer not in checked:  # one host sync per router per context, not per forward
                _check_softmax_top_k(router, layer, logits, own_scores, own_indices)
                checked.add(layer)
            return _replayed(router, layer, routes.shape, per_layer[layer], logits, own_scores, own_indices)

        return hook

    with _hooks(routers, hook_for, prepend=True):
        yield


def _checked_routes(routers: Sequence[nn.Module], routes: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
    """Per layer: the ids (``long``, on the router's device) and whether some rows fall back (-1)."""
    if not routers:
        raise ValueError("routing_replay: the model has no MoE routers")
    k = _top_k_of(routers[0])
    expected = f"(n_tokens, {len(routers)}, {k})"
    if routes.dim() != 3 or routes.shape[1] != len(routers):
        raise ValueError(
            f"routes: expected shape {expected} (one column per router), given {tuple(routes.shape)}"
        )
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(f"routes must be an integer tensor, given {routes.dtype}")
    per_layer = []
    for layer, router in enumerate(routers):
        if routes.shape[2] != _top_k_of(router):
            raise ValueError(
                f"routes: layer {layer} routes top_k={_top_k_of(router)}: expected shape "
                f"(n_tokens, {len(routers)}, {_top_k_of(router)}), given {tuple(routes.shape)}"
            )
        ids = routes[:, layer, :].to(device=_weight(router).device, dtype=torch.long)
        _check_ids(layer, ids, _num_experts(router))
        per_layer.append((ids, bool((ids[:, 0] < 0).any())))
    return per_layer


def _check_ids(layer: int, ids: torch.Tensor, num_experts: int) -> None:
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
        row = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(
            f"routes: layer {layer}, token {row}: expert id out of range [0, {num_experts}) (or -1 for no route): "
            f"{ids[row].tolist()}"
        )
    unset = ids < 0
    partial = unset.any(dim=1) & ~unset.all(dim=1)
    if partial.any():
        row = int(partial.nonzero()[0])
        raise ValueError(
            f"routes: layer {layer}, token {row}: -1 must fill a whole row, given {ids[row].tolist()}"
        )
    sorted_ids = ids.sort(dim=1).values
    repeated = ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)).any(dim=1)
    if repeated.any():
        row = int(repeated.nonzero()[0])
        raise ValueError(f"routes: layer {layer}, token {row}: an expert repeats in {ids[row].tolist()}")


def _renormalises(router: nn.Module) -> bool:
    # Mixtral's router has no flag and always renormalises; the contract check catches one that does not.
    return bool(getattr(router, "norm_topk_prob", True))


def _top_k_scores(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The router's scoring at the given experts, in fp32: softmax over all experts, gathered, renormalised."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
    if _renormalises(router):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores


def _check_softmax_top_k(
    router: nn.Module, layer: int, logits: torch.Tensor, own_scores: torch.Tensor, own_indices: torch.Tensor
) -> None:
    """Refuse a router whose scores are not the (renormalised) top-k softmax of its logits: replaying it with
    that formula would train a different function than the one that generated the rollouts."""
    with torch.no_grad():
        ours = _top_k_scores(router, logits, own_indices.long()).to(own_scores.dtype).float()
        atol = max(1e-5, 2 * torch.finfo(own_scores.dtype).eps)
        if not torch.allclose(ours, own_scores.float(), rtol=0.0, atol=atol):
            err = float((ours - own_scores.float()).abs().max())
            raise NotImplementedError(
                f"routing_replay: the router of layer {layer} ({type(router).__name__}) does not score experts "
                f"as the {'renormalised ' if _renormalises(router) else ''}top-k of softmax(logits) "
                f"(max difference {err:.3g}); replaying its routes is not supported"
            )


def _replayed(
    router: nn.Module,
    layer: int,
    routes_shape: torch.Size,
    ids_and_fallback: tuple[torch.Tensor, bool],
    logits: torch.Tensor,
    own_scores: torch.Tensor,
    own_indices: torch.Tensor,
) -> RouterOutput:
    ids, has_fallback = ids_and_fallback
    n = logits.shape[0]
    if ids.shape[0] != n:
        raise ValueError(
            f"routes: layer {layer} routes {n} tokens: expected shape ({n}, {routes_shape[1]}, {routes_shape[2]}), "
            f"given {tuple(routes_shape)}"
        )
    if not has_fallback:
        return logits, _top_k_scores(router, logits, ids).to(own_scores.dtype), ids.to(own_indices.dtype)
    # Rows without a route keep the router's own choice and scores (its own autograd path).
    unset = ids[:, :1] < 0
    ids = torch.where(unset, own_indices.long(), ids)
    scores = torch.where(unset, own_scores, _top_k_scores(router, logits, ids).to(own_scores.dtype))
    return logits, scores, ids.to(own_indices.dtype)


# ---------------------------------------------------------------------------------------------------------
# Auxiliary losses


def _row_weights(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """``float [n]``: 1 for the rows that count, from a ``[batch, seq]`` or ``[n]`` mask (None: all rows)."""
    if mask is None:
        return torch.ones(n, device=device)
    if mask.numel() != n:
        raise ValueError(
            f"mask has {mask.numel()} elements ({tuple(mask.shape)}), the router logits {n} rows"
        )
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer balance loss, averaged over layers: ``E * sum_e f_e * P_e`` with ``f_e`` the share of
    the (unmasked) tokens' top-k assignments that go to expert ``e`` and ``P_e`` its mean router probability.

    1.0 when routing is uniform, ``E / top_k`` at worst (all tokens on the same ``top_k`` experts). Per layer this is
    Hugging Face's ``load_balancing_loss_func`` divided by ``top_k`` (it counts a token once per chosen expert,
    so ``sum_e f_e = top_k``), and HF pools all layers' rows before the product instead of averaging layers.
    Only ``P_e`` carries a gradient (the top-k choice does not)."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w = _row_weights(mask, probs.shape[0], probs.device)
        total = w.sum().clamp(min=1.0)  # all rows masked: a zero loss, not a NaN
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
        fraction = (chosen * w[:, None]).sum(dim=0) / (total * top_k)
        mean_prob = (probs * w[:, None]).sum(dim=0) / total
        losses.append(probs.shape[1] * (fraction * mean_prob).sum())
    return torch.stack(losses).mean()


def router_z_loss(router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over (unmasked) tokens of ``logsumexp(logits)^2``, averaged over layers;
    it keeps the logits small so the fp32 softmax stays well conditioned."""
    losses = []
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).square()
        w = _row_weights(mask, z.shape[0], z.device)
        losses.append((z * w).sum() / w.sum().clamp(min=1.0))
    return torch.stack(losses).mean()


# ---------------------------------------------------------------------------------------------------------
# Metrics


def _compared_rows(routes: Sequence[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """``bool [n]``: the rows the mask keeps and every route tensor has a route for (no -1)."""
    keep = _row_weights(mask, routes[0].shape[0], routes[0].device).bool()
    for r in routes:
        keep &= (r >= 0).all(dim=2).all(dim=1)
    return keep


def route_mismatch(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """How often two route tensors ``[n, L, k]`` (e.g. rollout vs training) pick a different expert SET.

    ``moe/route_mismatch/layer_{i}``: share of tokens differing at layer i; ``moe/route_mismatch``: share of
    (token, layer) pairs; ``moe/route_mismatch_any_layer``: share of tokens differing at some layer. Rows
    masked out or without a route (-1) in either tensor are not counted."""
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(
            f"route_mismatch: expected two [n, L, k] tensors of one shape, given {a.shape}, {b.shape}"
        )
    keep = _compared_rows([a, b], mask)
    # Sorting within the top-k compares sets: the order a router lists its experts in carries nothing.
    differ = (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)[keep]  # bool [kept, L]
    out = {f"moe/route_mismatch/layer_{i}": _mean(differ[:, i]) for i in range(a.shape[1])}
    out["moe/route_mismatch"] = _mean(differ)
    out["moe/route_mismatch_any_layer"] = _mean(differ.any(dim=1))
    return out


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else 0.0


def expert_load(routes: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Expert load imbalance of routes ``[n, L, k]``: per layer the busiest expert's assignments over the mean
    per expert (1.0 is perfectly balanced, ``num_experts / k`` all tokens on the same k experts; 0.0 with no
    tokens). Rows masked out or without a route (-1) are not counted.
    ``moe/expert_load_max_over_mean`` is the mean over layers, ``.../layer_{i}`` each layer's."""
    if routes.dim() != 3:
        raise ValueError(f"expert_load: expected routes [n, L, k], given {tuple(routes.shape)}")
    kept = routes[_compared_rows([routes], mask)].long()  # [kept, L, k]
    if kept.numel() and int(kept.max()) >= num_experts:
        raise ValueError(f"expert_load: expert id {int(kept.max())} out of range [0, {num_experts})")
    out: dict[str, float] = {}
    for i in range(routes.shape[1]):
        counts = torch.bincount(kept[:, i, :].reshape(-1), minlength=num_experts).float()
        ratio = counts.max() / counts.mean() if kept.shape[0] else counts.new_zeros(())
        out[f"moe/expert_load_max_over_mean/layer_{i}"] = float(ratio)
    per_layer = list(out.values())
    out["moe/expert_load_max_over_mean"] = sum(per_layer) / len(per_layer) if per_layer else 0.0
    return out
