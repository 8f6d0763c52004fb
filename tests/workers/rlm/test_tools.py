"""Custom tools and setup code through the user's paths: ``RLM(custom_tools=, custom_sub_tools=, setup_code=)``
and the env worker's ``RLMEnvConfig(tools=, setup_code=)`` (the same mechanism in training), with a scripted
policy (so the model's code is fixed) and real sandboxes. Tools run on the host, are listed in the system
prompt, recorded as sub-calls of kind "tool", and a failing tool fails only that call."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from rlm_testlib import block

from dataproto import DataProto
from workers.agents.env_worker import EnvWorker
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.config import ModelConfig, RolloutConfig
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig
from workers.rlm.env_loop import RLMEnvConfig
from workers.rlm.inference import RLM
from workers.rlm.tools import load_tools, search_context
from workers.sandbox import ReplSandbox, SandboxBackend, SandboxConfig, Tool

pytestmark = pytest.mark.timeout(120)

CATALOGUE = {"apple": 3, "plum": 5}


def lookup(item: str) -> dict:
    """Look an item up in the price catalogue.

    Raises KeyError for an unknown item."""
    return {"item": item, "price": CATALOGUE[item], "host_thread": threading.current_thread().name}


def slow_lookup(item: str) -> int:
    """A catalogue that takes its time."""
    time.sleep(2)
    return 0


def rlm(tok, sandbox, script: dict, **kwargs) -> RLM:
    gen = scripted_generate(tok, ReplayScript(script))
    return RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=3, **kwargs)


def test_custom_tools_run_on_the_host_listed_and_recorded(tok, sandbox):
    script = {
        "Q-tools": [
            block(
                "row = lookup('apple')\nprint(row['price'] * 2, row['host_thread'] != 'MainThread')\n"
                "for bad in (lambda: lookup('pear'), lambda: slow('plum')):\n"
                "    try:\n        bad()\n    except Exception as e:\n        print(type(e).__name__, e)"
            ),
            block("FINAL(str(row['price'] + lookup('plum')['price']) + CURRENCY)"),
        ]
    }
    tools = {
        "lookup": lookup,
        "slow": Tool(slow_lookup, timeout_s=0.2),
        "CURRENCY": {"tool": "EUR", "description": "the catalogue's currency"},  # rlms' format, a constant
    }
    with rlm(tok, sandbox, script, custom_tools=tools) as r:
        res = r.completion("Q-tools", context="unused")
    assert (res.status, res.answer) == ("finished", "8EUR")
    out = res.root.turns[0].code_results[0].stdout.splitlines()
    assert out == [
        "6 True",  # run in a worker thread of this (host) process
        "ToolError tool 'lookup' failed: KeyError: 'pear'",
        "ToolError tool 'slow' timed out after 0.2 s",
    ]
    system = res.root.turns[0].prompt_text
    assert "- `lookup(item: str)` -- Look an item up in the price catalogue." in system
    assert "- `slow(item: str)` -- A catalogue that takes its time." in system
    assert "- `CURRENCY` -- the catalogue's currency" in system
    records = [s for s in res.root.metadata["subcalls"] if s["kind"] == "tool"]
    assert [(s["name"], s["turn"], "error" in s) for s in records] == [
        ("lookup", 0, False),
        ("lookup", 0, True),
        ("slow", 0, True),
        ("lookup", 1, False),
    ]
    assert records[0]["prompt"] == '{"args": ["apple"], "kwargs": {}}'
    assert json.loads(records[0]["response"])["price"] == 3
    assert records[2]["error"] == "tool 'slow' timed out after 0.2 s" and records[2]["elapsed_s"] < 1.5
    assert res.usage is not None  # tool calls cost no model tokens and break nothing downstream


def test_custom_sub_tools_default_to_the_roots_and_can_differ(tok, sandbox):
    script = {
        "Q-parent": [block("a = rlm_query('child-asks', 'ctx')\nprint(a)"), "FINAL_VAR(a)"],
        "child-asks": [
            block(
                "try:\n    FINAL(str(lookup('apple')['price']))\n"
                "except NameError as e:\n    FINAL('no tool: ' + str(e))"
            )
        ],
    }

    def cheap(item: str) -> dict:
        """Discount prices."""
        return {"price": 1}

    answers, child_prompts, root_prompts = [], [], []
    for sub_tools in (None, {}, {"lookup": cheap}):
        with rlm(
            tok, sandbox, script, max_depth=1, custom_tools={"lookup": lookup}, custom_sub_tools=sub_tools
        ) as r:
            res = r.completion("Q-parent", context="abc")
        answers.append(res.answer)
        root_prompts.append(res.root.turns[0].prompt_text)
        child_prompts.append(res.trajectories[1].turns[0].prompt_text)
    assert answers == ["3", "no tool: name 'lookup' is not defined", "1"]
    assert all("Look an item up" in p for p in root_prompts)
    assert ["Look an item up" in p for p in child_prompts] == [True, False, False]
    assert "Discount prices." in child_prompts[2]


def test_tool_names_are_checked_where_the_rlm_is_built(tok, sandbox):
    with pytest.raises(ValueError, match="tool name 'FINAL' is reserved"):
        rlm(tok, sandbox, {}, custom_tools={"FINAL": lookup})
    with pytest.raises(ValueError, match="tool name 'context_0' is reserved"):
        rlm(tok, sandbox, {}, custom_sub_tools={"context_0": lookup})


def test_setup_code_defines_variables_listed_in_the_prompt(tok, sandbox):
    setup = "PRICES = {'apple': 3}\ndef total(items):\n    return sum(PRICES[i] for i in items)"
    script = {"Q-setup": [block("PRICES['apple'] = 100\nFINAL(total(['apple', 'apple']) + len(context))")]}
    with rlm(tok, sandbox, script, setup_code=setup) as r:
        res = r.completion("Q-setup", context="abcd")
        broken = rlm(tok, sandbox, script, setup_code="x = 1\n1 / 0").completion("Q-setup", context="abcd")
    assert (res.status, res.answer) == ("finished", "204")  # setup variables are ordinary variables
    system = res.root.turns[0].prompt_text
    assert "- `PRICES` -- dict defined by the setup code" in system
    assert "- `total` -- function defined by the setup code" in system
    assert broken.status == "error" and broken.root.turns == []
    assert "setup_code failed" in broken.root.error and "ZeroDivisionError" in broken.root.error


def test_setup_code_gets_no_sub_calls(tok, sandbox):
    """Setup runs before the trajectory's first turn, when no sub-call can be charged to a turn: ``llm_query``
    there answers with an error string (as any failed sub-call does), and nothing is called or recorded."""
    script = {"Q-early": [block("FINAL(EARLY)")]}
    with rlm(tok, sandbox, script, setup_code="EARLY = llm_query('too early')") as r:
        res = r.completion("Q-early", context="abcd")
    assert (res.status, res.answer) == (
        "finished",
        "Error: sub-calls are only available while a code block is running",
    )
    assert "subcalls" not in res.root.metadata and res.usage.total.calls == 1  # the root's one turn


def test_search_context_tool_over_the_host_copy_of_the_context(tok, sandbox):
    text = "\n".join(
        ["intro line", "the magic number for quiet-harbor is 4821", "noise", "quiet days", "harbor lights"]
    )
    script = {
        "Q-search": [
            block(
                "context = 'overwritten'\nhits = search('magic number quiet-harbor', k=2)\n"
                "print(hits)\nFINAL(hits[0]['text'].split()[-1] + ' @ ' + hits[0]['where'])"
            )
        ]
    }
    with rlm(tok, sandbox, script, custom_tools={"search": search_context}) as r:
        res = r.completion("Q-search", context=text)
        several = r.completion("Q-search", contexts=["nothing here", ["x", "quiet-harbor magic number 7"]])
    assert res.answer == "4821 @ line 1"
    # k=2: the runner-up shares one word; of the two such lines the earlier wins
    assert (
        "{'where': 'line 3', 'score': 1, 'text': 'quiet days'}]" in res.root.turns[0].code_results[0].stdout
    )
    assert (
        "- `search(query: str, k: int = 3)` -- Search the context for the lines"
        in res.root.turns[0].prompt_text
    )
    assert several.answer == "7 @ key 'context_1', item 1, line 0"


def test_task_tools_and_setup_code_in_the_env_worker():
    """The env role (``EnvWorker`` in this process, as the recipe runs it) with a task's tools by import path."""
    ctx = "alpha\nthe code for quiet-harbor is 77\nomega"
    script = {
        "Q-env": [
            block("hits = search('quiet-harbor code')\nFINAL(hits[0]['text'].split()[-1] + '/' + str(N))")
        ]
    }

    def factory(tokenizer):
        return scripted_generate(tokenizer, ReplayScript(script))

    w = EnvWorker(
        ModelConfig(path=ensure_tiny_model("nano")),
        RolloutConfig(n=1, prompt_length=1024, response_length=1024),
        RLMEnvConfig(
            agent=AgentConfig(max_iterations=2),
            sandbox=SandboxConfig(timeout_s=10),
            tools={"search": "workers.rlm.tools:search_context"},
            setup_code="N = len(context.splitlines())",
        ),
        policy_factory=factory,
    )
    w.init_model()
    col = lambda v: np.array(v, dtype=object)  # noqa: E731
    data = DataProto.from_dict(
        non_tensors={
            "data_source": col(["exact_match"]),
            "reward_model": col([{"ground_truth": "77/3"}]),
            "extra_info": col([{"context": ctx}]),
            "raw_prompt": col([[{"role": "user", "content": "Q-env"}]]),
            "uid": col(["u"]),
        }
    )
    try:
        out = w.generate_sequences(data)
    finally:
        w.close_env()
    nt = out.non_tensor_batch
    assert list(nt["answer"]) == ["77/3"] and list(nt["status"]) == ["finished"]
    traj = json.loads(nt["trajectory"][0])
    assert [s["name"] for s in traj["metadata"]["subcalls"] if s["kind"] == "tool"] == ["search"]
    assert "search(query: str, k: int = 3)" in traj["turns"][0]["prompt_text"]


