r"""What the process reward model is asked, and how its answers are read.

* :func:`judge_prompt`: one step of a tool trajectory -- the problem, the earlier steps (history), the
  step's action and the observation it got -- and the question whether the step helps, answered with
  ``\boxed{1}`` (helps) or ``\boxed{-1}`` (hurts). :func:`parse_vote` reads the last ``\boxed{}``:
  1 / +1 -> 1, -1 -> -1, anything else (no box, other text) -> 0 ("unparseable").
* :func:`hint_prompt`: after the trajectory ends, a short "bridge thought" -- a hindsight hint, written
  from the tool feedback, that would have led to the right path -- between ``<hint>`` and ``</hint>``,
  or ``NO_INTERVENTION`` when none is needed. :func:`parse_hint` returns the text between the first
  complete pair of markers, or None (the "no intervention" marker, no markers, or an empty hint).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "HINT_CLOSE",
    "HINT_OPEN",
    "NO_INTERVENTION",
    "hint_prompt",
    "judge_prompt",
    "parse_hint",
    "parse_vote",
]

HINT_OPEN, HINT_CLOSE = "<hint>", "</hint>"
NO_INTERVENTION = "NO_INTERVENTION"
_HINT = re.compile(re.escape(HINT_OPEN) + r"(.*?)" + re.escape(HINT_CLOSE), re.S)


def _cut(text: str, n: int) -> str:
    text = (text or "").strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def _history(steps: Sequence[Mapping], max_chars: int) -> str:
    if not steps:
        return "(none)"
    lines = []
    for i, s in enumerate(steps, 1):
        lines.append(f"Step {i}: {_cut(s.get('action', ''), max_chars)}")
        if s.get("observation"):
            lines.append(f"Result {i}: {_cut(s['observation'], max_chars)}")
    return "\n".join(lines)


def judge_prompt(problem: str, history: Sequence[Mapping], step: Mapping, max_chars: int = 300) -> str:
    """The PRM question for ``step`` given the steps before it (``history``)."""
    return (
        f"Problem: {_cut(problem, 4 * max_chars)}\n"
        f"Earlier steps:\n{_history(history, max_chars)}\n"
        f"Current step: {_cut(step.get('action', ''), max_chars)}\n"
        f"Result: {_cut(step.get('observation', '') or '(the final answer)', max_chars)}\n"
        "Does the current step move toward the correct answer? Answer \\boxed{1} for yes or \\boxed{-1} for no."
    )


def hint_prompt(problem: str, steps: Sequence[Mapping], outcome: float | None, max_chars: int = 300) -> str:
    """The bridge-thought request for a finished trajectory (``outcome``: its score, when known)."""
    verdict = "" if outcome is None else f"The final answer was {'correct' if outcome >= 1 else 'wrong'}.\n"
    return (
        f"Problem: {_cut(problem, 4 * max_chars)}\n"
        f"Attempt:\n{_history(steps, max_chars)}\n{verdict}"
        f"Using the tool feedback, write one short hint that would have led to the correct answer, between "
        f"{HINT_OPEN} and {HINT_CLOSE}. If no hint is needed, write {NO_INTERVENTION}."
    )


def parse_vote(text: str) -> int:
    """+1 / -1 from the last ``\\boxed{}`` of ``text``; 0 when there is none or it holds anything else."""
    text = text or ""
    start = text.rfind("\\boxed{")
    if start < 0:
        return 0
    end = text.find("}", start)
    if end < 0:
        return 0
    inner = text[start + len("\\boxed{") : end].strip()
    return {"1": 1, "+1": 1, "-1": -1}.get(inner, 0)


def parse_hint(text: str, max_chars: int = 400) -> str | None:
    """The bridge thought between the first complete ``<hint>...</hint>`` pair (stripped, at most
    ``max_chars``), or None for "no intervention": no pair, an empty hint, or the ``NO_INTERVENTION`` marker."""
    m = _HINT.search(text or "")
    if m is None:
        return None
    hint = m.group(1).strip()
    if not hint or NO_INTERVENTION in hint:
        return None
    return hint[:max_chars]
