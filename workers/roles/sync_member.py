"""`WeightSyncMember`: the worker side of joining and leaving a weight-sync process group, shared by both ends
of a disaggregated weight sync (the trainer, `workers.roles.actor.ActorWorker`, and
`workers.roles.rollout.RolloutWorker`). The controller side is `workers.weight_sync.sync.WeightSync`."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

from controller import Dispatch, register
from workers.weight_sync import DEFAULT_GROUP_NAME, WeightSyncMemberships


class WeightSyncMember:
    """Worker mixin (needs ``self.tag``): the weight-sync groups this rank belongs to."""

    if TYPE_CHECKING:  # the `controller.Worker` it is mixed into gives it

        @property
        def tag(self) -> str: ...

    @cached_property
    def weight_sync_groups(self) -> WeightSyncMemberships:
        return WeightSyncMemberships()

    @register(Dispatch.ALL_TO_ALL)
    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        rank: int | None,
        world_size: int,
        backend: str | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 300.0,
    ) -> dict | None:
        """Join the weight-sync group as member ``rank`` (0: the source; None: this rank is not a member, e.g.
        trainer ranks > 0). Blocks until every member joined, so the controller issues it on both groups
        without blocking. Every argument is a list with one entry per rank of the group."""
        if rank is None:
            return None
        group = self.weight_sync_groups.join(
            group_name,
            rank,
            world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            timeout_s=timeout_s,
            label=f"{self.tag} (weight-sync rank {rank}/{world_size})",
        )
        return {"rank": rank, "world_size": world_size, "backend": group.backend_name}

    @register(Dispatch.ONE_TO_ALL)
    def destroy_weight_sync(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave the group (a rank that is not a member has nothing to do)."""
        self.weight_sync_groups.leave(group_name)
