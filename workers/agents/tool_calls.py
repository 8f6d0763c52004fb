"""Tool calls in a model's text: OpenAI-style tool schemas, one parser per model family, argument validation.

The contract:

* A tool is described by an OpenAI-form schema ``{"type": "function", "function": {"name", "description",
  "parameters"}}`` (``normalize_tool`` also takes the bare function and fills in the defaults); ``parameters`` is
  the JSON schema of the call's arguments object.
* A ``ToolParser`` turns one model turn into a ``ParsedTurn``: the prose (``content``), the well-formed calls
  (``ToolCall``) and the attempts that went wrong (``MalformedCall``, with a sentence the model reads). Parsing
  never raises on model text: a broken call is data the environment answers, not an error of the run.
  ``format_call`` writes one call the way a model of that family does, and ``parse`` reads it back exactly.
* ``tool_parser(name)`` builds a parser from a registered name (``"hermes"``, ``"qwen"``, ``"llama3_json"``) or
  ``"package.module:Class"`` (``workers.plugins``), so another model family is one class plus a config value.
* ``argument_problems`` / ``check_call`` check a parsed call against the tools' schemas (the subset of JSON schema
  tool definitions use: ``type``, ``required``, ``properties``, ``additionalProperties``, ``items``, ``enum``;
  other keywords are not checked) and say what is wrong in words the model can act on.

Pure Python: no engine, tokenizer or Ray here, so every environment and scripted policy can import it.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from workers.plugins import load_plugin

__all__ = [
    "HermesParser",
    "Llama3JsonParser",
    "MalformedCall",
    "ParsedTurn",
    "ToolCall",
    "ToolParser",
    "argument_problems",
    "check_call",
    "normalize_tool",
    "normalize_tools",
    "register_tool_parser",
    "tool_parser",
    "tool_parser_names",
]


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's ``name`` and its ``arguments`` object."""

    name: str
    arguments: dict
    raw: str = ""  # the exact text of this call in the model's turn
    id: str = ""  # "call_<k>" (k-th well-formed call of the turn) unless the model gave one


@dataclass(frozen=True)
class MalformedCall:
    """An attempted call that could not be read: its text and a sentence for the model saying why."""

    raw: str
    problem: str


@dataclass
class ParsedTurn:
    """A model turn split into its prose and its calls (well-formed or not), in the order they were written."""

    content: str  # the turn's text with every call removed, stripped
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[MalformedCall] = field(default_factory=list)


def _json_type(value: Any) -> str:
    """The JSON type name of a decoded value (bool before int: in Python a bool is an int)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _json_error(e: json.JSONDecodeError) -> str:
    # e's own str ends with "(char N)", which means nothing to a model; line and column do.
    return f"{e.msg} (line {e.lineno} column {e.colno})"


def _dumps(value: Any) -> str:
    # ensure_ascii=False: what chat templates' ``tojson`` writes, so it is what the models themselves write.
    return json.dumps(value, ensure_ascii=False)


def _sort(result: ToolCall | MalformedCall, calls: list[ToolCall], malformed: list[MalformedCall]) -> None:
    if isinstance(result, ToolCall):
        calls.append(result)
    else:
        malformed.append(result)


_WS = re.compile(r"\s*")


def _skip_ws(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace."""
    m = _WS.match(text, pos)
    return m.end() if m else pos


