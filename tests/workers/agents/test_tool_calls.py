"""Tool calls in model text (``workers.agents.tool_calls``): the Hermes and Llama 3 JSON parsers (round trips,
every malformed case as data, never an exception), the parser registry, tool schemas and argument checks."""

from __future__ import annotations

import json

import pytest

from workers.agents.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MalformedCall,
    ParsedTurn,
    ToolCall,
    ToolParser,
    argument_problems,
    check_call,
    normalize_tool,
    normalize_tools,
    register_tool_parser,
    tool_parser,
    tool_parser_names,
)

NESTED = {
    "code": "print('héllo, 世界 🚀')\nx = {\"a\": [1, 2]}",
    "options": {"timeout": 2.5, "flags": [True, None, {"deep": ["ü", 3]}], "empty": {}},
    "n": -7,
}


class SomeParser(ToolParser):
    """A user's own format: one ``CALL name {json}`` line per call."""

    name = "some"
    stop = ()

    def parse(self, text: str) -> ParsedTurn:
        calls, content = [], []
        for line in text.splitlines():
            if line.startswith("CALL "):
                name, _, args = line[5:].partition(" ")
                calls.append(ToolCall(name, json.loads(args), raw=line, id=f"call_{len(calls)}"))
            else:
                content.append(line)
        return ParsedTurn("\n".join(content).strip(), calls, [])

    def format_call(self, name: str, arguments: dict) -> str:
        return f"CALL {name} {json.dumps(arguments)}"


# --- Hermes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arguments", [NESTED, {}, {"q": "naïve café"}])
def test_hermes_round_trip(arguments):
    p = HermesParser()
    text = p.format_call("run_code", arguments)
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert text == "<tool_call>\n" + json.dumps(
        {"name": "run_code", "arguments": arguments}, ensure_ascii=False
    ) + ("\n</tool_call>")
    turn = p.parse(text)
    assert turn == ParsedTurn("", [ToolCall("run_code", arguments, raw=text, id="call_0")], [])


def test_hermes_names_and_stop():
    assert HermesParser.name == "hermes" and HermesParser.stop == ("</tool_call>",)
    assert Llama3JsonParser.name == "llama3_json" and Llama3JsonParser.stop == ()


def test_hermes_several_calls_with_text_around():
    p = HermesParser()
    a, b = p.format_call("search", {"q": "ray"}), p.format_call("python", {"code": "1+1"})
    text = f"Let me look.\n{a}\nThen compute:\n{b}\n  Done."
    turn = p.parse(text)
    assert turn.content == "Let me look.\n\nThen compute:\n\n  Done."
    assert turn.calls == [
        ToolCall("search", {"q": "ray"}, raw=a, id="call_0"),
        ToolCall("python", {"code": "1+1"}, raw=b, id="call_1"),
    ]
    assert turn.malformed == []


def test_hermes_plain_text_and_compact_call():
    p = HermesParser()
    assert p.parse("  just an answer: 42\n") == ParsedTurn("just an answer: 42", [], [])
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}, "id": "abc", "extra": 5}</tool_call>'
    assert p.parse(text).calls == [ToolCall("f", {"x": 1}, raw=text, id="abc")]


def test_hermes_arguments_as_json_string_and_missing():
    p = HermesParser()
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1, \\"é\\"]}"}\n</tool_call>'
    assert p.parse(text).calls == [ToolCall("f", {"x": [1, "é"]}, raw=text, id="call_0")]
    bare = '<tool_call>{"name": "now"}</tool_call>'
    assert p.parse(bare).calls == [ToolCall("now", {}, raw=bare, id="call_0")]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (
            '{"name": "f" "arguments": {}}',
            "the tool call is not valid JSON: Expecting ',' delimiter (line 1 column 14)",
        ),
        ("", 'the tool call is empty: write {"name": ..., "arguments": {...}} inside it'),
        (
            '[{"name": "f", "arguments": {}}]',
            'a tool call must be a JSON object {"name": ..., "arguments": {...}}, got array',
        ),
        ('"f"', 'a tool call must be a JSON object {"name": ..., "arguments": {...}}, got string'),
        ('{"arguments": {}}', 'the tool call has no "name": write it as {"name": ..., "arguments": {...}}'),
        ('{"name": 3, "arguments": {}}', 'the tool call\'s "name" must be a non-empty string, got integer'),
        (
            '{"name": "", "arguments": {}}',
            'the tool call\'s "name" must be a non-empty string, got an empty string',
        ),
        ('{"name": "f", "arguments": [1]}', 'the tool call\'s "arguments" must be a JSON object, got array'),
        ('{"name": "f", "arguments": null}', 'the tool call\'s "arguments" must be a JSON object, got null'),
        (
            '{"name": "f", "arguments": "[1]"}',
            'the tool call\'s "arguments" must be a JSON object, got a string holding array',
        ),
        (
            '{"name": "f", "arguments": "{x}"}',
            'the tool call\'s "arguments" is a string that is not valid JSON: Expecting property name enclosed in '
            "double quotes (line 1 column 2)",
        ),
    ],
)
def test_hermes_malformed_body(body, problem):
    p = HermesParser()
    raw = f"<tool_call>\n{body}\n</tool_call>"
    turn = p.parse(f"Before. {raw} After.")
    assert turn == ParsedTurn("Before.  After.", [], [MalformedCall(raw, problem)])


