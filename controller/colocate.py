"""Colocated roles: one actor per bundle whose process holds one worker instance per role.

``create_colocated_worker_cls({"actor": RayClassWithInitArgs(A), "ref": RayClassWithInitArgs(B)})``
builds a Worker class whose constructor instantiates every role and whose methods ``<role>__<method>``
forward to that role's instance. ``RayWorkerGroup.spawn`` then gives each role its own group object
bound to its prefixed methods, all sharing the same actors (and so the same processes and memory).

Roles that must share an object in process say so in their constructor arguments: ``Shared("actor")`` as an
argument value is replaced, in the worker process, by the ``actor`` role's instance, e.g. the rollout role of
the colocated placement reads its weights from the trainer it shares the process with::

    create_colocated_worker_cls({
        "actor": RayClassWithInitArgs(ActorWorker, model, actor, rollout),
        "rollout": RayClassWithInitArgs(RolloutWorker, model, rollout, trainer=Shared("actor")),
    })

A shared role must come earlier in the mapping (roles are built, and ``init_model`` is called, in order).
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.decorator import registered_methods
from controller.ray_class import RayClassWithInitArgs
from controller.worker import DISPATCH_INFO_METHOD, Worker

# Class attribute of a colocated worker class: {role: role worker class}.
COLOCATED_ROLES_ATTR = "_hyflow_colocated_roles"


@dataclass(frozen=True)
class Shared:
    """A constructor argument that is another colocated role's instance in the same process."""

    role: str


def role_prefix(role: str) -> str:
    return f"{role}__"


def shared_roles(spec: RayClassWithInitArgs) -> dict[str, str]:
    """``{argument: role}`` for the `Shared` arguments of ``spec`` (positional ones keyed by index)."""
    named = {str(i): a.role for i, a in enumerate(spec.args) if isinstance(a, Shared)}
    return named | {k: v.role for k, v in spec.kwargs.items() if isinstance(v, Shared)}


def _forwarder(role: str, name: str):
    def forward(self, *args, **kwargs):
        return getattr(self._role_workers[role], name)(*args, **kwargs)

    forward.__name__ = role_prefix(role) + name
    return forward


def _check_shares(specs: dict[str, RayClassWithInitArgs]) -> None:
    built: list[str] = []
    for role, spec in specs.items():
        for arg, other in shared_roles(spec).items():
            if other not in built:
                where = "comes later" if other in specs else f"is not in this pool (roles: {list(specs)})"
                raise ValueError(
                    f"role {role!r} ({spec.cls.__name__}, argument {arg}) shares role {other!r}, which {where}: "
                    "a shared role must be built first"
                )
        built.append(role)


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or "__" in role:
            raise ValueError(f"colocated role name must be an identifier without '__', got {role!r}")
        if not isinstance(spec, RayClassWithInitArgs):
            raise TypeError(f"role {role!r}: expected RayClassWithInitArgs, got {type(spec).__name__}")
    specs = dict(class_dict)
    _check_shares(specs)

    class ColocatedWorker(Worker):
        def __init__(self):
            # Roles are built in the order given; each reads the same RANK/MASTER_* environment.
            self._role_workers: dict[str, Worker] = {}
            for role, s in specs.items():
                args = [self._resolve(a) for a in s.args]
                kwargs = {k: self._resolve(v) for k, v in s.kwargs.items()}
                self._role_workers[role] = s.cls(*args, **kwargs)

        def _resolve(self, value):
            return self._role_workers[value.role] if isinstance(value, Shared) else value

    for role, spec in specs.items():
        for name in [*registered_methods(spec.cls), DISPATCH_INFO_METHOD]:
            setattr(ColocatedWorker, role_prefix(role) + name, _forwarder(role, name))
    setattr(ColocatedWorker, COLOCATED_ROLES_ATTR, {role: s.cls for role, s in specs.items()})
    ColocatedWorker.__name__ = "Colocated_" + "_".join(specs)
    return RayClassWithInitArgs(ColocatedWorker)
