"""The RLM turn protocol: parse a model turn, format the REPL observation.

Pure functions and plain dataclasses; no sandbox, engine or Ray. The RLM agent parses each model
response with :func:`parse_turn`, runs the returned code blocks in the trajectory's sandbox, shows
the model :func:`format_observation` of the results, and records everything in a
``workers.agents.trajectory.Trajectory``.

Code blocks
-----------
A code block is a fenced block whose opening fence is a line of three or more backticks (leading
spaces allowed) followed by the language ``repl`` (case-insensitive; the rest of the info string is
ignored), and whose closing fence is a line of only backticks, at least as many as the opening
fence. Fences must start their line: ``text ```repl`` mid-line opens nothing.

- Every ``repl`` block of the turn is returned, in order of appearance, dedented, with leading and
  trailing blank lines removed; blocks that are empty after that are dropped.
- Only ``repl`` executes by default. ```` ```python ```` (and any other language, or none) is *not*
  executed: models often show example code in such fences. ``parse_turn(text,
  languages=("repl", "python"))`` opts in to more languages (an inference-time choice; the default
  is what training and the system prompt use).
- An **unterminated** block (the turn ends -- e.g. truncated at the token limit -- before the
  closing fence) is not executed: its code is likely cut mid-statement. Its text is returned in
  ``Turn.unterminated`` so the observation can say it was not run.
- Text inside ``<think> ... </think>`` (an unclosed ``<think>`` runs to the end of the turn) is
  reasoning: neither code blocks nor FINAL lines in it count.

The FINAL rule
--------------
``FINAL(answer)`` / ``FINAL_VAR(name)`` finish the trajectory only

(a) as a **call inside a repl block** -- the sandbox executes it and records the answer
    (``FINAL(value)`` answers ``str(value)``, ``FINAL_VAR("name")`` the named variable);
    :func:`parse_turn` only notes that the code may finish (``Turn.code_calls_final``, from the
    block's syntax tree: a call whose callee is the bare name ``FINAL`` or ``FINAL_VAR``); or
(b) **on its own line outside code blocks**: the call starts its line (leading whitespace allowed)
    and nothing but whitespace follows its closing parenthesis on the line where the call ends. The
    argument is extracted with balanced parentheses and must be non-empty: first with Python
    string literals skipped (so ``FINAL("a ) b")`` works and the argument may span lines), and
    when that does not balance, by counting every parenthesis on the starting line only (so an
    apostrophe, as in ``FINAL(it's 42)``, is fine). ``FINAL``'s answer is the
    argument text, stripped, unquoted when it is exactly one Python string literal
    (``FINAL("42")`` answers ``42``). ``FINAL_VAR``'s argument must be a Python identifier,
    optionally quoted (``FINAL_VAR(answer)`` or ``FINAL_VAR("answer")``), not a keyword.
    The first such line in the turn is the turn's ``final``.

Everything else is a mention, not a call: ``I will call FINAL(x) later``, ```FINAL(x)``` inline,
``FINAL(x) is what I'd write``, a FINAL line inside a non-repl fence or inside ``<think>``,
``FINAL_VAR(not an identifier)``, ``FINAL(`` without its closing parenthesis.

Order within a turn: the env runs all repl blocks in order, then applies the outside ``final`` (a
``FINAL_VAR`` line is resolved against the REPL state *after* the blocks, so a turn may assign a
variable in code and name it on a line below). An answer recorded by code comes first: the sandbox
saw it before the outside line could apply.
"""

from __future__ import annotations

import ast
import keyword
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.agents.trajectory import CodeResult, FinalCall

__all__ = [
    "DEFAULT_LANGUAGES",
    "FINAL_NAMES",
    "TRUNCATION_MARKER",
    "Turn",
    "code_calls_final",
    "format_observation",
    "parse_turn",
    "scan_fences",
    "truncate",
]

DEFAULT_LANGUAGES: tuple[str, ...] = ("repl",)
FINAL_NAMES = ("FINAL", "FINAL_VAR")
TRUNCATION_MARKER = "\n[... {n} characters truncated ...]\n"


# --------------------------------------------------------------------------------------------------
# Parsing a turn


@dataclass
class Turn:
    code_blocks: list[str]
    final: FinalCall | None
    reasoning: str  # the turn without its repl blocks, stripped
    code_calls_final: bool = False  # some block calls FINAL/FINAL_VAR (the sandbox decides)
    unterminated: str | None = None  # code of an unclosed repl block at the end (not executed)

    @property
    def may_finish(self) -> bool:
        return self.final is not None or self.code_calls_final


