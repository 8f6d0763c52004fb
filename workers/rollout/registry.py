"""``rollout.name`` -> the engine class: a registered name or ``"package.module:Class"`` (see `workers.plugins`).

Registered engines are imported on first use, so choosing ``native`` never imports SGLang's adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.plugins import load_plugin
from workers.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from workers.config import ModelConfig, RolloutConfig

ROLLOUT_ENGINES: dict[str, type[RolloutEngine] | str] = {
    "native": "workers.rollout.native:NativeEngine",
    "sglang": "workers.rollout.sglang:SGLangRollout",
}


def register_rollout_engine(name: str, cls: type[RolloutEngine]) -> None:
    """Make ``rollout.name=name`` build ``cls`` in this process (other processes: use ``"module:Class"``)."""
    ROLLOUT_ENGINES[name] = cls


def rollout_engine_class(name: str) -> type[RolloutEngine]:
    """The engine class ``rollout.name`` stands for; a ValueError listing the known names otherwise."""
    # load_plugin only checks issubclass against the abstract base, never instantiates it (mypy#4717)
    return load_plugin(name, ROLLOUT_ENGINES, RolloutEngine, "rollout.name", "rollout engine")  # type: ignore[type-abstract]


def build_rollout_engine(
    model: ModelConfig, rollout: RolloutConfig, tokenizer: Any, *, rank: int = 0, tp_group=None
) -> RolloutEngine:
    """The rollout engine of one rank (`RolloutEngine.from_config` of ``rollout.name``'s class)."""
    cls = rollout_engine_class(rollout.name)
    if tp_group is not None and not cls.accepts_tp_group:
        raise ValueError(
            f"rollout.name={rollout.name!r}: {cls.__name__} cannot be a tensor-parallel replica over the "
            "trainer's ranks (rollout.tensor_model_parallel_size must be 1)"
        )
    return cls.from_config(model, rollout, tokenizer, rank=rank, tp_group=tp_group)