def test_hermes_unclosed_and_unopened_tags():
    p = HermesParser()
    good = p.format_call("f", {"x": 1})
    unclosed = '<tool_call>\n{"name": "g", "arguments": {}}\n'
    turn = p.parse(f"A {unclosed}{good} B")
    # a second opening tag ends the first (unclosed) call; the second one is still read
    assert turn.calls == [ToolCall("f", {"x": 1}, raw=good, id="call_0")]
    assert turn.malformed == [
        MalformedCall(unclosed, "the tool call is never closed: end it with </tool_call>")
    ]
    assert turn.content == "A  B"

    at_end = '<tool_call>\n{"name": "g", "arguments": {}}'
    assert p.parse(f"thinking {at_end}") == ParsedTurn(
        "thinking", [], [MalformedCall(at_end, "the tool call is never closed: end it with </tool_call>")]
    )

    turn = p.parse('{"name": "g", "arguments": {}}\n</tool_call>\n' + good)
    assert turn.content == '{"name": "g", "arguments": {}}'
    assert turn.malformed == [
        MalformedCall("</tool_call>", "</tool_call> closes no tool call: a call starts with <tool_call>")
    ]
    assert turn.calls == [ToolCall("f", {"x": 1}, raw=good, id="call_0")]


def test_hermes_ids_count_well_formed_calls():
    p = HermesParser()
    text = p.format_call("a", {}) + "<tool_call>oops</tool_call>" + p.format_call("b", {})
    turn = p.parse(text)
    assert [(c.name, c.id) for c in turn.calls] == [("a", "call_0"), ("b", "call_1")]
    assert [m.raw for m in turn.malformed] == ["<tool_call>oops</tool_call>"]
    assert turn.malformed[0].problem.startswith("the tool call is not valid JSON: Expecting value")


# --- Llama 3 JSON ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arguments", [NESTED, {}, {"city": "Zürich"}])
def test_llama3_round_trip(arguments):
    p = Llama3JsonParser()
    text = p.format_call("get_weather", arguments)
    assert json.loads(text) == {"name": "get_weather", "parameters": arguments}
    assert p.parse(text) == ParsedTurn("", [ToolCall("get_weather", arguments, raw=text, id="call_0")], [])


def test_llama3_plain_text_is_content():
    p = Llama3JsonParser()
    assert p.parse("  The answer is {42}.\n") == ParsedTurn("The answer is {42}.", [], [])
    assert p.parse("") == ParsedTurn("", [], [])


def test_llama3_python_tag_and_arguments_synonym():
    p = Llama3JsonParser()
    call = '{"name": "f", "arguments": {"x": "a;b"}}'
    assert p.parse(f"<|python_tag|>{call}") == ParsedTurn(
        "", [ToolCall("f", {"x": "a;b"}, raw=call, id="call_0")], []
    )
    assert p.parse(f"\n <|python_tag|> {call}\n").calls == [
        ToolCall("f", {"x": "a;b"}, raw=call, id="call_0")
    ]
    stringified = '{"name": "f", "parameters": "{\\"x\\": 1}"}'
    assert p.parse(stringified).calls == [ToolCall("f", {"x": 1}, raw=stringified, id="call_0")]


