"""Rule scorers for the long-context RLM tasks, registered by data source.

The ``solution_str`` these scorers receive is the RLM's final answer string (what ``FINAL`` /
``FINAL_VAR`` returned), not a chain of thought with a ``\\boxed{}``; a missing answer is ``""``
or None and scores 0.

- ``hyflow/sniah`` (single needle in a haystack): exact match after normalisation (surrounding
  whitespace, quotes, backticks, ``*`` and one trailing period removed, case and inner whitespace
  folded). ``"1234567"`` and ``'"1234567".'`` match; ``"The number is 1234567"`` does not.
- ``hyflow/oolong`` (aggregation over labelled lines): a ground truth that is an integer string is
  numeric and scores ``0.75 ** abs(answer - truth)``; the answer is the whole normalised answer
  parsed as a number (thousands separators allowed), or else the single integer it contains (no
  number, or several: 0). Any other ground truth is categorical: exact match after normalisation,
  an optional leading ``label:`` / ``answer:`` ignored.
- ``hyflow/oolong_pairs``: F1 between the set of unordered pairs in the answer (see
  :func:`parse_pairs`) and the ground-truth pairs; both empty scores 1 (an empty answer string
  scores 0: no answer was given).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable

from workers.reward.scorers import parse_number, register_scorer

SNIAH = "hyflow/sniah"
OOLONG = "hyflow/oolong"
OOLONG_PAIRS = "hyflow/oolong_pairs"
LONG_CONTEXT_DATA_SOURCES = (SNIAH, OOLONG, OOLONG_PAIRS)
NUMERIC_BASE = 0.75

__all__ = [
    "LONG_CONTEXT_DATA_SOURCES",
    "NUMERIC_BASE",
    "OOLONG",
    "OOLONG_PAIRS",
    "SNIAH",
    "normalise_answer",
    "pair_f1",
    "parse_pairs",
    "score_oolong",
    "score_oolong_pairs",
    "score_sniah",
]

_INT_RE = re.compile(r"^[-+]?\d+$")
_NUM_IN_TEXT = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?!\w)")


def normalise_answer(text: object) -> str:
    """Lower-cased, inner whitespace collapsed, wrapping quotes/backticks/asterisks and one trailing
    period removed."""
    s = re.sub(r"\s+", " ", "" if text is None else str(text)).strip()
    for _ in range(3):
        s = s.strip().strip("`*").strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
            s = s[1:-1]
        s = s.removesuffix(".")
    return s.strip().lower()


@register_scorer(SNIAH)
def score_sniah(solution_str: str, ground_truth, extra_info=None) -> float:
    return float(bool(solution_str) and normalise_answer(solution_str) == normalise_answer(ground_truth))


def _answer_number(text: str) -> float | None:
    s = normalise_answer(text)
    s = re.sub(r"^(answer|count|total)\s*[:=]\s*", "", s)
    value = parse_number(s)
    if value is not None:
        return value
    found = _NUM_IN_TEXT.findall(s)
    if len(found) == 1:
        return parse_number(found[0])
    return None


@register_scorer(OOLONG)
def score_oolong(solution_str: str, ground_truth, extra_info=None) -> float:
    truth = str(ground_truth).strip()
    if not solution_str:
        return 0.0
    if _INT_RE.match(truth):
        value = _answer_number(solution_str)
        if value is None:
            return 0.0
        return float(NUMERIC_BASE ** abs(value - int(truth)))
    answer = re.sub(r"^(label|answer)\s*:\s*", "", normalise_answer(solution_str))
    return float(normalise_answer(answer) == normalise_answer(truth))


_BRACKETED = re.compile(r"[(\[{<]\s*['\"]?(\d+)['\"]?\s*[,;]\s*['\"]?(\d+)['\"]?\s*[)\]}>]")
_JOINED = re.compile(r"(?<![\w.])(\d+)\s*(?:-|–|—|:|&|/|\band\b|\bwith\b|<->|<=>|->|\+|\|)\s*(\d+)(?![\w.])")
_INT_TOKEN = re.compile(r"(?<![\w.])\d+(?!\w|\.\d)")


def _canon(pairs: Iterable) -> set[tuple[int, int]]:
    out = set()
    for p in pairs:
        a, b = (int(x) for x in p)
        out.add((min(a, b), max(a, b)))
    return out


def parse_pairs(answer: object) -> set[tuple[int, int]]:
    """The unordered integer pairs in an answer, as ``{(low, high), ...}``.

    Tried in order, the first that finds any pair wins:

    1. a Python literal: a list/tuple/set of 2-element sequences (``[(1, 2), (3, 4)]``); a list or
       numpy array of pairs is accepted directly;
    2. bracketed pairs anywhere: ``(1, 2)``, ``[1,2]``, ``{1; 2}``, ``<1, 2>``;
    3. joined pairs anywhere: ``1-2``, ``1 & 2``, ``1 and 2``, ``1/2``, ``1:2``, ``1 -> 2``;
    4. lines holding exactly two integers: ``1, 2``, ``1 2``, ``user 1 with user 2``.
    """
    if answer is None:
        return set()
    if not isinstance(answer, str):
        if isinstance(answer, Iterable):
            try:
                return _canon(answer)  # an iterable of pairs (list, tuple, numpy array of rows)
            except (TypeError, ValueError):
                pass
        answer = str(answer)
    text = answer.strip()
    try:
        value = ast.literal_eval(text)
        if isinstance(value, list | tuple | set | frozenset) and all(
            isinstance(p, list | tuple) and len(p) == 2 for p in value
        ):
            return _canon(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    for finder in (_BRACKETED, _JOINED):
        found = finder.findall(text)
        if found:
            return _canon(found)
    lines = (_INT_TOKEN.findall(line) for line in text.splitlines())
    return _canon(nums for nums in lines if len(nums) == 2)


def pair_f1(predicted: set, gold: set) -> float:
    if not predicted and not gold:
        return 1.0
    hits = len(predicted & gold)
    if hits == 0:
        return 0.0
    precision, recall = hits / len(predicted), hits / len(gold)
    return 2 * precision * recall / (precision + recall)


@register_scorer(OOLONG_PAIRS)
def score_oolong_pairs(solution_str: str, ground_truth, extra_info=None) -> float:
    if solution_str is None or not str(solution_str).strip():
        return 0.0  # no answer at all (an explicit "[]" is an answer)
    return pair_f1(parse_pairs(solution_str), parse_pairs(ground_truth))
