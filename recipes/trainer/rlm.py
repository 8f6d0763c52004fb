"""The RLM pieces of ``recipes/rlm.py``: the config schema and its check.

* ``RLMConfig``: the quickstart's sections (``sft`` included) plus ``env`` (``workers.rlm.env_loop.RLMEnvConfig``:
  agent limits, sandbox).

The env workers, their ``generate_sequences`` (what ``roles.generate`` calls) and the warm-start replay
(``reference_batch``) are the agent layer's (``workers.agents``), run with ``env.loop: rlm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.config import SCHEMAS, QuickstartConfig
from workers.rlm.env_loop import RLMEnvConfig

__all__ = [
    "RLMConfig",
    "register_schema",
]


@dataclass
class RLMConfig(QuickstartConfig):
    env: RLMEnvConfig = field(default_factory=RLMEnvConfig)


def register_schema() -> None:
    """Make ``parse_args("rlm")`` / ``load_config("rlm")`` know ``RLMConfig`` (no edit to recipes/config.py)."""
    SCHEMAS.setdefault("rlm", RLMConfig)


def check(cfg: RLMConfig) -> None:
    from recipes.config import ConfigError

    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("recipes.rlm has no critic: algorithm.adv_estimator must not be gae")