def test_llama3_semicolon_separated_and_list():
    p = Llama3JsonParser()
    a, b = '{"name": "a", "parameters": {"s": "x; y"}}', '{"name": "b", "parameters": {}}'
    expected = [ToolCall("a", {"s": "x; y"}, raw=a, id="call_0"), ToolCall("b", {}, raw=b, id="call_1")]
    assert p.parse(f"{a}; {b}") == ParsedTurn("", expected, [])
    assert p.parse(f"{a};{b};\n") == ParsedTurn("", expected, [])
    assert p.parse(f"[{a} ,\n {b}]") == ParsedTurn("", expected, [])


@pytest.mark.parametrize(
    ("text", "calls", "malformed"),
    [
        (
            '{"name": "f", "parameters": {"x": 1}',
            [],
            [
                MalformedCall(
                    '{"name": "f", "parameters": {"x": 1}',
                    "the tool call is not valid JSON: Expecting ',' delimiter (line 1 column 37)",
                )
            ],
        ),
        (
            '{"parameters": {}}',
            [],
            [
                MalformedCall(
                    '{"parameters": {}}',
                    'the tool call has no "name": write it as {"name": ..., "parameters": {...}}',
                )
            ],
        ),
        (
            '{"name": ["f"], "parameters": {}}',
            [],
            [
                MalformedCall(
                    '{"name": ["f"], "parameters": {}}',
                    'the tool call\'s "name" must be a non-empty string, got array',
                )
            ],
        ),
        (
            '{"name": "f", "parameters": 3}',
            [],
            [
                MalformedCall(
                    '{"name": "f", "parameters": 3}',
                    'the tool call\'s "parameters" must be a JSON object, got integer',
                )
            ],
        ),
        (
            '[{"name": "f", "parameters": {}}, 7]',
            [ToolCall("f", {}, raw='{"name": "f", "parameters": {}}', id="call_0")],
            [
                MalformedCall(
                    "7", 'a tool call must be a JSON object {"name": ..., "parameters": {...}}, got integer'
                )
            ],
        ),
        ("[]", [], [MalformedCall("[]", "the list of tool calls is empty")]),
        (
            '{"name": "f", "parameters": {}} and that is all',
            [ToolCall("f", {}, raw='{"name": "f", "parameters": {}}', id="call_0")],
            [
                MalformedCall(
                    "and that is all",
                    "unexpected text after the tool call: a turn that calls tools holds only the calls "
                    "(JSON objects separated by ';')",
                )
            ],
        ),
        (
            '{"name": "f", "parameters": {}}; {"name": "g",',
            [ToolCall("f", {}, raw='{"name": "f", "parameters": {}}', id="call_0")],
            [
                MalformedCall(
                    '{"name": "g",',
                    "the tool call is not valid JSON: Expecting property name enclosed in double quotes "
                    "(line 1 column 14)",
                )
            ],
        ),
    ],
)
def test_llama3_malformed(text, calls, malformed):
    assert Llama3JsonParser().parse(text) == ParsedTurn("", calls, malformed)


# --- registry -------------------------------------------------------------------------------------------------


def test_registry_names_and_alias():
    assert {"hermes", "qwen", "llama3_json"} <= set(tool_parser_names())
    assert tool_parser_names() == sorted(tool_parser_names())
    assert type(tool_parser("hermes")) is HermesParser
    assert type(tool_parser("qwen")) is HermesParser
    assert type(tool_parser("llama3_json")) is Llama3JsonParser
    assert tool_parser("hermes") is not tool_parser("hermes")  # a fresh instance each time


def test_registry_unknown_name_lists_known():
    with pytest.raises(ValueError) as e:
        tool_parser("mistral")
    message = str(e.value)
    assert message.startswith("unknown tool-call parser 'mistral': tool_format must be ")
    for name in ("'hermes'", "'qwen'", "'llama3_json'"):
        assert name in message


def test_registry_user_parser():
    register_tool_parser("some", SomeParser)
    try:
        p = tool_parser("some")
        assert type(p) is SomeParser and "some" in tool_parser_names()
        assert p.parse(p.format_call("f", {"x": 1})).calls == [
            ToolCall("f", {"x": 1}, raw='CALL f {"x": 1}', id="call_0")
        ]
    finally:
        from workers.agents import tool_calls

        tool_calls._PARSERS.pop("some")
    with pytest.raises(TypeError):
        register_tool_parser("bad", dict)  # type: ignore[arg-type]