_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
_OPEN = re.compile(r"^[ \t]*(`{3,})[ \t]*([^`\s]*)[^`]*$")
_FINAL_START = re.compile(r"^[ \t]*(FINAL_VAR|FINAL)\(", re.M)


def _split_think(text: str) -> tuple[str, list[str]]:
    """(text with think regions replaced by a newline, the think contents)."""
    thoughts: list[str] = []

    def keep(m: re.Match) -> str:
        thoughts.append(m.group(1))
        return "\n"

    return _THINK.sub(keep, text), thoughts


def _clean_code(lines: list[str]) -> str:
    return textwrap.dedent("".join(lines)).strip("\n").rstrip()


def scan_fences(text: str, languages: Sequence[str] = DEFAULT_LANGUAGES):
    """Yield the segments of ``text`` in order: ``("text", str)`` outside fences, ``("code", str)`` a closed
    block of one of ``languages`` (its code as it runs), ``("open", str)`` such a block left unterminated,
    ``("other", str)`` the raw lines inside any other fence. ``parse_turn`` and the viewer read turns with it."""
    langs = {lang.lower() for lang in languages}
    outside: list[str] = []
    block: list[str] = []
    fence = ""
    lang = ""
    for line in text.splitlines(keepends=True):
        if not fence:
            m = _OPEN.match(line.rstrip("\r\n"))
            if m:
                if outside:
                    yield "text", "".join(outside)
                    outside = []
                fence, lang, block = m.group(1), m.group(2).lower(), []
            else:
                outside.append(line)
            continue
        stripped = line.strip()
        if stripped and set(stripped) == {"`"} and len(stripped) >= len(fence):
            yield ("code", _clean_code(block)) if lang in langs else ("other", "".join(block))
            fence = ""
        else:
            block.append(line)
    if fence:  # the turn ended inside a block
        yield ("open", _clean_code(block)) if lang in langs else ("other", "".join(block))
    elif outside:
        yield "text", "".join(outside)


def _match_paren(s: str, i: int, quotes: bool) -> int | None:
    """Index of the ``)`` closing the ``(`` just before ``s[i]``, or None when unbalanced.

    With ``quotes`` the scan skips Python string literals (single, double, triple, with escapes) and
    may cross lines; without, it counts every parenthesis but stays on the line it starts on.
    """
    depth, n = 1, len(s)
    if not quotes:  # quote-blind counting never crosses a line end
        eol = s.find("\n", i)
        n = n if eol < 0 else eol
    while i < n:
        c = s[i]
        if quotes and c in "'\"":
            q = s[i : i + 3] if s[i : i + 3] in ("'''", '"""') else c
            j = i + len(q)
            while j < n and not s.startswith(q, j):
                if s[j] == "\\":
                    j += 1
                elif len(q) == 1 and s[j] == "\n":
                    return None
                j += 1
            if j >= n:
                return None
            i = j + len(q)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _string_literal(text: str) -> str | None:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def _make_final(kind: str, argument: str) -> FinalCall | None:
    arg = argument.strip()
    if not arg:
        return None
    if kind == "FINAL":
        literal = _string_literal(arg)
        return FinalCall(kind, argument, answer=literal if literal is not None else arg)
    name = _string_literal(arg)
    name = (name if name is not None else arg).strip()
    if not name.isidentifier() or keyword.iskeyword(name):
        return None
    return FinalCall(kind, argument, var_name=name)


def _find_final_line(chunk: str) -> FinalCall | None:
    for m in _FINAL_START.finditer(chunk):
        for quotes in (True, False):
            end = _match_paren(chunk, m.end(), quotes)
            if end is None:
                continue
            eol = chunk.find("\n", end + 1)
            if chunk[end + 1 : len(chunk) if eol < 0 else eol].strip():
                continue
            call = _make_final(m.group(1), chunk[m.end() : end])
            if call is not None:
                return call
    return None


