"""Custom tools: host functions that REPL code calls by name, run by the host (never inside the sandbox).

::

    def lookup(key: str) -> dict:
        '''Look a key up in the catalogue.'''
        return catalogue[key]


    repl = await sandbox.acreate(context=text, tools={"lookup": lookup, "slow": Tool(fetch, timeout_s=5)})
    await repl.aexecute("row = lookup('a1')")  # a JSON round trip through the REPL's channel

In the REPL a tool is a function of that name whose docstring is the tool's signature and description.
Arguments must be JSON-able (checked in the REPL: a ``TypeError`` there); the host calls the function
(a plain one in a worker thread, a coroutine function on the sandbox's event loop) with them, within
``timeout_s``, and sends its result back as JSON. A failure, a timeout, or a result that is not JSON-able
raises ``ToolError`` in the REPL code with a message naming the tool (``llm_query`` instead returns
``"Error: ..."`` strings: a tool's result may be any JSON value, so an error string could pass for one).
A sync tool that times out keeps its thread until it returns (Python cannot stop a thread).

Tool names are identifiers that do not start with ``_`` and are not reserved (``context``, ``context_<n>``,
``llm_query`` ... see ``RESERVED_NAMES``); they are rebound after every block like the reserved names.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import keyword
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers.sandbox._repl_namespace import CONTEXT_NAME, RESERVED_NAMES

__all__ = ["Constant", "Tool", "ToolSpec", "as_tools", "check_tool_name"]

TOOL_RECORD_CHARS = 2000  # characters of a call's JSON arguments/result kept in its record
MAX_RESULT_CHARS = 8 << 20  # a tool result goes back in one frame (at most 4 bytes a char, under MAX_FRAME)


@dataclass(frozen=True)
class Tool:
    """A host function callable from REPL code. ``description``: shown in the system prompt and as the
    REPL function's docstring (default: the function's docstring). ``pass_context``: the host calls
    ``fn(*args, context=..., **kwargs)`` with the REPL's original context (several contexts as
    ``{"context_0": c0, "context_1": c1, ...}``), a host-side copy the REPL code cannot change; the REPL
    function does not take it."""

    fn: Callable[..., Any]
    description: str | None = None
    timeout_s: float = 60.0
    pass_context: bool = False
    # the JSON schema of its arguments, for a model that calls it in its own tool-call format (``schema``); None:
    # derived from the function's signature
    parameters: dict | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Tool.fn must be callable, got {type(self.fn).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"Tool.timeout_s must be positive, got {self.timeout_s}")

    def signature(self, name: str) -> str:
        """``name(query, k=3)``: the function's parameters as REPL code passes them."""
        try:
            sig = inspect.signature(self.fn, eval_str=True)  # `str`, not "'str'", under postponed annotations
        except (NameError, SyntaxError, TypeError, ValueError):
            try:
                sig = inspect.signature(self.fn)
            except (TypeError, ValueError):
                return f"{name}(...)"
        if self.pass_context:
            sig = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "context"])
        return f"{name}{sig.replace(return_annotation=inspect.Signature.empty)}"

    def doc(self) -> str:
        return (self.description if self.description is not None else inspect.getdoc(self.fn) or "").strip()

    def schema(self, name: str) -> dict:
        """The OpenAI function schema that declares this tool to a model through its chat template
        (``workers.agents.tool_calls``): the description, and ``parameters`` or the signature's (annotated
        ``str``/``int``/``float``/``bool``/``list``/``dict`` parameters typed, those without a default required)."""
        params = self.parameters if self.parameters is not None else self._signature_parameters()
        return {
            "type": "function",
            "function": {"name": name, "description": self.doc(), "parameters": params},
        }

    def _signature_parameters(self) -> dict:
        try:
            sig = inspect.signature(self.fn, eval_str=True)
        except (NameError, SyntaxError, TypeError, ValueError):
            return {"type": "object", "properties": {}}
        properties: dict[str, dict] = {}
        required = []
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or (self.pass_context and pname == "context"):
                continue
            json_type = _JSON_TYPES.get(p.annotation)
            properties[pname] = {"type": json_type} if json_type else {}
            if p.default is p.empty:
                required.append(pname)
        return {"type": "object", "properties": properties, "required": required}

    def summary(self) -> str:
        """The first line of the description (for the system prompt)."""
        return (self.doc().splitlines() or ["a custom tool"])[0]

    async def acall(self, name: str, args: list, kwargs: dict, context: Any = None) -> dict:
        """Run the tool on the host; returns ``{"ok": result}`` or ``{"error": message naming the tool}``."""
        if self.pass_context:
            kwargs = {**kwargs, "context": context}
        try:
            if inspect.iscoroutinefunction(self.fn):
                result = await asyncio.wait_for(self.fn(*args, **kwargs), self.timeout_s)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(self.fn, *args, **kwargs), self.timeout_s)
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, self.timeout_s)
        except TimeoutError:
            return {"error": f"tool {name!r} timed out after {self.timeout_s:g} s"}
        except Exception as exc:
            return {"error": f"tool {name!r} failed: {type(exc).__name__}: {exc}"}
        try:
            text = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            return {"error": f"tool {name!r} returned a result that is not JSON-able ({exc})"}
        if len(text) > MAX_RESULT_CHARS:
            size = f"{len(text):,} characters of JSON (limit {MAX_RESULT_CHARS:,})"
            return {"error": f"tool {name!r} returned {size}"}
        return {"ok": result}


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Constant:
    """A JSON value bound to a name in the REPL (rlms' non-callable ``custom_tools`` entries): rebound, and
    restored when changed in place, after every block, like a context."""

    value: Any
    description: str | None = None

    def signature(self, name: str) -> str:
        return name

    def summary(self) -> str:
        return self.description or f"a {type(self.value).__name__} value"