def test_registry_module_class():
    p = tool_parser("tests.workers.agents.test_tool_calls:SomeParser")
    assert type(p).__name__ == "SomeParser" and isinstance(p, ToolParser)
    assert p.parse("hi\nCALL g {}").calls == [ToolCall("g", {}, raw="CALL g {}", id="call_0")]
    with pytest.raises(TypeError, match="not a ToolParser subclass"):
        tool_parser("tests.workers.agents.test_tool_calls:NESTED")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        tool_parser("tests.workers.agents.test_tool_calls:Nope")


# --- schemas --------------------------------------------------------------------------------------------------

PARAMS = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}


def test_normalize_tool_both_forms():
    bare = {"name": "python", "description": "Run code.", "parameters": PARAMS}
    expected = {
        "type": "function",
        "function": {"name": "python", "description": "Run code.", "parameters": PARAMS},
    }
    assert normalize_tool(bare) == expected
    openai = {"type": "function", "function": dict(bare)}
    out = normalize_tool(openai)
    assert out == expected
    out["function"]["parameters"]["properties"]["code"]["type"] = "integer"
    assert PARAMS["properties"]["code"]["type"] == "string"  # a new dict, not the caller's
    assert normalize_tool({"name": "now"}) == {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    }
    assert normalize_tool({"function": {"name": "now-2", "strict": True}})["function"]["strict"] is True


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"description": "x"}, "tool schema has no name"),
        ({"type": "function", "function": {"parameters": PARAMS}}, "tool schema has no name"),
        (
            {"name": "run code"},
            "tool name must be a non-empty string of letters, digits, '_' and '-', got 'run code'",
        ),
        ({"name": ""}, "tool name must be a non-empty string"),
        ({"name": 5}, "got 5"),
        (
            {"name": "f", "parameters": {"type": "array"}},
            "tool 'f': parameters must be a JSON schema with type 'object'",
        ),
        (
            {"name": "f", "parameters": {"properties": {}}},
            "tool 'f': parameters must be a JSON schema with type",
        ),
        ({"name": "f", "parameters": "object"}, "tool 'f': parameters must be a JSON schema"),
        (
            {"name": "f", "parameters": {"type": "object", "required": "x"}},
            "parameters.required must be a list",
        ),
        (
            {"name": "f", "parameters": {"type": "object", "properties": []}},
            "parameters.properties must be a mapping",
        ),
        ({"name": "f", "description": 3}, "tool 'f': description must be a string, got integer"),
        (
            {"type": "retrieval", "function": {"name": "f"}},
            "tool schema type must be 'function', got 'retrieval'",
        ),
        ({"type": "function", "function": "f"}, "tool schema 'function' must be a mapping, got string"),
        (["f"], "a tool schema must be a mapping, got array"),
    ],
)
def test_normalize_tool_errors(schema, message):
    with pytest.raises(ValueError) as e:
        normalize_tool(schema)
    assert message in str(e.value)


def test_normalize_tools_refuses_duplicates():
    tools = normalize_tools([{"name": "a"}, {"type": "function", "function": {"name": "b"}}])
    assert [t["function"]["name"] for t in tools] == ["a", "b"]
    with pytest.raises(ValueError, match="tool 'a' is defined twice"):
        normalize_tools([{"name": "a"}, {"type": "function", "function": {"name": "a"}}])


# --- arguments ------------------------------------------------------------------------------------------------


