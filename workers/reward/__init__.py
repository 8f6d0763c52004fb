"""Rule-based reward scorers registered by data_source, and the batched scoring they feed."""

from workers.reward import long_context  # noqa: F401  (registers the long-context RLM task scorers)
from workers.reward.scorers import (
    SCORERS,
    ScoreResult,
    extract_boxed,
    get_scorer,
    register_scorer,
    score_batch,
)

__all__ = ["SCORERS", "ScoreResult", "extract_boxed", "get_scorer", "register_scorer", "score_batch"]
