"""Process reward model (PRM) worker: m model votes per tool-trajectory step (``\\boxed{1}`` / ``\\boxed{-1}``)
and hindsight "bridge thought" hints between ``<hint>`` markers, from a frozen checkpoint on the native
engine or an OpenAI-compatible HTTP endpoint. ``workers.prm.worker`` (PRMWorker, PRMConfig),
``workers.prm.scorers`` (EngineScorer, HTTPScorer), ``workers.prm.prompts`` (prompts and parsers)."""

from workers.prm.prompts import (
    HINT_CLOSE,
    HINT_OPEN,
    NO_INTERVENTION,
    hint_prompt,
    judge_prompt,
    parse_hint,
    parse_vote,
)
from workers.prm.worker import PRMConfig, PRMWorker

__all__ = [
    "HINT_CLOSE",
    "HINT_OPEN",
    "NO_INTERVENTION",
    "PRMConfig",
    "PRMWorker",
    "hint_prompt",
    "judge_prompt",
    "parse_hint",
    "parse_vote",
]