class ToolParser:
    """Base class. Subclasses set ``name`` and implement ``parse`` / ``format_call``.

    ``stop``: strings after which the engine may end the turn (a closing tag), () when the format has none. An
    engine that trims the stop string from its output must put it back before ``parse``: a call whose closing tag
    is missing is malformed.
    """

    name: ClassVar[str] = ""
    stop: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str) -> ParsedTurn:
        """The turn's prose, well-formed calls and malformed ones; never raises on model text."""
        raise NotImplementedError

    def format_call(self, name: str, arguments: dict) -> str:
        """The text a model of this family writes for one call; ``parse`` reads it back as exactly that call."""
        raise NotImplementedError

    def _call(
        self, obj: Any, raw: str, index: int, args_key: str, synonyms: tuple[str, ...] = ()
    ) -> ToolCall | MalformedCall:
        """``obj`` (one decoded call) as a ToolCall, or a MalformedCall saying what is wrong with it."""
        shape = f'{{"name": ..., "{args_key}": {{...}}}}'
        if not isinstance(obj, dict):
            return MalformedCall(raw, f"a tool call must be a JSON object {shape}, got {_json_type(obj)}")
        name = obj.get("name")
        if name is None:
            return MalformedCall(raw, f'the tool call has no "name": write it as {shape}')
        if not isinstance(name, str) or not name:
            got = "an empty string" if name == "" else _json_type(name)
            return MalformedCall(raw, f'the tool call\'s "name" must be a non-empty string, got {got}')
        key = next((k for k in (args_key, *synonyms) if k in obj), None)
        # a call without arguments is how models write a tool that takes none
        arguments = obj[key] if key is not None else {}
        key = key or args_key
        if isinstance(arguments, str):
            # some models write the arguments object as a JSON string holding it
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return MalformedCall(
                    raw, f'the tool call\'s "{key}" is a string that is not valid JSON: {_json_error(e)}'
                )
            if not isinstance(arguments, dict):
                return MalformedCall(
                    raw,
                    f'the tool call\'s "{key}" must be a JSON object, got a string holding {_json_type(arguments)}',
                )
        if not isinstance(arguments, dict):
            return MalformedCall(
                raw, f'the tool call\'s "{key}" must be a JSON object, got {_json_type(arguments)}'
            )
        call_id = obj.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{index}"
        return ToolCall(name=name, arguments=arguments, raw=raw, id=call_id)


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    any number of them anywhere in the turn."""

    name = "hermes"
    stop = ("</tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _TAG = re.compile(r"<tool_call>|</tool_call>")

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        malformed: list[MalformedCall] = []
        content: list[str] = []
        pos = 0  # end of the last piece handled (content or call)
        opened = -1  # start of the <tool_call> waiting for its close, -1 when none
        for m in self._TAG.finditer(text):
            if m.group() == self.OPEN:
                if opened >= 0:
                    # a second open before any close: the first call was never closed
                    malformed.append(MalformedCall(text[opened : m.start()], self._unclosed()))
                else:
                    content.append(text[pos : m.start()])
                opened = m.start()
            elif opened < 0:
                content.append(text[pos : m.start()])
                malformed.append(
                    MalformedCall(
                        m.group(), f"{self.CLOSE} closes no tool call: a call starts with {self.OPEN}"
                    )
                )
            else:
                raw = text[opened : m.end()]
                _sort(
                    self._body(text[opened + len(self.OPEN) : m.start()], raw, len(calls)), calls, malformed
                )
                opened = -1
            pos = m.end()
        if opened >= 0:
            malformed.append(MalformedCall(text[opened:], self._unclosed()))
        else:
            content.append(text[pos:])
        return ParsedTurn("".join(content).strip(), calls, malformed)

    def _unclosed(self) -> str:
        return f"the tool call is never closed: end it with {self.CLOSE}"

    def _body(self, body: str, raw: str, index: int) -> ToolCall | MalformedCall:
        body = body.strip()
        if not body:
            return MalformedCall(
                raw, 'the tool call is empty: write {"name": ..., "arguments": {...}} inside it'
            )
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return MalformedCall(raw, f"the tool call is not valid JSON: {_json_error(e)}")
        return self._call(obj, raw, index, "arguments")

    def format_call(self, name: str, arguments: dict) -> str:
        return f"{self.OPEN}\n{_dumps({'name': name, 'arguments': arguments})}\n{self.CLOSE}"


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calling: the whole turn (after an optional ``<|python_tag|>``) is the call
    ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read as a synonym), several of them separated by
    ``;``, or a JSON list of them. A turn that does not start with ``{`` or ``[`` is prose with no calls."""

    name = "llama3_json"
    stop = ()
    PYTHON_TAG = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> ParsedTurn:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        if not body.startswith(("{", "[")):
            return ParsedTurn(text.strip(), [], [])
        calls: list[ToolCall] = []
        malformed: list[MalformedCall] = []

        def add(obj: Any, raw: str) -> None:
            _sort(self._call(obj, raw, len(calls), "parameters", ("arguments",)), calls, malformed)

        pos = 0
        while pos < len(body):
            rest = body[pos:]
            try:
                obj, n = self._decoder.raw_decode(rest)
            except json.JSONDecodeError as e:
                malformed.append(
                    MalformedCall(rest.rstrip(), f"the tool call is not valid JSON: {_json_error(e)}")
                )
                break
            if isinstance(obj, list):
                if not obj:
                    malformed.append(MalformedCall(rest[:n], "the list of tool calls is empty"))
                for item, raw in zip(obj, self._item_texts(rest[:n]), strict=True):
                    add(item, raw)
            else:
                add(obj, rest[:n])
            pos += n
            pos = _skip_ws(body, pos)
            if pos < len(body):
                if body[pos] != ";":
                    malformed.append(
                        MalformedCall(
                            body[pos:].rstrip(),
                            "unexpected text after the tool call: a turn that calls tools holds only the calls "
                            "(JSON objects separated by ';')",
                        )
                    )
                    break
                pos = _skip_ws(body, pos + 1)
        return ParsedTurn("", calls, malformed)

    def _item_texts(self, array: str) -> list[str]:
        """The exact text of each element of the JSON array ``array`` (already known to be valid)."""
        texts = []
        pos = _skip_ws(array, 1)
        while array[pos] != "]":
            _, end = self._decoder.raw_decode(array, pos)
            texts.append(array[pos:end])
            pos = _skip_ws(array, end)
            if array[pos] == ",":
                pos = _skip_ws(array, pos + 1)
        return texts

    def format_call(self, name: str, arguments: dict) -> str:
        return _dumps({"name": name, "parameters": arguments})