ToolSpec = Tool | Constant


def check_tool_name(name: Any) -> str:
    """``name`` if it can name a tool in the REPL; else ValueError saying why."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"tool name {name!r} is not a Python identifier")
    if name.startswith("_"):
        raise ValueError(f"tool name {name!r} may not start with '_'")
    if name in RESERVED_NAMES or CONTEXT_NAME.fullmatch(name):
        raise ValueError(
            f"tool name {name!r} is reserved (reserved: {', '.join(RESERVED_NAMES)}, context_<n>)"
        )
    return name


def as_tools(tools: Mapping[str, Any] | None) -> dict[str, ToolSpec]:
    """``{name: Tool | Constant}``, names checked, from ``{name: entry}``; an entry is a ``Tool``, a callable,
    rlms' ``{"tool": callable_or_value, "description": "..."}``, or a JSON value (a ``Constant``)."""
    out: dict[str, ToolSpec] = {}
    for name, entry in (tools or {}).items():
        check_tool_name(name)
        description = None
        if isinstance(entry, Mapping) and "tool" in entry:
            entry, description = entry["tool"], entry.get("description")
        if isinstance(entry, Tool | Constant):
            out[name] = entry
        elif callable(entry):
            out[name] = Tool(entry, description=description)
        else:
            try:
                json.dumps(entry)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"tool {name!r} must be a callable, a Tool or a JSON value ({exc})") from None
            out[name] = Constant(entry, description)
    return out


def tool_record(name: str, args: Any, kwargs: Any, outcome: dict, started: float) -> dict:
    """What a block's ``ExecResult.tool_calls`` keeps of one call (JSON text cut to TOOL_RECORD_CHARS)."""

    def cut(value: Any) -> str:
        text = json.dumps(value, ensure_ascii=False, default=repr)
        return text if len(text) <= TOOL_RECORD_CHARS else text[:TOOL_RECORD_CHARS] + "..."

    record = {"name": name, "args": cut({"args": args, "kwargs": kwargs}), "started": started}
    if "error" in outcome:
        record["error"] = outcome["error"]
    else:
        record["result"] = cut(outcome["ok"])
    record["elapsed_s"] = time.perf_counter() - started
    return record