def test_load_tools_names_the_tool_whose_path_fails():
    assert isinstance(load_tools({"s": "workers.rlm.tools:search_context"})["s"], Tool)
    with pytest.raises(ValueError, match="tool 'bad': cannot import 'workers.rlm.tools:nope'"):
        load_tools({"bad": "workers.rlm.tools:nope"})
    with pytest.raises(ValueError, match="tool 'x': 'json' is not of the form"):
        load_tools({"x": "json"})


def test_the_recipe_config_takes_task_tools_and_setup_code():
    from recipes.config import load_config

    cfg = load_config(
        "rlm",
        overrides=[
            "env.tools={search: workers.rlm.tools:search_context}",
            'env.setup_code="N = len(context)"',
        ],
    )
    assert (
        cfg.env.tools == {"search": "workers.rlm.tools:search_context"}
        and cfg.env.setup_code == "N = len(context)"
    )


class CountingBackend:
    """An isolation backend other than ``ReplSandbox`` (here a thin one that delegates to it and counts
    sessions), standing in for a Docker/Modal/E2B backend that implements ``SandboxBackend``."""

    def __init__(self, real: ReplSandbox):
        self.real, self.config, self.created = real, real.config, 0

    async def acreate(
        self, context=None, setup_vars=None, handler=None, *, contexts=None, tools=None, setup_code=None
    ):
        self.created += 1
        return await self.real.acreate(
            context, setup_vars, handler, contexts=contexts, tools=tools, setup_code=setup_code
        )

    def close(self) -> None:
        pass


