"""RayWorkerGroup: one Ray actor per bundle of a resource pool, driven as one object.

Every ``@register``-ed method of the worker class becomes a group method: ``wg.compute_log_prob(data)``
keeps only the columns the method declares it reads (``@register(inputs=...)``), dispatches the arguments to
the ranks, calls them, waits (failing fast on the first error) and collects.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Generic, ParamSpec, TypeVar

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.colocate import COLOCATED_ROLES_ATTR, role_prefix
from controller.decorator import MethodSpec, registered_methods
from controller.dispatch import DispatchMode, Execute, get_dispatch_mode, normalize_dispatched
from controller.errors import DispatchError
from controller.future import DataProtoFuture
from controller.ray_class import RayClassWithInitArgs
from controller.wait import RankCall, wait_for_calls, wait_for_results
from controller.worker import DISPATCH_INFO_METHOD, READY_METHOD, master_probe
from dataproto import DataProto
from resource_pools import ResourcePool

_UNSET = object()
# Instance attributes a bound worker method must not shadow (class attributes are checked directly).
_INSTANCE_ATTRS = {
    "name",
    "resource_pool",
    "master_addr",
    "master_port",
    "call_timeout_s",
    "call_timeout_per_row_s",
    "chunks_by_value",
}


P = ParamSpec("P")
R = TypeVar("R")


class GroupMethod(Generic[P, R]):
    """A worker method bound to a group; calling it runs the method on the group's ranks. Its type parameters are
    the group call's arguments and result (``workers/roles/handles.py`` declares them per role), which the dispatch
    mode derives from the worker method's: ``ONE_TO_ALL`` returns a list of the ranks' results, a DataProto mode
    the collected DataProto."""

    def __init__(self, group, name: str, remote_name: str, spec: MethodSpec, mode: DispatchMode, **options):
        self._group = group
        self.name, self.remote_name, self.spec, self.mode = name, remote_name, spec, mode
        self.blocking = options.get("blocking", spec.blocking)
        self.timeout_s = options.get("timeout_s", spec.timeout_s)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._group._call(self, args, kwargs)

    def with_options(self, *, timeout_s=_UNSET, blocking=_UNSET) -> GroupMethod[P, Any]:
        """The same method with another timeout and/or blocking behaviour for the calls made through it (the
        result is a future when ``blocking=False``)."""
        return GroupMethod(
            self._group,
            self.name,
            self.remote_name,
            self.spec,
            self.mode,
            timeout_s=self.timeout_s if timeout_s is _UNSET else timeout_s,
            blocking=self.blocking if blocking is _UNSET else blocking,
        )

    def __repr__(self) -> str:
        return f"<group method {self._group.name}.{self.name} mode={self.mode.name} blocking={self.blocking}>"


def _resolve_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def resolve(v):
        return v.get() if isinstance(v, DataProtoFuture) else v

    return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}


def _resolve_methods(cls: type) -> dict[str, tuple[MethodSpec, DispatchMode]]:
    """Registered methods of ``cls`` with their dispatch modes, checked before any actor starts."""
    out = {}
    for name, spec in registered_methods(cls).items():
        if hasattr(RayWorkerGroup, name) or name in _INSTANCE_ATTRS:
            raise AttributeError(f"{cls.__name__}.{name} clashes with a RayWorkerGroup attribute; rename it")
        try:
            mode = get_dispatch_mode(spec.dispatch_mode)
        except KeyError as err:
            raise KeyError(f"{cls.__name__}.{name}: {err.args[0]}") from None
        if mode.chunked and spec.execute_mode is not Execute.ALL:
            raise ValueError(f"{cls.__name__}.{name}: dispatch mode {mode.name!r} needs Execute.ALL")
        out[name] = (spec, mode)
    return out


class RayWorkerGroup:
    def __init__(
        self,
        resource_pool: ResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        actor_options: dict | None = None,
        call_timeout_per_row_s: float = 0.0,
        chunks_by_value: bool = True,
        wait: bool = True,
    ):
        """``call_timeout_s`` (None: no limit) + ``call_timeout_per_row_s`` per row of a call's DataProto
        arguments bounds every call whose method sets no ``timeout_s`` of its own. With ``chunks_by_value``
        (default) the DataProto chunks of the chunking modes travel inside the calls instead of one ``ray.put``
        per chunk (``controller.dispatch.ship_chunk``: Ray inlines small ones and puts big ones itself, so it is
        never slower, and 1.6-2.2x faster on small batches: benchmarks/bench_dispatch.py).

        ``wait=False`` returns once the actors are created, before their constructors finish: start several
        groups so, then ``RayWorkerGroup.wait_ready(groups)``, and their processes start (import torch, build
        what their constructors build) at the same time instead of one group after the other."""
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError(f"expected RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}")
        name = name_prefix or ray_cls_with_init.cls.__name__
        worker_classes = getattr(ray_cls_with_init.cls, COLOCATED_ROLES_ATTR, {}).values()
        for cls in [ray_cls_with_init.cls, *worker_classes]:
            _resolve_methods(cls)  # bad registrations fail here, before any actor starts
        # Placement groups are created (capacity checked, with a timeout) before any actor starts.
        slots = resource_pool.bundle_slots()
        actors, master = self._start_actors(
            name, resource_pool, slots, ray_cls_with_init, start_timeout_s, actor_options
        )
        timeouts = (call_timeout_s, call_timeout_per_row_s)
        self._setup(name, actors, ray_cls_with_init.cls, "", resource_pool, master, timeouts, chunks_by_value)
        self._start_timeout_s = start_timeout_s
        self._ready = [getattr(a, READY_METHOD).remote() for a in actors]  # emptied once the ranks answered
        if wait:
            RayWorkerGroup.wait_ready([self])

    @staticmethod
    def wait_ready(groups: list[RayWorkerGroup]) -> None:
        """Wait until every rank of ``groups`` (started with ``wait=False``) has run its constructor, within the
        longest of their start timeouts. A rank that fails or is late raises the error naming its group and
        rank, after every actor of the groups still starting is killed."""
        pending = [g for g in groups if g._ready]
        if not pending:
            return
        refs = [ref for g in pending for ref in g._ready]
        calls = [RankCall(g.name, "__init__", rank) for g in pending for rank in range(len(g._ready))]
        try:
            pids = wait_for_calls(refs, calls, max(g._start_timeout_s for g in pending))
        except BaseException:
            for g in pending:
                g.shutdown()
            raise
        for g in pending:
            g._pids[:], pids = pids[: len(g._ready)], pids[len(g._ready) :]  # shared with its spawned groups
            g._ready = []

    @classmethod
    def _from_actors(
        cls, name, actors, worker_cls, method_prefix, pool, master, timeouts, chunks_by_value
    ) -> RayWorkerGroup:
        group = cls.__new__(cls)
        group._setup(name, actors, worker_cls, method_prefix, pool, master, timeouts, chunks_by_value)
        return group

    @staticmethod
    def _start_actors(name, pool, slots, ray_cls, start_timeout_s, actor_options):
        remote_cls = ray.remote(ray_cls.cls)
        resources = pool.actor_resources()
        world_size = len(slots)

        def start(slot, master_addr: str, master_port: str):
            env = {
                "RANK": str(slot.rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(slot.local_rank),
                "LOCAL_WORLD_SIZE": str(slot.local_world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": master_port,
                "HYFLOW_WORKER_GROUP": name,
            }
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
            )
            options = {"scheduling_strategy": strategy, "runtime_env": {"env_vars": env}, **resources}
            options.update(actor_options or {})
            return remote_cls.options(**options).remote(*ray_cls.args, **ray_cls.kwargs)

        # The port is picked on rank 0's node before any actor starts: every rank gets it in its
        # environment, and a constructor that joins torch.distributed does not wait on unstarted peers.
        probe = ray.remote(master_probe()).options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slots[0].placement_group, placement_group_bundle_index=slots[0].bundle_index
            ),
        )
        master = tuple(ray.get(probe.remote(), timeout=start_timeout_s))
        actors = []
        try:
            actors += [start(slot, master[0], str(master[1])) for slot in slots]
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return actors, master

    def _setup(
        self, name, actors, worker_cls, method_prefix, pool, master, timeouts, chunks_by_value
    ) -> None:
        self.name = name
        self._actors = list(actors)
        self._worker_cls = worker_cls
        self._method_prefix = method_prefix
        self.resource_pool = pool
        self.master_addr, self.master_port = master
        self.call_timeout_s, self.call_timeout_per_row_s = timeouts
        self.chunks_by_value = chunks_by_value
        self._mesh_info: dict[str, list[tuple[int, bool]]] = {}
        self._ready = []  # constructor calls not yet waited for (a group started with wait=False)
        self._pids: list[int] = []  # each rank's process id, once its constructor answered
        # every role its processes hold: a colocated class's roles, else its own name (spawn sets its roles')
        self._process_roles = sorted(getattr(worker_cls, COLOCATED_ROLES_ATTR, None) or [name])
        self._bind_methods()

    def _bind_methods(self) -> None:
        for name, (spec, mode) in _resolve_methods(self._worker_cls).items():
            setattr(self, name, GroupMethod(self, name, self._method_prefix + name, spec, mode))

    def _default_timeout(self, args: tuple, kwargs: dict) -> float | None:
        """The group's limit for a call, scaled to its work: base + per-row time x rows of its batches."""
        if self.call_timeout_s is None:
            return None
        rows = sum(len(v) for v in (*args, *kwargs.values()) if isinstance(v, DataProto))
        return self.call_timeout_s + self.call_timeout_per_row_s * rows

    # ------------------------------------------------------------------ group facts
    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        return list(self._actors)

    @property
    def pids(self) -> list[int]:
        """Each rank's process id on its node (what a debugger, a profiler or a fault-injection test attaches
        to); empty until the group is ready."""
        return list(self._pids)

    def process_of(self, rank: int) -> str:
        """Rank ``rank``'s process as a fault report names it: its pid, its pool and every role it held."""
        pid = f"pid {self._pids[rank]}, " if rank < len(self._pids) else ""
        roles = ", ".join(repr(r) for r in self._process_roles)
        held = f"the roles {roles}" if len(self._process_roles) > 1 else f"the role {roles}"
        return f"its process ({pid}pool {self.resource_pool.name!r}) held {held}"

    def shares_processes_with(self, other: RayWorkerGroup) -> bool:
        """Whether both groups run on the same actors (roles spawned from one colocated group)."""
        return self._actors == other._actors

    def method_names(self) -> list[str]:
        return sorted(registered_methods(self._worker_cls))

    def dispatch_info(self, mesh_name: str) -> list[tuple[int, bool]]:
        """(dp_rank, is_collect) of every rank on ``mesh_name``, queried once from the workers."""
        if mesh_name not in self._mesh_info:
            refs = [
                getattr(a, self._method_prefix + DISPATCH_INFO_METHOD).remote(mesh_name) for a in self._actors
            ]
            info = wait_for_results(
                refs, list(range(self.world_size)), self.name, DISPATCH_INFO_METHOD, self.call_timeout_s
            )
            missing = [rank for rank, item in enumerate(info) if item is None]
            if missing:
                raise ValueError(
                    f"rank(s) {missing} registered no dispatch info for mesh {mesh_name!r}; call "
                    f"self.register_dispatch_collect_info({mesh_name!r}, dp_rank, is_collect) in the worker first"
                )
            self._mesh_info[mesh_name] = [(int(dp), bool(c)) for dp, c in info]
        return self._mesh_info[mesh_name]

    # ------------------------------------------------------------------ calls
    def _call(self, gm: GroupMethod, args: tuple, kwargs: dict):
        started = time.perf_counter()
        mode = gm.mode
        if not mode.accepts_futures:
            args, kwargs = _resolve_futures(args, kwargs)
        if gm.spec.inputs is not None:
            args, kwargs = gm.spec.inputs.select_args(args, kwargs)
        try:
            dispatched = normalize_dispatched(mode.dispatch_fn(self, *args, **kwargs), self, mode.name)
        except (TypeError, ValueError, KeyError) as err:
            msg = err.args[0] if err.args else repr(err)
            raise DispatchError(
                f"worker group {self.name!r} method {gm.name!r} ({mode.name}): {msg}"
            ) from err
        ranks = [0] if gm.spec.execute_mode is Execute.RANK_ZERO else list(range(self.world_size))
        refs = []
        for rank in ranks:
            remote_method = getattr(self._actors[rank], gm.remote_name)
            rank_args = [values[rank] for values in dispatched.args]
            rank_kwargs = {k: values[rank] for k, values in dispatched.kwargs.items()}
            refs.append(remote_method.remote(*rank_args, **rank_kwargs))
        future = DataProtoFuture(
            self.name,
            gm.name,
            refs,
            ranks,
            collect=partial(mode.collect, self),
            pad_size=dispatched.pad_size,
            chunk_positions=mode.chunk_ranks_fn(self) if mode.chunk_ranks_fn is not None else None,
            timeout_s=gm.timeout_s if gm.timeout_s is not None else self._default_timeout(args, kwargs),
            started=started,
            process_of=self.process_of,
        )
        return future if not gm.blocking else future.get()

    def call_rank(self, rank: int, method: str, *args, **kwargs) -> DataProtoFuture:
        """Call registered ``method`` on one rank with the arguments as that rank takes them (no dispatch,
        no collect): what a controller that keeps every rank busy on its own work uses (asynchronous rollout
        streams). Never blocks; the future's ``get()`` is that rank's result, and its errors and timeout are
        the group's (naming the role, method and rank)."""
        gm = getattr(self, method, None)
        if not isinstance(gm, GroupMethod):
            raise AttributeError(f"worker group {self.name!r} has no registered method {method!r}")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"worker group {self.name!r} has ranks 0..{self.world_size - 1}, not {rank}")
        started = time.perf_counter()
        if gm.spec.inputs is not None:
            args, kwargs = gm.spec.inputs.select_args(args, kwargs)
        ref = getattr(self._actors[rank], gm.remote_name).remote(*args, **kwargs)
        timeout = gm.timeout_s if gm.timeout_s is not None else self._default_timeout(args, kwargs)
        return DataProtoFuture(
            self.name,
            method,
            [ref],
            [rank],
            collect=lambda outs: outs[0],
            timeout_s=timeout,
            started=started,
            process_of=self.process_of,
        )

    # ------------------------------------------------------------------ colocated roles
    def spawn(self, prefix_set) -> dict[str, RayWorkerGroup]:
        """One group per colocated role, all sharing this group's actors (and processes)."""
        roles = getattr(self._worker_cls, COLOCATED_ROLES_ATTR, None)
        if roles is None:
            raise TypeError(
                f"worker group {self.name!r} runs {self._worker_cls.__name__}, not a colocated class; "
                "build one with create_colocated_worker_cls"
            )
        unknown = sorted(set(prefix_set) - set(roles))
        if unknown:
            raise KeyError(f"worker group {self.name!r} has no role(s) {unknown}; roles: {sorted(roles)}")
        groups = {
            role: RayWorkerGroup._from_actors(
                role,
                self._actors,
                roles[role],
                role_prefix(role),
                self.resource_pool,
                (self.master_addr, self.master_port),
                (self.call_timeout_s, self.call_timeout_per_row_s),
                self.chunks_by_value,
            )
            for role in prefix_set
        }
        for group in groups.values():
            group._pids = self._pids  # the same processes (filled in by wait_ready if not yet)
            group._process_roles = sorted(roles)
        return groups

    def shutdown(self) -> None:
        """Kill the group's actors (groups spawned from the same actors lose them too)."""
        for actor in self._actors:
            ray.kill(actor)

    def __repr__(self) -> str:
        return (
            f"RayWorkerGroup(name={self.name!r}, world_size={self.world_size}, "
            f"worker={self._worker_cls.__name__}, methods={self.method_names()})"
        )