def code_calls_final(code: str) -> bool:
    """Whether ``code`` contains a call of the bare name ``FINAL`` or ``FINAL_VAR`` (syntax tree)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False  # it will not run, so it cannot finish
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FINAL_NAMES
        for node in ast.walk(tree)
    )


def parse_turn(text: str, languages: Sequence[str] = DEFAULT_LANGUAGES) -> Turn:
    """Split a model turn into its executable blocks, its outside FINAL line, and its reasoning.

    See the module docstring for the rules.
    """
    body, thoughts = _split_think(text or "")
    blocks: list[str] = []
    outside: list[str] = list(thoughts)
    final: FinalCall | None = None
    unterminated: str | None = None
    for kind, seg in scan_fences(body, languages):
        if kind == "code":
            if seg.strip():
                blocks.append(seg)
        elif kind == "open":
            unterminated = seg
        else:
            outside.append(seg)
            if kind == "text" and final is None:
                final = _find_final_line(seg)
    reasoning = "\n".join(s.strip("\n") for s in outside if s.strip()).strip()
    return Turn(
        code_blocks=blocks,
        final=final,
        reasoning=reasoning,
        code_calls_final=any(code_calls_final(b) for b in blocks),
        unterminated=unterminated,
    )


# --------------------------------------------------------------------------------------------------
# Observations


def _as_result(r: CodeResult | Mapping) -> CodeResult:
    return r if isinstance(r, CodeResult) else CodeResult.from_dict(r)


def truncate(text: str, max_chars: int) -> str:
    """``text`` if it fits in ``max_chars``; else its head (3/4) and tail (1/4) around a marker
    that says how many characters were cut. The kept characters total exactly ``max_chars``."""
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    if len(text) <= max_chars:
        return text
    tail = max_chars // 4
    head = max_chars - tail
    cut = len(text) - max_chars
    return text[:head] + TRUNCATION_MARKER.format(n=cut) + (text[len(text) - tail :] if tail else "")


def _format_variables(variables: Mapping[str, str]) -> str:
    return ", ".join(f"{k}: {v}" if v else k for k, v in variables.items())


def _shares(sizes: list[int], total: int) -> list[int]:
    """Split ``total`` characters among parts of ``sizes``: short parts whole, long ones evenly."""
    out = [0] * len(sizes)
    left = total
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for rank, i in enumerate(order):
        out[i] = min(sizes[i], left // (len(order) - rank))
        left -= out[i]
    return out


def format_observation(
    results: Sequence[CodeResult | Mapping],
    max_chars: int = 20_000,
    *,
    iteration: int | None = None,
    max_iterations: int | None = None,
    budget: Mapping[str, Any] | None = None,
    turn: Turn | None = None,
    show_variables: bool = True,
) -> str:
    """The user-message text the model sees after its turn.

    Per block: a header (block number, time), its stdout (or ``(no output)``), stderr, error, and
    the user variables. Stdout, stderr and error together are cut to ``max_chars`` per block, with
    a marker in each part that was cut; short parts are kept whole, long ones share the rest.
    Then notices: an unterminated block that was not run, a turn with neither code nor FINAL, and
    the iteration count (``iteration`` is the 1-based number of the turn just taken) with what
    is left of ``budget`` (e.g. ``{"sub-calls": 12, "seconds": 40}``). The last iteration's notice
    tells the model to answer now.
    """
    parts: list[str] = []
    blocks = [_as_result(r) for r in results]
    n = len(blocks)
    for i, r in enumerate(blocks, 1):
        head = f"[REPL block {i}/{n}" + (f", {r.elapsed_s:.2f}s" if r.elapsed_s else "") + "]"
        texts = [r.stdout or "", r.stderr or "", r.error or ""]
        if sum(map(len, texts)) > max_chars:
            texts = [truncate(t, n) for t, n in zip(texts, _shares([len(t) for t in texts], max_chars))]
        out, stderr, err = texts
        body = [head, out.rstrip("\n") if out else ("(no output)" if not (err or stderr) else "")]
        if stderr:
            body.append("[stderr] " + stderr.rstrip("\n"))
        if err:
            body.append("[error] " + err.rstrip("\n"))
        if r.timed_out:
            body.append("[timed out: the REPL was restarted; earlier variables are gone]")
        if show_variables and r.variables:
            body.append("[variables] " + _format_variables(r.variables))
        parts.append("\n".join(b for b in body if b))
    notices: list[str] = []
    if turn is not None and turn.unterminated is not None:
        notices.append("Your last ```repl block was not closed with ``` and was not run.")
    if turn is not None and not turn.code_blocks and turn.final is None and turn.unterminated is None:
        notices.append(
            "No ```repl block and no FINAL(...) line found. Write code in a ```repl block, or answer "
            "with FINAL(answer) or FINAL_VAR(variable_name) on its own line."
        )
    if iteration is not None:
        msg = f"Turn {iteration}" + (f" of {max_iterations}" if max_iterations else "") + " done"
        if max_iterations:
            left = max_iterations - iteration
            msg += f"; {left} left" if left > 0 else ""
        if budget:
            msg += ". Budget left: " + ", ".join(f"{k} {v}" for k, v in budget.items())
        msg += "."
        if max_iterations and max_iterations - iteration == 1:
            msg += " Next turn is the last: give your answer with FINAL(...) or FINAL_VAR(...)."
        notices.append(msg)
    if notices:
        parts.append("\n".join(f"[{m}]" for m in notices))
    return "\n\n".join(parts) if parts else "(no code was run)"
