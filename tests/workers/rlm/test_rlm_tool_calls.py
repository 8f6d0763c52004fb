"""RLM tools called in the model's own format: ``RLM(custom_tools=..., tools=[schemas],
agent_config=AgentConfig(tool_format="hermes"))`` declares the tools through the chat template (Qwen3-style here) and runs the calls the model writes in that format
on the host, answered as ``tool`` messages, beside the REPL's functions; the same ``AgentConfig.tool_format`` serves
training (``env.agent.tool_format`` with ``env.tools``). A scripted policy fixes the model's turns; the sandbox is
real."""

from __future__ import annotations

import json

import pytest
from rlm_testlib import block

from workers.agents.scripted import ReplayScript, scripted_generate
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM
from workers.sandbox import Tool

pytestmark = pytest.mark.timeout(120)

PRICES = {"apple": 3, "plum": 5}
HERMES = AgentConfig(tool_format="hermes")  # calls in the Qwen/Hermes <tool_call> format


def price(item: str) -> int:
    """The price of an item in the catalogue."""
    return PRICES[item]


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen3_tok():
    return load_tokenizer(ensure_tiny_model("nano", chat_template="qwen3"))


def run(tok, sandbox, turns, seen=None, **kwargs):
    script = ReplayScript({"Q-price": turns})

    def respond(text):
        if seen is not None and "Q-price" in text:
            seen.append(text)
        return script(text)

    gen = scripted_generate(tok, respond)
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=4, **kwargs) as rlm:
        return rlm.completion("Q-price", context="unused")


def test_calls_in_the_models_format_run_the_custom_tools_on_the_host(qwen3_tok, sandbox):
    turns = [
        call("price", {"item": "apple"}) + "\n" + call("price", {"item": "pear"}) + "\n" + call("price", {}),
        block("print(price('plum'))") + "\n" + call("price", {"item": "plum"}),
        "FINAL(8)",
    ]
    seen: list[str] = []
    res = run(qwen3_tok, sandbox, turns, seen, custom_tools={"price": price}, agent_config=HERMES)
    assert (res.status, res.answer) == ("finished", "8")
    # the schema read from the signature, rendered by the template into the system turn
    schema = {"type": "function", "function": {"name": "price", "description": "The price of an item in the "
              "catalogue.", "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
              "required": ["item"]}}}  # fmt: skip
    assert "<tools>\n" + json.dumps(schema) + "\n</tools>" in seen[0]
    # the results as tool responses, a failing or invalid call as an error the model reads
    assert seen[1].endswith(
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nError: tool 'price' failed: "
        "KeyError: 'pear'\n</tool_response>\n<tool_response>\nError: missing required argument 'item'\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn with code and a call: the tool result, then the code's observation as a user message
    assert "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>user\n" in seen[2]
    assert res.root.turns[1].code_results[0].stdout == "5\n"
    records = res.root.metadata["tool_calls"]
    assert [(r["turn"], r["name"], r.get("ok"), "error" in r) for r in records] == [
        (0, "price", 3, False), (0, "price", None, True), (1, "price", 5, False)
    ]  # fmt: skip
    assert res.root.metadata["tool_use"] == {"calls": 3, "malformed": 0, "invalid": 1, "failed": 0}


def test_schemas_given_to_rlm_describe_the_tools(qwen3_tok, sandbox):
    schema = {
        "name": "price",
        "description": "Look up a price.",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string", "enum": ["apple", "plum"]}},
            "required": ["item"],
        },
    }
    seen: list[str] = []
    turns = [call("price", {"item": "pear"}), "FINAL(none)"]
    res = run(
        qwen3_tok, sandbox, turns, seen, custom_tools={"price": price}, tools=[schema], agent_config=HERMES
    )
    assert res.answer == "none" and '"description": "Look up a price."' in seen[0]
    assert 'Error: argument \'item\' must be one of "apple", "plum", got "pear"' in seen[1]


def test_tool_format_errors_are_clear(qwen3_tok):
    with pytest.raises(ValueError, match="tool_format"):
        AgentConfig(tool_format="nope")
    with pytest.raises(ValueError, match="names no function of custom_tools"):
        RLM(
            engine=scripted_generate(qwen3_tok, str),
            tokenizer=qwen3_tok,
            tools=[{"name": "x"}],
            agent_config=HERMES,
        )
    with pytest.raises(ValueError, match="tool_format='hermes'"):
        RLM(engine=scripted_generate(qwen3_tok, str), tokenizer=qwen3_tok, custom_tools={"price": Tool(price)},
            tools=[{"name": "price"}])  # fmt: skip