def test_argument_problems_required_and_unknown():
    strict = {**PARAMS, "additionalProperties": False}
    assert argument_problems(PARAMS, {"code": "1"}) == []
    assert argument_problems(PARAMS, {}) == ["missing required argument 'code'"]
    assert argument_problems(PARAMS, {"cod": "1"}) == ["missing required argument 'code'"]  # extras allowed
    assert argument_problems(strict, {"cod": "1"}) == [
        "missing required argument 'code'",
        "unknown argument 'cod' (known: code)",
    ]
    assert argument_problems({"type": "object", "additionalProperties": False}, {"x": 1}) == [
        "unknown argument 'x' (known: none)"
    ]
    typed_extra = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert argument_problems(typed_extra, {"a": 1, "b": "2"}) == [
        "argument 'b' must be an integer, got string"
    ]
    assert argument_problems(PARAMS, [1]) == ["the arguments must be a JSON object, got array"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("type_", "good", "bad"),
    [
        ("string", ["", "x"], [(1, "integer"), (None, "null"), (["x"], "array")]),
        ("integer", [0, -3, 10**20], [(True, "boolean"), (3.0, "number"), (2.5, "number"), ("3", "string")]),
        ("number", [0, 2.5, -1], [(False, "boolean"), ("2.5", "string"), (None, "null")]),
        ("boolean", [True, False], [(0, "integer"), ("true", "string")]),
        ("array", [[], [1, "a"]], [({}, "object"), ("[]", "string")]),
        ("object", [{}, {"a": 1}], [([], "array"), (None, "null")]),
        ("null", [None], [(0, "integer"), ("", "string")]),
    ],
)
def test_argument_problems_types(type_, good, bad):
    schema = {"type": "object", "properties": {"v": {"type": type_}}}
    article = {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}
    expected = article.get(type_, f"a {type_}")
    for value in good:
        assert argument_problems(schema, {"v": value}) == [], value
    for value, got in bad:
        assert argument_problems(schema, {"v": value}) == [f"argument 'v' must be {expected}, got {got}"], (
            value
        )


def test_argument_problems_type_list_and_unknown_type():
    schema = {"type": "object", "properties": {"v": {"type": ["string", "null"]}, "d": {"type": "date"}}}
    assert argument_problems(schema, {"v": None, "d": 5}) == []
    assert argument_problems(schema, {"v": "x"}) == []
    assert argument_problems(schema, {"v": 1}) == ["argument 'v' must be a string or null, got integer"]


def test_argument_problems_enum():
    schema = {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "k": {"enum": [1, 2]}},
    }
    assert argument_problems(schema, {"mode": "slow", "k": 2.0}) == []
    assert argument_problems(schema, {"mode": "médium"}) == [
        'argument \'mode\' must be one of "fast", "slow", got "médium"'
    ]
    assert argument_problems(schema, {"k": True}) == [
        "argument 'k' must be one of 1, 2, got true"
    ]  # True is not 1
    assert argument_problems(schema, {"mode": 1}) == ["argument 'mode' must be a string, got integer"]


def test_argument_problems_nested_paths():
    schema = {
        "type": "object",
        "properties": {
            "args": {
                "type": "object",
                "properties": {
                    "values": {"type": "array", "items": {"type": "number"}},
                    "opts": {
                        "type": "object",
                        "properties": {"depth": {"type": "integer"}},
                        "required": ["depth"],
                        "additionalProperties": False,
                    },
                },
                "required": ["values"],
            },
            "rows": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}}}},
        },
        "required": ["args"],
    }
    good = {"args": {"values": [1, 2.5], "opts": {"depth": 2}}, "rows": [{"id": "a"}, {}]}
    assert argument_problems(schema, good) == []
    bad = {
        "args": {"values": [1, 2, "three", None], "opts": {"depht": 2}},
        "rows": [{"id": "a"}, {"id": 7}, "x"],
    }
    assert argument_problems(schema, bad) == [
        "argument 'args.values[2]' must be a number, got string",
        "argument 'args.values[3]' must be a number, got null",
        "missing required argument 'args.opts.depth'",
        "unknown argument 'args.opts.depht' (known: depth)",
        "argument 'rows[1].id' must be a string, got integer",
        "argument 'rows[2]' must be an object, got string",
    ]
    assert argument_problems(schema, {"args": {}}) == ["missing required argument 'args.values'"]


def test_check_call():
    tools = {
        t["function"]["name"]: t
        for t in normalize_tools([{"name": "python", "parameters": PARAMS}, {"name": "now"}])
    }
    assert check_call(ToolCall("python", {"code": "1"}), tools) is None
    assert check_call(ToolCall("now", {}), tools) is None
    assert (
        check_call(ToolCall("pyhton", {"code": "1"}), tools)
        == "unknown tool 'pyhton'; the tools are: python, now"
    )
    assert check_call(ToolCall("f", {}), {}) == "unknown tool 'f'; no tools are available"
    strict = {
        "python": normalize_tool({"name": "python", "parameters": {**PARAMS, "additionalProperties": False}})
    }
    assert check_call(ToolCall("python", {"code": 3, "x": 1}), strict) == (
        "argument 'code' must be a string, got integer; unknown argument 'x' (known: code)"
    )
