"""One micro-batch forward of a mixture-of-experts model in the FSDP engine: the routes it replays, the routes and
router logits it records, and what the engine takes from them (the router losses, per-row route columns and the
rollout-vs-trainer route mismatch).

Routes travel as batch columns ``[B, P+R, routers, top-k]`` int16 aligned with ``input_ids``, -1 where none was
recorded (``routed_experts``: the rollout engine's; ``old_routed_experts``: the old log-prob pass's); the forward
packs them with the micro-batch's tokens (`PackedBatch.pack_column`) and unpacks what it records the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch import nn

from workers.engine.moe import load_balancing_loss, moe_routers, record_routes, router_z_loss, routing_replay
from workers.engine.packing import PackedBatch

ROLLOUT_ROUTES = "routed_experts"  # the rollout engine's routes (workers/rollout/batch.py)
OLD_ROUTES = "old_routed_experts"  # the old log-prob pass's own routes (routing_replay=old_log_prob)


class MoEForward:
    """Wraps one forward: ``with step.routing(): model(...)``, then read the losses and outputs."""

    def __init__(
        self, model: nn.Module, packed: PackedBatch, micro: Mapping[str, torch.Tensor], replay: str | None
    ):
        routers = moe_routers(model)
        self.model = model
        self.top_k = int(cast(int, routers[0].top_k))
        self.num_experts = int(cast(int, routers[0].num_experts))
        self.packed = packed
        if replay is not None and replay not in micro:
            raise KeyError(
                f"routing replay reads the batch column {replay!r}, which this batch does not have "
                f"(columns: {sorted(micro)}); a rollout engine without expert routes cannot be replayed"
            )
        self.replayed = packed.pack_column(micro[replay]).long() if replay is not None else None
        rollout = micro.get(ROLLOUT_ROUTES)
        self.rollout = packed.pack_column(rollout).long() if rollout is not None else None
        self.logits: list[torch.Tensor] = []

    @contextlib.contextmanager
    def routing(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            record = stack.enter_context(record_routes(self.model))
            if self.replayed is not None:
                stack.enter_context(routing_replay(self.model, self.replayed))
            yield
        self.logits = record.router_logits()

    def own_routes(self) -> torch.Tensor:
        """``[T, routers, k]``: the experts each router would choose itself (its top-k), replayed or not."""
        return torch.stack([lg.detach().topk(self.top_k, dim=-1).indices for lg in self.logits], dim=1)

    def losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss) over the micro-batch's real tokens, in the graph."""
        return load_balancing_loss(self.logits, self.top_k), router_z_loss(self.logits)

    def outputs(self) -> dict[str, torch.Tensor]:
        """Per-row results in the micro-batch's row order: ``routes`` [b, P+R, routers, k] int16, the routers' own
        choice (-1 on padding): what the old log-prob pass hands the update with ``routing_replay=old_log_prob``."""
        return {"routes": self.packed.unpack_column(self.own_routes().to(torch.int16), -1)}

    def unreplayed_share(self) -> float | None:
        """With replay on, the share of the positions whose logits give the trained log-probs (``keep_index``) that
        had no route to replay (-1: their routers chose, e.g. an agent row whose call's routes were not found);
        None without replay. Replay is partial, not silent: docs/moe.md's ``actor/moe/unreplayed_share``."""
        if self.replayed is None:
            return None
        keep = self.packed.keep_index.to(self.replayed.device)
        if keep.numel() == 0:
            return None
        return float((self.replayed.index_select(0, keep)[:, 0, 0] < 0).float().mean())

    def mismatch_by_layer(self) -> torch.Tensor | None:
        """[routers]: the share of the packed tokens with rollout routes whose expert set differs from the routers'
        own top-k; None when the batch has no rollout routes (or none to compare)."""
        if self.rollout is None:
            return None
        compared = self.rollout[:, 0, 0] >= 0
        if not bool(compared.any()):
            return None
        own = self.own_routes()
        differ = (own.sort(-1).values != self.rollout.sort(-1).values).any(-1)
        return differ[compared].float().mean(0)
