"""The controller's typed handles on worker groups: what each role's group can be called with, and what it returns.

A `RayWorkerGroup` binds every ``@register``-ed method of its worker class at run time, so to a type checker
``roles.actor.update_actor`` is unknown and a renamed worker method would surface only when a run calls it. Each
class here is the type of one role's group: `RayWorkerGroup`'s own members plus that role's group methods, each
written with the signature the *group* call has (the dispatch mode turns the worker method's into it:
``ONE_TO_ALL`` returns the list of the ranks' results, ``ALL_TO_ALL`` takes one list entry per rank, a rank-zero
mode returns rank 0's result, a DataProto mode the collected batch). `role_group` checks that a group has every
method its handle names and returns it typed so; ``tests/workers/roles/test_handles.py`` checks every handle
against its worker classes, method by method, so a renamed or re-typed worker method fails the suite, and mypy
checks every controller call against the handles.

The handles are never instantiated: a group is a `RayWorkerGroup`, typed as its role's handle by `role_group`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from controller import RayWorkerGroup
from controller.worker_group import GroupMethod
from dataproto import DataProto

P = ParamSpec("P")
R = TypeVar("R")
G = TypeVar("G", bound=RayWorkerGroup)
WEIGHT_SYNC_GROUP = "hyflow_weight_sync"  # workers/roles/sync_member.py's default group name

if TYPE_CHECKING:

    def group_method(method: Callable[Concatenate[Any, P], R]) -> GroupMethod[P, R]: ...

else:

    def group_method(method):
        """Marks a handle's member as a group method: to the type checker a `GroupMethod` with the member's
        parameters and result (``.with_options`` included); at run time the function itself, which
        `role_group` and the tests read."""
        method.is_group_method = True
        return method


def group_methods(handle: type) -> dict[str, Callable]:
    """The group methods a handle declares, by name (its own and those it inherits from another handle)."""
    return {
        name: member
        for klass in reversed(handle.__mro__)
        for name, member in vars(klass).items()
        if getattr(member, "is_group_method", False)
    }


def role_group(group: RayWorkerGroup, handle: type[G]) -> G:
    """``group`` typed as ``handle``, once it has every group method the handle declares (a TypeError naming the
    group, the handle and what is missing otherwise: a worker class that does not serve this role)."""
    missing = sorted(
        name for name in group_methods(handle) if not isinstance(getattr(group, name, None), GroupMethod)
    )
    if missing:
        raise TypeError(
            f"worker group {group.name!r} ({group._worker_cls.__name__}) cannot serve as {handle.__name__}: it has no "
            f"group method {', '.join(missing)}"
        )
    return cast(G, group)  # the handle is RayWorkerGroup's type with these methods named


class RoleGroup(RayWorkerGroup):
    """Any role's group: every role builds what it holds (its model, engine, scorer) in ``init_model``."""

    @group_method
    def init_model(self) -> list[None]: ...


class EngineGroup(RoleGroup):
    """A group whose ranks hold a training engine (actor, critic, reference): model setup and checkpoints."""

    @group_method
    def worker_info(self) -> list[dict]: ...
    @group_method
    def save_checkpoint(self, root_dir: str, step: int, extra: dict | None = None) -> list[str]: ...
    @group_method
    def load_checkpoint(self, path: str) -> list[dict]: ...
    @group_method
    def export_hf(self, out_dir: str) -> list[str]: ...


class RefGroup(EngineGroup):
    """The reference policy (`workers/roles/reference.py`; with LoRA the actor's group, scoring with its frozen
    base): log-probs under the reference, and the hybrid recipe's hinted teacher."""

    @group_method
    def compute_ref_log_prob(self, data: DataProto) -> DataProto: ...
    @group_method
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto: ...


class WeightSyncGroup(RayWorkerGroup):
    """A member of a weight-sync process group (`workers/roles/sync_member.py`): the actor sends, rollouts receive."""

    @group_method
    def init_weight_sync(
        self,
        master_addr: list[str],
        master_port: list[int],
        rank: list[int | None],
        world_size: list[int],
        backend: list[str | None] = ...,
        group_name: list[str] = ...,
        timeout_s: list[float] = ...,
    ) -> list[dict | None]: ...
    @group_method
    def destroy_weight_sync(self, group_name: str = WEIGHT_SYNC_GROUP) -> list[None]: ...


class ActorGroup(RefGroup, WeightSyncGroup):
    """The policy being trained (`workers/roles/actor.py`)."""

    @group_method
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    @group_method
    def update_actor(self, data: DataProto) -> DataProto: ...
    @group_method
    def sft_step(self, data: DataProto) -> DataProto: ...
    @group_method
    def open_weight_sync_store(
        self, world_size: int, group_name: str = WEIGHT_SYNC_GROUP, timeout_s: float = 300.0
    ) -> tuple[str, int]: ...
    @group_method
    def send_weights(
        self, bucket_bytes: int | None = None, group_name: str = WEIGHT_SYNC_GROUP, adapter_only: bool = False
    ) -> dict: ...


class CriticGroup(EngineGroup):
    """The value model of PPO (`workers/roles/critic.py`)."""

    @group_method
    def compute_values(self, data: DataProto) -> DataProto: ...
    @group_method
    def update_critic(self, data: DataProto) -> DataProto: ...


class GeneratorGroup(RoleGroup):
    """What makes a step's batch from its prompts: the rollout role, or the environment role that runs agents on
    it (`workers/agents/env_worker.py`)."""

    @group_method
    def generate_sequences(self, data: DataProto) -> DataProto: ...


class RolloutGroup(GeneratorGroup, WeightSyncGroup):
    """The rollout engines that take the actor's weights (`workers/roles/rollout.py`)."""

    @group_method
    def sync_weights(self, version: int | None = None) -> dict: ...
    @group_method
    def sync_resharded_weights(self, version: int | None = None) -> dict: ...
    @group_method
    def receive_weights(
        self,
        group_name: str = WEIGHT_SYNC_GROUP,
        version: int | None = None,
        abort_running: bool = False,
        adapter_only: bool = False,
    ) -> list[dict]: ...
    @group_method
    def rollout_named_weights(self, names: list[str] | None = None) -> list[dict]: ...


class EnvGroup(GeneratorGroup):
    """Agent environments over the rollout engines (`workers/agents/env_worker.py`)."""

    @group_method
    def env_info(self) -> list[dict]: ...
    @group_method
    def close_env(self) -> list[None]: ...


class RewardGroup(RoleGroup):
    """The reward scorers (`workers/roles/reward.py`)."""

    @group_method
    def compute_rm_score(self, data: DataProto) -> DataProto: ...


class PRMGroup(RoleGroup):
    """The hybrid recipe's process reward model (`workers/prm/worker.py`)."""

    @group_method
    def score_steps(self, data: DataProto) -> DataProto: ...
