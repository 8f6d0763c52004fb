"""Tools called in the model's own format: declared once as OpenAI function schemas, rendered by the chat template,
parsed by the family's parser (``workers.agents.tool_calls``), answered as ``tool`` messages.

    tools = ToolUse(schemas, "hermes")                        # or "llama3_json", "package.module:Parser"
    conv = policy.conversation(messages, limit, tools=tools.schemas)   # the template renders the tools
    turn = tools.parse(response.text)                         # prose, calls, malformed attempts
    messages = await tools.answer(turn, run)                  # one ``tool`` message per attempt, in order
    conv.add_messages(messages)

``run(call) -> str`` executes a well-formed, schema-valid call (host-side, or code in the trajectory's sandbox)
and returns what the model should read. A malformed attempt (not a readable call), an unknown tool or arguments
that do not match the schema are answered with an ``Error: ...`` message the model sees instead: never a crash,
and counted (``ToolUseStats``). An exception from ``run`` is answered the same way (``run`` should report the
tool's own failures as text; this is the backstop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from workers.agents.tool_calls import (
    ParsedTurn,
    ToolCall,
    ToolParser,
    check_call,
    normalize_tools,
    tool_parser,
)

__all__ = ["ToolUse", "ToolUseStats"]


@dataclass
class ToolUseStats:
    calls: int = 0  # well-formed, valid calls that ran
    malformed: int = 0  # attempts that could not be read as a call
    invalid: int = 0  # readable calls to an unknown tool or with arguments the schema refuses
    failed: int = 0  # calls whose ``run`` raised


class ToolUse:
    """The tools of an environment in one model family's tool-call format (module docstring)."""

    def __init__(self, schemas: Sequence[Mapping], parser: str | ToolParser):
        self.schemas = normalize_tools(schemas)
        self.by_name = {t["function"]["name"]: t for t in self.schemas}
        self.parser = tool_parser(parser) if isinstance(parser, str) else parser
        self.stats = ToolUseStats()

    @property
    def stop(self) -> list[str]:
        """Strings after which the engine may end a turn (the format's closing tag, if it has one)."""
        return list(self.parser.stop)

    def parse(self, text: str) -> ParsedTurn:
        return self.parser.parse(text)

    def format_call(self, name: str, arguments: dict) -> str:
        return self.parser.format_call(name, arguments)

    async def answer(self, turn: ParsedTurn, run: Callable[[ToolCall], Awaitable[str]]) -> list[dict]:
        """One ``tool`` message per attempted call of ``turn``: the calls in order, then the malformed ones."""
        messages = []
        for call in turn.calls:
            problem = check_call(call, self.by_name)
            if problem is not None:
                self.stats.invalid += 1
                content = f"Error: {problem}"
            else:
                try:
                    content = await run(call)
                    self.stats.calls += 1
                except Exception as exc:  # the tool's own bug: the model reads it, the trajectory goes on
                    self.stats.failed += 1
                    content = f"Error: the tool {call.name!r} failed: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content})
        for bad in turn.malformed:
            self.stats.malformed += 1
            messages.append({"role": "tool", "content": f"Error: {bad.problem}"})
        return messages