def test_any_isolation_backend_serves_rlm_with_tools(tok, sandbox):
    backend = CountingBackend(sandbox)
    assert isinstance(backend, SandboxBackend) and isinstance(sandbox, SandboxBackend)
    script = {"Q-backend": [block("FINAL(lookup('plum')['price'] + N)")]}
    gen = scripted_generate(tok, ReplayScript(script))
    with RLM(
        engine=gen, tokenizer=tok, sandbox=backend, custom_tools={"lookup": lookup}, setup_code="N = 10"
    ) as r:
        res = r.completion("Q-backend", context="x")
    assert (res.answer, backend.created) == ("15", 1)


def test_a_persistent_session_keeps_its_tools_and_runs_setup_code_once(tok, sandbox):
    replies = {
        "Q-first": block("RUNS.append(1)\nFINAL(lookup('apple')['price'])"),
        "Q-second": block("FINAL(f\"{lookup('plum')['price']} {len(RUNS)}\")"),
    }

    def respond(text: str) -> str:  # the session's history holds the first query too: answer the latest one
        return replies[max(replies, key=text.rfind)]

    gen = scripted_generate(tok, respond)
    tools = {"lookup": lookup}
    with RLM(
        engine=gen,
        tokenizer=tok,
        sandbox=sandbox,
        persistent=True,
        custom_tools=tools,
        setup_code="RUNS = []",
    ) as r:
        first = r.completion("Q-first", context="a")
        second = r.completion("Q-second", context="b")
    assert (first.answer, second.answer) == ("3", "5 1")  # one REPL for the session: setup code ran once