# Registered parsers; "module:Class" names are imported on first use (workers.plugins).
_PARSERS: dict[str, type[ToolParser] | str] = {
    "hermes": HermesParser,
    "qwen": HermesParser,  # Qwen2.5 / Qwen3 write Hermes-format calls
    "llama3_json": Llama3JsonParser,
}


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    """Make ``tool_parser(name)`` build ``cls`` in this process (other processes: use ``"module:Class"``)."""
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise TypeError(f"tool-call parser {name!r} is {cls!r}, not a ToolParser subclass")
    _PARSERS[name] = cls


def tool_parser(name: str) -> ToolParser:
    """A parser of the format ``name``: a registered name or ``"package.module:Class"``; a ValueError listing the
    known names otherwise."""
    return load_plugin(name, _PARSERS, ToolParser, "tool_format", "tool-call parser")()


def tool_parser_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_PARSERS)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")


def normalize_tool(schema: Mapping) -> dict:
    """``schema`` (OpenAI form or the bare function) as a new OpenAI-form dict; a ValueError saying what is wrong."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"a tool schema must be a mapping, got {_json_type(schema)}")
    if "function" in schema:
        if schema.get("type", "function") != "function":
            raise ValueError(f"tool schema type must be 'function', got {schema['type']!r}")
        function = schema["function"]
        if not isinstance(function, Mapping):
            raise ValueError(f"tool schema 'function' must be a mapping, got {_json_type(function)}")
    else:
        function = schema
    name = function.get("name")
    if name is None:
        raise ValueError(f"tool schema has no name: {dict(function)!r}")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(
            f"tool name must be a non-empty string of letters, digits, '_' and '-', got {name!r}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"tool {name!r}: description must be a string, got {_json_type(description)}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ValueError(
            f"tool {name!r}: parameters must be a JSON schema with type 'object', got {_plain(parameters)!r}"
        )
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping):
        raise ValueError(
            f"tool {name!r}: parameters.properties must be a mapping, got {_json_type(properties)}"
        )
    required = parameters.get("required", [])
    if not (isinstance(required, list | tuple) and all(isinstance(r, str) for r in required)):
        raise ValueError(f"tool {name!r}: parameters.required must be a list of names, got {required!r}")
    out = _plain(function)
    out["parameters"] = _plain(parameters)
    return {"type": "function", "function": out}


def _plain(value: Any) -> Any:
    """A deep copy with every mapping a dict (the caller's schema is never shared or mutated)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def normalize_tools(schemas: Sequence[Mapping]) -> list[dict]:
    """Each schema normalized (``normalize_tool``); a ValueError on a name given twice."""
    tools = [normalize_tool(s) for s in schemas]
    seen: set[str] = set()
    for tool in tools:
        name = tool["function"]["name"]
        if name in seen:
            raise ValueError(f"tool {name!r} is defined twice")
        seen.add(name)
    return tools


_ARTICLE = {"null": "null", "integer": "an integer", "array": "an array", "object": "an object"}


def _expected(types: list[str]) -> str:
    return " or ".join(_ARTICLE.get(t, f"a {t}") for t in types)


def _is_type(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        # strict: a JSON integer literal; a bool is not one, nor is 3.0
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return _json_type(value) == json_type


def _same(a: Any, b: Any) -> bool:
    """JSON equality: True is not 1, 1 is 1.0."""
    ta, tb = _json_type(a), _json_type(b)
    numbers = {"integer", "number"}
    if ta != tb and not (ta in numbers and tb in numbers):
        return False
    if ta == "array":
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if ta == "object":
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


_KNOWN_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}


def _check(schema: Any, value: Any, path: str, out: list[str]) -> None:
    """Append to ``out`` what is wrong with ``value`` (at ``path``) under ``schema``."""
    if not isinstance(schema, Mapping):
        return
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared) if isinstance(declared, list) else []
    types = [t for t in types if t in _KNOWN_TYPES]  # a type we cannot check is not held against the call
    if types and not any(_is_type(value, t) for t in types):
        out.append(f"argument '{path}' must be {_expected(types)}, got {_json_type(value)}")
        return
    enum = schema.get("enum")
    if isinstance(enum, list) and not any(_same(value, e) for e in enum):
        options = ", ".join(_dumps(e) for e in enum)
        out.append(f"argument '{path}' must be one of {options}, got {_dumps(value)}")
        return
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{i}]", out)
    if isinstance(value, Mapping) and any(
        k in schema for k in ("properties", "required", "additionalProperties")
    ):
        _check_object(schema, value, f"{path}.", out)


