"""Rule scorers for the arithmetic task generators (``recipes.tasks``), registered by data source.

Each returns 1.0 for a correct final answer and 0.0 otherwise (no partial credit for format: the SFT warm
start teaches the format):

- ``hyflow/arithmetic``: the last ``\\boxed{...}`` holds an integer equal to ``ground_truth``
  (a string such as ``"10"``; surrounding spaces ignored, a leading ``+`` or ``-`` allowed).
- ``hyflow/countdown``: the last ``\\boxed{...}`` holds an expression over ``+ - * /`` and
  parentheses that uses exactly the multiset ``ground_truth["numbers"]`` and evaluates to
  ``ground_truth["target"]``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from workers.reward.expr import ExprError, evaluate_tokens, tokenize
from workers.reward.scorers import extract_boxed, register_scorer

ARITHMETIC = "hyflow/arithmetic"
COUNTDOWN = "hyflow/countdown"

_INT_RE = re.compile(r"[+-]?\d{1,30}")


@register_scorer(ARITHMETIC)
def score_arithmetic(solution_str: str, ground_truth: Any, extra_info=None) -> float:
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


@register_scorer(COUNTDOWN)
def score_countdown(solution_str: str, ground_truth: Any, extra_info=None) -> float:
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
