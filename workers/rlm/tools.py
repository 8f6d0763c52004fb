"""Task tools for RLM agents: custom tools (``workers.sandbox.tools``) that tasks register in training
(``env.tools: {"search": "workers.rlm.tools:search_context"}``) or pass to ``RLM(custom_tools=...)``.

``search_context`` is a retrieval tool over the trajectory's own context: it runs on the host with a
host-side copy of the context (``Tool(pass_context=True)``; several contexts come as ``{"context_0": ...,
...}``), so the REPL code's changes to ``context`` do not affect it. ``load_tools`` resolves
``{name: "package.module:attribute"}`` import paths (or ``"path/to/file.py:attribute"``) into tools.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from workers.plugins import load_user_object
from workers.sandbox.tools import Tool, ToolSpec, as_tools

__all__ = ["load_tools", "search_context"]

_WORD = re.compile(r"\w+")


def _units(value: Any, where: str = "") -> list[tuple[str, str]]:
    """(where, line) of every non-blank line of a context: a str's lines, each list item's and dict value's
    lines, labelled by their path ("item 2, line 0", "key 'a', line 3")."""
    if isinstance(value, str):
        return [(f"{where}line {i}", line) for i, line in enumerate(value.splitlines()) if line.strip()]
    if isinstance(value, Mapping):
        return [u for k, v in value.items() for u in _units(v, f"{where}key {k!r}, ")]
    if isinstance(value, list | tuple):
        return [u for i, v in enumerate(value) for u in _units(v, f"{where}item {i}, ")]
    return [] if value is None else [(where.rstrip(", ") or "value", str(value))]


def _search_context(query: str, k: int = 3, *, context: Any = None) -> list[dict]:
    """Search the context for the lines that share the most words with ``query``.

    Returns up to ``k`` matches, best first: ``{"where": "line 17", "score": 3, "text": "..."}`` (a line's
    position in a str context; ``"item 2, line 0"`` in a list of documents; ``"key 'a', line 0"`` in a dict).
    A line scores one point per distinct query word it contains (case-insensitive); ties keep context order."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    words = {w.lower() for w in _WORD.findall(query)}
    scored = []
    for order, (where, text) in enumerate(_units(context)):
        score = len(words & {w.lower() for w in _WORD.findall(text)})
        if score:
            scored.append((-score, order, where, text))
    scored.sort()
    return [{"where": where, "score": -neg, "text": text[:2000]} for neg, _, where, text in scored[:k]]


search_context = Tool(_search_context, timeout_s=30.0, pass_context=True)


def load_tools(paths: Mapping[str, str]) -> dict[str, ToolSpec]:
    """``{name: Tool}`` from ``{name: "package.module:attribute"}`` (or ``"path/to/file.py:attribute"``,
    ``workers.plugins.load_user_object``); the attribute is a ``Tool`` or a callable (or a JSON value: a
    ``Constant``). Raises ValueError naming the tool whose path does not resolve."""
    out: dict[str, Any] = {}
    for name, path in paths.items():
        if ":" not in str(path) or not str(path).rpartition(":")[2]:
            raise ValueError(f"tool {name!r}: {path!r} is not of the form 'package.module:attribute'")
        out[name] = load_user_object(str(path), f"tool {name!r}: cannot import {path!r}")
    return as_tools(out)
