"""The host's answers to a REPL's call frames: ``llm_query`` / ``rlm_query`` sub-calls through the
sub-call handler, and custom tools run here on the host (``workers.sandbox.tools``).
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import cast

from workers.sandbox.protocol import _ReplSpec
from workers.sandbox.tools import Tool, tool_record

SubcallHandler = Callable[[str, dict], Awaitable[str] | str]
"""``handler(kind, payload) -> str``: kind is "llm_query" or "rlm_query"; payload holds "prompt",
"model" and, for rlm_query, "context". Batched calls from the REPL reach the handler as concurrent
single calls. May be a coroutine function (awaited on the caller's loop) or a plain function (run in
a thread). An exception becomes an "Error: ..." string in the REPL. (Custom tools do not go through the
handler: the REPL runs them itself, see ``workers.sandbox.tools``.)"""


async def _answer_tools(payloads: list, spec: _ReplSpec, tool_calls: list[dict]) -> list[dict]:
    """Run the REPL's tool calls here, on the host; each result is {"ok": json} or {"error": text}, each
    call recorded in ``tool_calls``."""
    tools = spec.tools

    async def one(payload) -> dict:
        started = time.perf_counter()
        if not isinstance(payload, dict):
            return {"error": "malformed tool call"}
        name, args, kwargs = payload.get("name"), payload.get("args"), payload.get("kwargs")
        tool = tools.get(name) if isinstance(name, str) else None
        if not isinstance(name, str) or not isinstance(tool, Tool):  # (a name that is not a str has no tool)
            return {"error": f"no tool named {str(name)[:100]!r}"}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            outcome = {"error": f"tool {name!r}: malformed arguments"}
        else:
            outcome = await tool.acall(name, args, kwargs, spec.tool_context)
        tool_calls.append(tool_record(name, args, kwargs, outcome, started))
        return outcome

    return list(await asyncio.gather(*(one(p) for p in payloads)))


async def _answer_calls(
    msg: dict, handler: SubcallHandler | None, timeout: float, spec: _ReplSpec, tool_calls: list[dict]
) -> list:
    """The results of one call frame, one per payload: tool calls (see :func:`_answer_tools`), or sub-calls
    answered by ``handler`` within ``timeout`` seconds each (a failure is an "Error: ..." string)."""
    kind, payloads = msg.get("kind"), msg.get("payloads")
    if kind == "tool" and isinstance(payloads, list):
        return await _answer_tools(payloads, spec, tool_calls)
    if kind not in ("llm_query", "rlm_query") or not isinstance(payloads, list):
        return ["Error: malformed sub-call"] * (len(payloads) if isinstance(payloads, list) else 1)
    if handler is None:
        return [f"Error: {kind} is not available (no sub-call handler is configured)"] * len(payloads)
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)

    async def one(payload) -> str:
        if not isinstance(payload, dict):
            return "Error: malformed sub-call payload"
        try:
            if is_async:
                # a coroutine function's call returns an awaitable
                result = await asyncio.wait_for(cast(Awaitable[str], handler(kind, payload)), timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(handler, kind, payload), timeout)
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, timeout)
            return result if isinstance(result, str) else str(result)
        except TimeoutError:
            return f"Error: {kind} timed out after {timeout} s"
        except Exception as exc:
            return f"Error: {kind} failed: {type(exc).__name__}: {exc}"

    return list(await asyncio.gather(*(one(p) for p in payloads)))
