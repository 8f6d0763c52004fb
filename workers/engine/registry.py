"""``<role>.strategy`` -> the training engine class: a registered name or ``"package.module:Class"`` (or
``"path/to/file.py:Class"``, see `workers.plugins`), checked against the `TrainEngine` contract.

A third engine is one file plus a config value (``actor.strategy=my_pkg.engine:MyEngine``, or a name given with
`register_train_engine`): the class declares its capabilities (`TrainEngine`'s ``ClassVar`` members) and
implements the contract's methods; the roles build it with `build_train_engine` and use it only through the
contract. Registered engines are imported on first use: choosing ``fsdp`` never imports the Megatron engine
(whose module imports megatron-core only when an engine is built)."""

from __future__ import annotations

from typing import Any, cast

from workers.engine.base import CAPABILITY_CONTRACTS, EngineConfig, MegatronConfig, TrainEngine
from workers.plugins import load_plugin

TRAIN_ENGINES: dict[str, type | str] = {
    "fsdp": "workers.engine.fsdp_engine:FSDPEngine",
    "megatron": "workers.engine.megatron.engine:MegatronEngine",
}


def _own_members(protocol: type) -> tuple[list[str], list[str], list[str]]:
    """(capabilities: ``ClassVar`` annotations, per-instance attributes: the other annotations and the
    properties, which an engine may also set on the instance; class members: methods and classmethods) that
    ``protocol`` itself declares, in order."""
    notes: dict[str, Any] = dict(vars(protocol).get("__annotations__", {}))
    capabilities = [n for n, t in notes.items() if str(t).startswith(("ClassVar", "typing.ClassVar"))]
    instance = [n for n in notes if n not in capabilities]
    instance += [n for n, v in vars(protocol).items() if isinstance(v, property)]
    methods = [
        n
        for n, v in vars(protocol).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, classmethod))
    ]
    return capabilities, instance, methods


def contract_members(cls: type) -> tuple[list[str], list[str], list[str]]:
    """(capabilities, instance attributes, class members) that an engine class ``cls`` must have: the
    `TrainEngine` contract's and, for each capability ``cls`` declares True, its protocol's
    (`CAPABILITY_CONTRACTS`)."""
    capabilities, instance, methods = _own_members(TrainEngine)
    for capability, protocol in CAPABILITY_CONTRACTS.items():
        if getattr(cls, capability, False) is True:
            _, more_instance, more_methods = _own_members(protocol)
            instance, methods = instance + more_instance, methods + more_methods
    return capabilities, instance, methods


def check_train_engine(cls: type, what: str) -> None:
    """A TypeError naming every member of the contract that the class ``cls`` lacks (``what``: the config value
    that chose it), and every capability it does not declare as a bool."""
    if not isinstance(cls, type):
        raise TypeError(f"training engine {what} is {cls!r}, not a class")
    capabilities, _, methods = contract_members(cls)
    missing = [m for m in methods if not hasattr(cls, m)]
    undeclared = [c for c in capabilities if not isinstance(getattr(cls, c, None), bool)]
    if missing or undeclared:
        parts = []
        if missing:
            parts.append(f"lacks {missing}")
        if undeclared:
            parts.append(f"does not declare the capabilities {undeclared} (class attributes, True or False)")
        raise TypeError(
            f"training engine {what}: {cls.__name__} {' and '.join(parts)} of the TrainEngine contract "
            "(workers/engine/base.py)"
        )


def register_train_engine(name: str, cls: type) -> None:
    """Make ``<role>.strategy=name`` build ``cls`` in this process (other processes, e.g. Ray workers: use
    ``"module:Class"``); the class is checked against the contract first."""
    check_train_engine(cls, f"strategy={name!r}")
    TRAIN_ENGINES[name] = cls


def train_engine_class(strategy: str, key: str = "actor.strategy") -> type[TrainEngine]:
    """The engine class ``strategy`` (the value of config key ``key``) stands for: a ValueError listing the
    known names for an unknown one, a TypeError naming what a class lacks of the contract."""
    cls = load_plugin(strategy, TRAIN_ENGINES, object, key, "training engine")
    check_train_engine(cls, f"{key}={strategy!r}")
    return cast("type[TrainEngine]", cls)


def build_train_engine(
    config: EngineConfig,
    strategy: str = "fsdp",
    parallel: MegatronConfig | None = None,
    *,
    key: str = "actor.strategy",
) -> TrainEngine:
    """The training engine of this rank for ``strategy`` (``parallel``: the role's model-parallel sizes,
    ``<role>.megatron``), after joining the role's process group; the built instance is checked for the
    contract's per-instance attributes too."""
    cls = train_engine_class(strategy, key)
    engine = cls.from_config(config, parallel or MegatronConfig())
    _, instance, _ = contract_members(cls)
    missing = [a for a in instance if not hasattr(engine, a)]
    if missing:
        raise TypeError(
            f"training engine {key}={strategy!r}: {cls.__name__}.from_config built an engine without {missing} "
            "of the TrainEngine contract (workers/engine/base.py)"
        )
    return engine


__all__ = [
    "TRAIN_ENGINES",
    "build_train_engine",
    "check_train_engine",
    "contract_members",
    "register_train_engine",
    "train_engine_class",
]
