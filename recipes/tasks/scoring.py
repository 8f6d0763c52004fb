"""Reference rule scorers for the task generators, in verl's ``compute_score`` signature.

``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`` returns 1.0 for a
correct final answer and 0.0 otherwise (no partial credit for format: the SFT warm start teaches the
format). The reward worker's own rule registry may use these or re-implement the rules; what it must
match is the data_source names in ``DATA_SOURCES`` and these rules:

- ``hyflow/arithmetic``: the last ``\\boxed{...}`` holds an integer equal to ``ground_truth``
  (a string such as ``"10"``; surrounding spaces ignored, a leading ``+`` or ``-`` allowed).
- ``hyflow/countdown``: the last ``\\boxed{...}`` holds an expression over ``+ - * /`` and
  parentheses that uses exactly the multiset ``ground_truth["numbers"]`` and evaluates to
  ``ground_truth["target"]``.
- ``hyflow/sniah``, ``hyflow/oolong``, ``hyflow/oolong_pairs`` (``recipes.tasks.long_context``):
  ``solution_str`` is the RLM's final answer string; the rules (exact match, ``0.75 ** |error|``,
  pair F1) live in ``workers.reward.long_context``, which the reward worker registers itself.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from recipes.tasks.expr import ExprError, evaluate_tokens, extract_boxed, tokenize
from workers.reward.long_context import (
    LONG_CONTEXT_DATA_SOURCES,
    OOLONG,
    OOLONG_PAIRS,
    SNIAH,
    score_oolong,
    score_oolong_pairs,
    score_sniah,
)

ARITHMETIC = "hyflow/arithmetic"
COUNTDOWN = "hyflow/countdown"
DATA_SOURCES = (ARITHMETIC, COUNTDOWN, *LONG_CONTEXT_DATA_SOURCES)

_INT_RE = re.compile(r"[+-]?\d{1,30}")


def score_arithmetic(solution_str: str, ground_truth: Any) -> float:
    ans = extract_boxed(solution_str)
    if ans is None:
        return 0.0
    ans = ans.strip()
    if not _INT_RE.fullmatch(ans):
        return 0.0
    try:
        return float(int(ans) == int(str(ground_truth).strip()))
    except ValueError:
        return 0.0


def score_countdown(solution_str: str, ground_truth: Any) -> float:
    ans = extract_boxed(solution_str)
    if ans is None:
        return 0.0
    try:
        toks = tokenize(ans)
        used = Counter(t for t in toks if isinstance(t, int))
        if used != Counter(int(n) for n in ground_truth["numbers"]):
            return 0.0
        return float(evaluate_tokens(toks, allow_unary_minus=False) == int(ground_truth["target"]))
    except (ExprError, KeyError, TypeError, ValueError):
        return 0.0


_SCORERS = {
    ARITHMETIC: score_arithmetic,
    COUNTDOWN: score_countdown,
    SNIAH: score_sniah,
    OOLONG: score_oolong,
    OOLONG_PAIRS: score_oolong_pairs,
}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    try:
        scorer = _SCORERS[data_source]
    except KeyError:
        raise NotImplementedError(f"no rule scorer for data_source {data_source!r}") from None
    return scorer(solution_str, ground_truth)
