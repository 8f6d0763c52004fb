"""Contexts through ``RLM().completion``: a dict stays a dict in the REPL, a list of documents stays a list, several
contexts are ``context_0``, ``context_1``, ... (``context`` is ``context_0``), each described in the system prompt
(type, size, item count, dict keys); in-place changes of a dict context are undone between turns; a dict passed
to ``rlm_query`` reaches the child as a dict; numpy values (parquet rows) become plain JSON values. Scripted
policy, real sandboxes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from rlm_testlib import block

from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.agent import RLMAgent
from workers.rlm.inference import RLM
from workers.rlm.prompts import ContextInfo, describe_context

pytestmark = pytest.mark.timeout(120)


def rlm(tok, sandbox, script: dict, **kwargs) -> RLM:
    return RLM(
        engine=scripted_generate(tok, ReplayScript(script)),
        tokenizer=tok,
        sandbox=sandbox,
        max_iterations=3,
        **kwargs,
    )


def test_dict_context_is_a_dict_described_and_restored_between_turns(tok, sandbox):
    ctx = {
        "title": "Q3 report",
        "rows": [{"city": "Oslo", "n": 4}, {"city": "Rome", "n": 7}],
        "note": "draft",
    }
    script = {
        "Q-dict": [
            block(
                "print(type(context).__name__, sorted(context))\n"
                "context['rows'][1]['n'] = 1000\ncontext['rows'].append({'city': 'X', 'n': 0})"
            ),
            block("FINAL(sum(r['n'] for r in context['rows']))"),
        ]
    }
    with rlm(tok, sandbox, script) as r:
        res = r.completion("Q-dict", context=ctx)
    assert res.root.turns[0].code_results[0].stdout == "dict ['note', 'rows', 'title']\n"
    assert (res.status, res.answer) == ("finished", "11")  # the in-place change was undone
    system = res.root.turns[0].prompt_text
    chars = describe_context(ctx).total_chars
    assert (
        f"`context` is a dict with 3 keys ('title', 'rows', 'note') of {chars:,} characters as JSON."
        in system
    )
    assert res.root.context_info["type"] == "dict" and res.root.context_info["keys"] == [
        "title",
        "rows",
        "note",
    ]


def test_list_of_documents_stays_a_list(tok, sandbox):
    docs = ["first document", "second", {"id": 3, "text": "a dict document"}]
    script = {"Q-docs": [block("FINAL(f'{type(context).__name__} {len(context)} {context[2][\"id\"]}')")]}
    with rlm(tok, sandbox, script) as r:
        res = r.completion("Q-docs", context=docs)
    assert res.answer == "list 3 3"
    assert (
        "`context` is a list[Any] of" in res.root.turns[0].prompt_text
        and "in 3 items" in res.root.turns[0].prompt_text
    )


def test_several_contexts_are_context_0_1_2(tok, sandbox):
    script = {
        "Q-many": [
            block(
                "print(context is context_0, type(context_1).__name__, context_2['k'])\n"
                "context_1.append('extra')\ncontext_0 = 'gone'"
            ),
            block("FINAL(f'{context_0}|{len(context_1)}|{context is context_0}')"),
        ]
    }
    with rlm(tok, sandbox, script) as r:
        res = r.completion("Q-many", contexts=["alpha text", ["d1", "d2"], {"k": [1, 2]}])
        with pytest.raises(ValueError, match="not both"):
            r.completion("Q-many", context="a", contexts=["b"])
    assert res.root.turns[0].code_results[0].stdout == "True list [1, 2]\n"
    assert res.answer == "alpha text|2|True"
    prompt = res.root.turns[0].prompt_text
    assert "There are 3 contexts, `context_0` ... `context_2` (`context` is `context_0`)" in prompt
    assert "- `context_0` is a str of 10 characters." in prompt
    assert "- `context_1` is a list[str] of 4 characters in 2 items (item lengths: 2, 2)." in prompt
    assert "- `context_2` is a dict with 1 keys ('k')" in prompt
    assert "The contexts are in the REPL variables `context_0`, `context_1`, ..." in prompt
    info = ContextInfo.from_dict(res.root.context_info)
    assert info.type_name == "contexts" and [p.type_name for p in info.parts] == ["str", "list[str]", "dict"]


def test_a_dict_reaches_a_child_agent_as_a_dict(tok, sandbox):
    script = {
        "Q-parent": [block("a = rlm_query('child-dict', {'k': [10, 20]})\nprint(a)"), "FINAL_VAR(a)"],
        "child-dict": [block("FINAL(type(context).__name__ + str(context['k'][1]))")],
    }
    with rlm(tok, sandbox, script, max_depth=1) as r:
        res = r.completion("Q-parent", context="abc")
    assert res.answer == "dict20"
    assert res.trajectories[1].context_info["type"] == "dict"


def test_numpy_values_from_parquet_rows_become_json_values(tok, sandbox):
    """A parquet row's extra_info holds numpy arrays and scalars; the agent (training and inference) passes
    plain lists and numbers to the REPL."""
    script = {
        "Q-np": [
            block('FINAL(f\'{type(context["docs"]).__name__} {context["docs"][1]} {context["n"] + 1}\')')
        ]
    }
    agent = RLMAgent(EngineLLM(scripted_generate(tok, ReplayScript(script)), tok), sandbox)
    ctx = {"docs": np.array(["a", "b"], dtype=object), "n": np.int64(4)}
    res = asyncio.run(agent.run("Q-np", ctx))
    assert res.answer == "list b 5"
