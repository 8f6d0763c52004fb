r"""A rule-based hindsight judge for tool-math trajectories (``prm.scorer=rule``).

It stands in for a strong judge model -- the seed article's judge reads a failed trajectory in hindsight,
votes on each step and writes a "bridge thought" that would have led to the right answer -- at a scale where
no model we can run here judges reliably (the 1M-parameter reference never wrote a parseable vote). It reads
what such a judge would read: the problem, each step's action and the tool's observation, the verifier's
result and the ground truth, and it writes its hint the way a judge would write it, naming the failure it
sees and the call that fixes it.

Step votes (one judgement per step; the same for all m votes):

* a tool call whose output is the ground truth: +1; one that errors, times out, prints nothing or prints
  another number: -1;
* an answer equal to the ground truth (the verifier's rule, ``verify_boxed``): +1, else -1;
* a malformed turn: -1.

Bridge thoughts (only for a trajectory the verifier scored below 1; ``E`` is the problem's expression, ``G``
the ground truth), one per failure, the first failing step deciding:

* ``guess``: answered without running the tool -> "do not guess; run <python>print(E)</python>";
* ``tool_error`` / ``timeout`` / ``no_output``: the call failed -> the failure named, then the right call;
* ``wrong_value``: the code printed another number (numbers or operators changed) -> the right call;
* ``copy_slip``: the tool printed G but the answer differs -> "answer \boxed{G}";
* ``malformed``: neither a call nor an answer -> the right call;
* ``no_answer``: turns ran out -> "answer \boxed{G}" when the tool printed G, else the right call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from workers.math_env.protocol import verify_boxed
from workers.prm.prompts import HINT_CLOSE, HINT_OPEN, NO_INTERVENTION

__all__ = ["FAILURES", "HindsightJudge", "bridge_thought", "diagnose", "step_votes"]

FAILURES = (
    "guess",
    "tool_error",
    "timeout",
    "no_output",
    "wrong_value",
    "copy_slip",
    "malformed",
    "no_answer",
)
# the longest run of digits, spaces, parentheses and + - * / in the problem: its arithmetic expression
_EXPR = re.compile(r"[\d(][\d\s()+\-*/]*[\d)]")
_INT = re.compile(r"[+-]?\d+")


def problem_expression(problem: str) -> str:
    """The arithmetic expression of ``problem`` ("Compute 12 + 3 * 45." -> "12 + 3 * 45"), or "" if none."""
    found = [m.group(0).strip() for m in _EXPR.finditer(problem or "")]
    return max(found, key=len, default="")


def _printed(observation: str) -> str | None:
    """The tool's printed value when it printed exactly one integer (``Output:\\n<n>``), else None."""
    text = observation or ""
    if not text.startswith("Output:"):
        return None
    lines = [ln.strip() for ln in text[len("Output:") :].strip().splitlines() if ln.strip()]
    return lines[-1] if lines and _INT.fullmatch(lines[-1]) else None


def _same_number(a: str | None, ground_truth: str) -> bool:
    return a is not None and verify_boxed(f"\\boxed{{{a}}}", ground_truth) >= 1.0


def _tool_failure(observation: str) -> str | None:
    text = observation or ""
    if text.startswith("Timed out"):
        return "timeout"
    if text.startswith("Error:"):
        return "tool_error"
    if text.startswith("No output"):
        return "no_output"
    return None


def step_votes(steps: Sequence[Mapping], ground_truth: str) -> list[int]:
    """+1 / -1 per step (module docstring)."""
    votes = []
    for s in steps:
        kind = s.get("kind")
        if kind == "tool":
            good = _tool_failure(s.get("observation", "")) is None and _same_number(
                _printed(s.get("observation", "")), ground_truth
            )
        elif kind == "answer":
            good = verify_boxed(s.get("action", ""), ground_truth) >= 1.0
        else:
            good = False
        votes.append(1 if good else -1)
    return votes


def diagnose(steps: Sequence[Mapping], ground_truth: str) -> tuple[str, str]:
    """The failure a judge would name for a trajectory that ended wrong: ``(kind, detail)``, kind one of
    ``FAILURES``; detail is the tool's error line for ``tool_error``, else ""."""
    printed_truth = False
    for s in steps:
        kind, obs = s.get("kind"), s.get("observation", "")
        if kind == "tool":
            failure = _tool_failure(obs)
            if failure is not None:
                return failure, obs.splitlines()[0][len("Error: ") :] if failure == "tool_error" else ""
            if not _same_number(_printed(obs), ground_truth):
                return "wrong_value", ""
            printed_truth = True
        elif kind == "answer":
            if verify_boxed(s.get("action", ""), ground_truth) >= 1.0:
                continue
            return ("copy_slip" if printed_truth else "guess"), ""
        else:
            return "malformed", ""
    return "no_answer", ("printed" if printed_truth else "")


def bridge_thought(problem: str, steps: Sequence[Mapping], ground_truth: str) -> str:
    """The hint for a failed trajectory (module docstring): names the failure, then what to do instead."""
    expr = problem_expression(problem) or "the whole expression"
    call = f"<python>print({expr})</python>"
    kind, detail = diagnose(steps, ground_truth)
    answer = f"\\boxed{{{ground_truth}}}"
    return {
        "guess": f"Do not guess the value. Run the tool first: {call}",
        "tool_error": f"The call failed ({detail}). Run exactly {call}",
        "timeout": f"The call timed out. Run exactly {call}",
        "no_output": f"The call printed nothing. Print the value: {call}",
        "wrong_value": f"The code changed the numbers. Copy them exactly: {call}",
        "copy_slip": f"The tool printed {ground_truth}. Answer exactly {answer}",
        "malformed": f"Write the tool call as {call}",
        "no_answer": (
            f"The tool printed {ground_truth}. Answer {answer}" if detail == "printed" else f"Run {call}"
        ),
    }[kind]


class HindsightJudge:
    """The PRM judge of ``prm.scorer=rule``: ``judge(...)`` with the model judges' signature (votes per step,
    a raw hint text per row), from the rules above (deterministic: ``seed`` is not used). Needs each row's
    ground truth."""

    def judge(
        self,
        problems: Sequence[str],
        steps: Sequence[Sequence[Mapping]],
        ground_truths: Sequence[str | None],
        hint_rows: Sequence[int],
        outcomes: Sequence[float] | None,
        seed: int,
    ) -> tuple[list[list[list[int]]], list[str]]:
        for i, g in enumerate(ground_truths):
            if g is None and steps[i]:
                raise ValueError(
                    f"prm.scorer=rule: row {i} has no reward_model.ground_truth; the hindsight judge needs it"
                )
        votes = [[[v] for v in step_votes(s, str(g))] for s, g in zip(steps, ground_truths)]
        hints = [""] * len(problems)
        for i in hint_rows:
            # the verifier's result when the batch has it, else the judge's own check of the answer
            solved = (
                outcomes[i] >= 1.0
                if outcomes is not None
                else any(s.get("kind") == "answer" and v == [1] for s, v in zip(steps[i], votes[i]))
            )
            hints[i] = (
                NO_INTERVENTION
                if solved
                else f"{HINT_OPEN}{bridge_thought(problems[i], steps[i], str(ground_truths[i]))}{HINT_CLOSE}"
            )
        return votes, hints
