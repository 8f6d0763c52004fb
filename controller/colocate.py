"""Colocated roles: one actor per bundle whose process holds one worker instance per role.

``create_colocated_worker_cls({"actor": RayClassWithInitArgs(A), "ref": RayClassWithInitArgs(B)})``
builds a Worker class whose constructor instantiates every role and whose methods ``<role>__<method>``
forward to that role's instance. ``RayWorkerGroup.spawn`` then gives each role its own group object
bound to its prefixed methods, all sharing the same actors (and so the same processes and memory).
"""

from __future__ import annotations

from controller.decorator import registered_methods
from controller.ray_class import RayClassWithInitArgs
from controller.worker import DISPATCH_INFO_METHOD, Worker

# Class attribute of a colocated worker class: {role: role worker class}.
COLOCATED_ROLES_ATTR = "_hyflow_colocated_roles"


def role_prefix(role: str) -> str:
    return f"{role}__"


def _forwarder(role: str, name: str):
    def forward(self, *args, **kwargs):
        return getattr(self._role_workers[role], name)(*args, **kwargs)

    forward.__name__ = role_prefix(role) + name
    return forward


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or "__" in role:
            raise ValueError(f"colocated role name must be an identifier without '__', got {role!r}")
        if not isinstance(spec, RayClassWithInitArgs):
            raise TypeError(f"role {role!r}: expected RayClassWithInitArgs, got {type(spec).__name__}")
    specs = dict(class_dict)

    class ColocatedWorker(Worker):
        def __init__(self):
            # Roles are built in the order given; each reads the same RANK/MASTER_* environment.
            self._role_workers = {role: s.cls(*s.args, **s.kwargs) for role, s in specs.items()}

    for role, spec in specs.items():
        for name in [*registered_methods(spec.cls), DISPATCH_INFO_METHOD]:
            setattr(ColocatedWorker, role_prefix(role) + name, _forwarder(role, name))
    setattr(ColocatedWorker, COLOCATED_ROLES_ATTR, {role: s.cls for role, s in specs.items()})
    ColocatedWorker.__name__ = "Colocated_" + "_".join(specs)
    return RayClassWithInitArgs(ColocatedWorker)
