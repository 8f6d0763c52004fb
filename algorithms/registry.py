"""Name registries: advantage estimators, policy losses, rollout corrections (other modules add entries).

Names and semantics follow verl's ``core_algos`` so recipes port over unchanged::

    @register_adv_est("hybrid")            # or an AdvantageEstimator member
    def compute_hybrid_advantage(token_level_rewards, response_mask, ...): ...

    fn = get_adv_estimator_fn("hybrid")

Registering a *different* function under a name that is already taken raises ``ValueError``
(re-registering the same function, e.g. on module reload, is allowed); pass ``override=True`` to
replace an entry on purpose. Looking up an unknown name raises ``ValueError`` that lists the
registered names.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, StrEnum
from typing import Any, TypeVar

__all__ = [
    "AdvantageEstimator",
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "register_adv_est",
    "get_adv_estimator_fn",
    "list_adv_estimators",
    "register_policy_loss",
    "get_policy_loss_fn",
    "ROLLOUT_CORRECTION_REGISTRY",
    "register_rollout_correction",
    "get_rollout_correction_fn",
    "list_rollout_corrections",
]

F = TypeVar("F", bound=Callable[..., Any])


class AdvantageEstimator(StrEnum):
    """Names of the built-in advantage estimators (a convenience; any string may be registered)."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., Any]] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable[..., Any]] = {}
ROLLOUT_CORRECTION_REGISTRY: dict[str, Callable[..., Any]] = {}


def _name_of(name_or_enum: str | Enum, what: str) -> str:
    if isinstance(name_or_enum, Enum):
        name_or_enum = name_or_enum.value
    if not isinstance(name_or_enum, str) or not name_or_enum:
        raise TypeError(f"{what} name must be a non-empty str or Enum member, got {name_or_enum!r}")
    return name_or_enum


def _register(registry: dict, name_or_enum: str | Enum, what: str, override: bool) -> Callable[[F], F]:
    name = _name_of(name_or_enum, what)

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"{what} {name!r}: registered object must be callable, got {fn!r}")
        old = registry.get(name)
        if old is not None and old is not fn and not override:
            raise ValueError(
                f"{what} {name!r} is already registered to {old.__module__}.{old.__qualname__}; "
                f"pass override=True to replace it"
            )
        registry[name] = fn
        return fn

    return decorator


def _lookup(registry: dict, name_or_enum: str | Enum, what: str) -> Callable[..., Any]:
    name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(registry)}") from None


def register_adv_est(name_or_enum: str | AdvantageEstimator, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering an advantage estimator under ``name_or_enum``."""
    return _register(ADV_ESTIMATOR_REGISTRY, name_or_enum, "advantage estimator", override)


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable[..., Any]:
    """The advantage estimator registered under ``name_or_enum`` (``ValueError`` listing names if none)."""
    return _lookup(ADV_ESTIMATOR_REGISTRY, name_or_enum, "advantage estimator")


def list_adv_estimators() -> list[str]:
    return sorted(ADV_ESTIMATOR_REGISTRY)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering a policy loss under ``name`` (see ``policy_loss`` for the call signature)."""
    return _register(POLICY_LOSS_REGISTRY, name, "policy loss", override)


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    """The policy loss registered under ``name`` (``ValueError`` listing names if none)."""
    return _lookup(POLICY_LOSS_REGISTRY, name, "policy loss")


def register_rollout_correction(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering an off-policy rollout correction under ``name`` (signature: ``off_policy``)."""
    return _register(ROLLOUT_CORRECTION_REGISTRY, name, "rollout correction", override)


def get_rollout_correction_fn(name: str) -> Callable[..., Any]:
    """The rollout correction registered under ``name`` (``ValueError`` listing names if none)."""
    return _lookup(ROLLOUT_CORRECTION_REGISTRY, name, "rollout correction")


def list_rollout_corrections() -> list[str]:
    return sorted(ROLLOUT_CORRECTION_REGISTRY)
