"""Rule-based reward scorers registered by data_source, and the batched scoring they feed.

One module per task family registers its scorers on import: ``scorers`` (generic ``exact_match``, ``numeric``,
``math``), ``arithmetic`` (``hyflow/arithmetic``, ``hyflow/countdown``), ``long_context`` (the RLM tasks
``hyflow/sniah``, ``hyflow/oolong``, ``hyflow/oolong_pairs``).
"""

from workers.reward import arithmetic, long_context  # noqa: F401  (register the task families' scorers)
from workers.reward.scorers import (
    SCORERS,
    ScoreResult,
    compute_score,
    extract_boxed,
    get_scorer,
    load_custom_scorer,
    register_scorer,
    score_batch,
)

__all__ = [
    "SCORERS",
    "ScoreResult",
    "compute_score",
    "extract_boxed",
    "get_scorer",
    "load_custom_scorer",
    "register_scorer",
    "score_batch",
]
