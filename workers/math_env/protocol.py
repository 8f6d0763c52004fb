r"""The tool-use math protocol: what a model turn may contain, what the environment answers, the verifier.

A model turn is one of

* a **tool call**: ``<python>code</python>`` -- the code runs in the trajectory's persistent sandboxed
  REPL (``workers.sandbox``) and the observation is its output;
* an **answer**: ``\boxed{...}`` (the last one of the turn) -- the trajectory ends;
* anything else is **malformed** and gets a format-correction observation (the trajectory goes on):
  an opened ``<python>`` never closed, a ``</python>`` never opened, an empty tool call, an unbalanced
  ``\boxed{``, or neither a tool call nor an answer.

A turn with both a complete tool call and an answer runs the tool call (the model answered before it saw
the output) and the observation says the answer was not taken. Observations: the tool's stdout, its
error (the traceback's last line first), "timed out" (the REPL was restarted: variables are gone) or
"no output" (a hint to ``print``), each cut to ``max_chars``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from workers.reward import extract_boxed

__all__ = [
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "Action",
    "format_correction",
    "format_tool_observation",
    "parse_action",
    "verify_boxed",
]

TOOL_OPEN, TOOL_CLOSE = "<python>", "</python>"
_TOOL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)
_BOXED = "\\boxed{"

ACTION_KINDS = ("tool", "answer", "malformed")


@dataclass(frozen=True)
class Action:
    kind: str  # "tool" | "answer" | "malformed"
    code: str = ""  # tool: the code to run
    answer: str | None = None  # answer: the boxed content
    problem: str = ""  # malformed: what is wrong (shown to the model); tool: a note (answer ignored)


def parse_action(text: str) -> Action:
    """Classify one model turn (module docstring)."""
    text = text or ""
    call = _TOOL.search(text)
    answer = extract_boxed(text)
    if call is not None:
        code = call.group(1).strip("\n")
        if not code.strip():
            return Action(
                "malformed",
                problem=f"The tool call is empty: put Python code between {TOOL_OPEN} and {TOOL_CLOSE}.",
            )
        note = (
            "Your \\boxed{} answer was not taken: a turn with a tool call only runs the code."
            if answer
            else ""
        )
        return Action("tool", code=code, problem=note)
    if TOOL_OPEN in text:
        return Action("malformed", problem=f"Your tool call was not closed: end the code with {TOOL_CLOSE}.")
    if TOOL_CLOSE in text:
        return Action(
            "malformed",
            problem=f"Found {TOOL_CLOSE} without {TOOL_OPEN}: a tool call is {TOOL_OPEN}code{TOOL_CLOSE}.",
        )
    if answer is not None:
        if not answer:
            return Action("malformed", problem="The \\boxed{} answer is empty.")
        return Action("answer", answer=answer)
    if _BOXED in text:
        return Action("malformed", problem="Your \\boxed{ answer has no closing brace.")
    return Action(
        "malformed",
        problem=f"No tool call and no answer found. Run code as {TOOL_OPEN}print(...){TOOL_CLOSE} "
        "or give the final answer as \\boxed{N}.",
    )


def format_correction(action: Action) -> str:
    return f"Format error: {action.problem}"


def _cut(text: str, max_chars: int) -> str:
    text = text.rstrip("\n")
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f" ... [{len(text) - max_chars} chars cut]"


def format_tool_observation(
    stdout: str,
    stderr: str = "",
    error: str | None = None,
    timed_out: bool = False,
    max_chars: int = 500,
    note: str = "",
) -> str:
    """The observation after a tool call (error, timeout and empty output are observations too)."""
    parts = []
    if timed_out:
        parts.append("Timed out: the code ran too long and the Python state was reset (variables are gone).")
    elif error:
        lines = [ln for ln in error.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else error.strip()
        parts.append("Error: " + _cut(last, max_chars))
    if stdout.strip():
        parts.append("Output:\n" + _cut(stdout, max_chars))
    if stderr.strip() and not error:
        parts.append("Stderr:\n" + _cut(stderr, max_chars))
    if not parts:
        parts.append("No output. Use print(...) to see a value.")
    if note:
        parts.append(note)
    return "\n".join(parts)


_NUM = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def verify_boxed(text: str, ground_truth) -> float:
    r"""The outcome verifier: 1.0 when the last ``\boxed{}`` of ``text`` holds a number equal to
    ``ground_truth`` (commas and spaces ignored; integers exactly, decimals within 1e-6), else 0.0."""
    ans = extract_boxed(text or "")
    if ans is None:
        return 0.0
    a = ans.replace(",", "").replace(" ", "")
    g = str(ground_truth).replace(",", "").strip()
    if not _NUM.match(a) or not _NUM.match(g):
        return 0.0
    if re.fullmatch(r"[+-]?\d+", a) and re.fullmatch(r"[+-]?\d+", g):
        return float(int(a) == int(g))
    return float(math.isclose(float(a), float(g), rel_tol=1e-6, abs_tol=1e-6))
