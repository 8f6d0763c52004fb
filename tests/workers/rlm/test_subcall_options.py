"""rlm_query(..., literal=True) (SkyRL parses a child's answer into a Python value) and
RLM(agent_config=AgentConfig(max_concurrent_subcalls=n)) (rlms caps sub-calls in flight), through the public RLM() API with a scripted
policy, a real sandbox and a slow sub-LM that counts its calls in flight."""

from __future__ import annotations

import asyncio

import pytest
from rlm_testlib import block

from workers.agents.llm import ChatLLM, Completion
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM


def test_rlm_query_literal_gives_the_parent_a_value(tok, sandbox):
    parent = [
        block(
            "v = rlm_query('list them', context='a b', literal=True)\n"
            "s = rlm_query('list them', context='a b')\n"
            "w = rlm_query_batched(['say hi'], literal=True)\n"
            "print(type(v).__name__, v[1] + 1, type(s).__name__, w)"
        ),
        "FINAL(done)",
    ]
    script = ReplayScript({"Q": parent, "list them": ["FINAL([1, 2])"], "say hi": ["FINAL(hello there)"]})
    with RLM(scripted_generate(tok, script), tokenizer=tok, sandbox=sandbox, max_depth=1) as rlm:
        res = rlm.completion("Q", context="ctx")
    out = res.root.turns[0].code_results[0]
    assert out.error is None, out.error
    # a literal answer becomes a value; prose stays a string; without literal=True the answer is the string
    assert out.stdout.strip() == "list 3 str ['hello there']"
    assert res.answer == "done"


class SlowChat(ChatLLM):
    """A sub-LM that takes 50 ms per call and records how many calls were in flight at once."""

    def __init__(self):
        super().__init__(self._chat, name="slow")
        self.in_flight = 0
        self.most = 0

    async def _chat(self, messages, **kw):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        return Completion("ok", 1, 1, "slow")


@pytest.mark.parametrize("cap, expected", [(2, 2), (None, 6)])
def test_max_concurrent_subcalls_caps_calls_in_flight(tok, sandbox, cap, expected):
    turns = [block("r = llm_query_batched(['p'] * 6)\nprint(len(r), set(r))"), "FINAL(x)"]
    sub = SlowChat()
    rlm = RLM(
        scripted_generate(tok, ReplayScript({"Q": turns})),
        sub_engine=sub,
        tokenizer=tok,
        sandbox=sandbox,
        agent_config=AgentConfig(max_concurrent_subcalls=cap, final_answer_on_exhaustion=True),
    )
    with rlm:
        res = rlm.completion("Q", context="c")
    assert res.root.turns[0].code_results[0].stdout.strip() == "6 {'ok'}"
    assert sub.most == expected


def test_max_concurrent_subcalls_must_be_positive(tok):
    with pytest.raises(ValueError, match="max_concurrent_subcalls must be >= 1"):
        RLM(
            scripted_generate(tok, ReplayScript({})),
            tokenizer=tok,
            agent_config=AgentConfig(max_concurrent_subcalls=0),
        )