def _check_object(schema: Mapping, value: Mapping, prefix: str, out: list[str]) -> None:
    properties = schema.get("properties") or {}
    for key in schema.get("required") or []:
        if key not in value:
            out.append(f"missing required argument '{prefix}{key}'")
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            _check(properties[key], item, f"{prefix}{key}", out)
        elif extra is False:
            known = ", ".join(properties) if properties else "none"
            out.append(f"unknown argument '{prefix}{key}' (known: {known})")
        elif isinstance(extra, Mapping):
            _check(extra, item, f"{prefix}{key}", out)


def argument_problems(parameters: Mapping, arguments: Mapping) -> list[str]:
    """What is wrong with a call's ``arguments`` under its tool's ``parameters`` schema, one sentence each (empty
    when nothing is): missing required keys first, then the given keys in their order."""
    if not isinstance(arguments, Mapping):
        return [f"the arguments must be a JSON object, got {_json_type(arguments)}"]
    out: list[str] = []
    _check_object(parameters, arguments, "", out)
    return out


def check_call(call: ToolCall, tools: Mapping[str, dict]) -> str | None:
    """None when ``call`` names one of ``tools`` (name -> normalized schema) with valid arguments; else one
    sentence for the model."""
    tool = tools.get(call.name)
    if tool is None:
        known = f"the tools are: {', '.join(tools)}" if tools else "no tools are available"
        return f"unknown tool '{call.name}'; {known}"
    function = tool.get("function", tool)
    problems = argument_problems(function.get("parameters") or {}, call.arguments)
    return "; ".join(problems) or None
