"""A final answer when the turns run out, as rlms gives one: through ``RLM()`` (on by default) one more model turn
asks for the answer -- a FINAL line, a FINAL_VAR resolved in the REPL, or the plain reply -- recorded token-exactly
like every turn (a scripted policy behind a recording engine function); the status stays "max_iterations". Off by
default in ``AgentConfig`` (training keeps its trajectories as before), and off on request."""

from __future__ import annotations

import asyncio

import pytest
from rlm_testlib import block

from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rlm.inference import RLM

pytestmark = pytest.mark.timeout(120)


def recording(gen):
    calls = []

    async def rec(ids, params):
        out = await gen(ids, params)
        calls.append((list(ids), out))
        return out

    return rec, calls


def test_forced_final_answer_is_a_real_recorded_turn(tok, sandbox):
    # two turns of work, no answer; the third reply (to "your turns are spent") answers with a REPL variable
    script = ReplayScript({"Q": [block("x = 6 * 7"), block("print(x)"), "I am done.\nFINAL_VAR(x)"]})
    gen, calls = recording(scripted_generate(tok, script, tokenization="chars"))
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=2) as rlm:
        res = rlm.completion("Q", context="c")
    root = res.root
    assert (res.status, res.answer, len(root.turns)) == ("max_iterations", "42", 3)
    last = root.turns[-1]
    assert last.timings["forced_final"] == 1.0 and "forced_final" not in root.turns[1].timings
    assert (
        "Your turns are spent" in last.prompt_text and "[REPL block 1/1" in last.prompt_text
    )  # with the output
    assert last.final.var_name == "x" and last.usage["completion_tokens"] == len(last.response_token_ids) > 0
    # token-exact: the extra turn is an engine call like the others, and the sequence ends with it
    assert len(calls) == 3
    ids, mask, _ = root.token_sequence()
    assert ids == calls[-1][0] + calls[-1][1].token_ids
    assert [t for t, m in zip(ids, mask) if m] == [t for _, out in calls for t in out.token_ids]
    assert res.usage.total.calls == 3


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("FINAL(forty-two)", "forty-two"),
        (block("FINAL(str(6 * 7))"), "42"),  # the reply's code runs, as in any turn
        ("The answer is 42.", "The answer is 42."),  # neither: the reply's text outside code, as rlms does
    ],
)
def test_forced_final_answer_forms(tok, sandbox, reply, answer):
    script = ReplayScript({"Q": [block("print('working')"), reply]})
    with RLM(engine=scripted_generate(tok, script), tokenizer=tok, sandbox=sandbox, max_iterations=1) as rlm:
        res = rlm.completion("Q", context="c")
    assert (res.status, res.answer, len(res.root.turns)) == ("max_iterations", answer, 2)


def test_a_child_that_runs_out_answers_its_parent(tok, sandbox):
    script = ReplayScript(
        {
            "Q": [block("r = rlm_query('child-Q')\nprint(r)"), "FINAL_VAR(r)"],
            "child-Q": [block("y = 'from child'"), "FINAL_VAR(y)"],
        }
    )
    cfg = AgentConfig(max_iterations=3, child_max_iterations=1, final_answer_on_exhaustion=True)
    with RLM(engine=scripted_generate(tok, script), tokenizer=tok, sandbox=sandbox, agent_config=cfg) as rlm:
        res = rlm.completion("Q", context="c")
    child = res.trajectories[1]
    assert (child.status, child.final_answer, len(child.turns)) == ("max_iterations", "from child", 2)
    assert (res.status, res.answer) == ("finished", "from child")


def test_off_for_training_and_on_request(tok, sandbox):
    script = ReplayScript({"Q": [block("print('working')"), "FINAL(late)"]})
    # AgentConfig (what training builds) leaves it off: the trajectory ends as before, without an answer
    agent = RLMAgent(EngineLLM(scripted_generate(tok, script), tok), sandbox, AgentConfig(max_iterations=1))
    res = asyncio.run(agent.run("Q", "c"))
    assert (res.root.status, res.root.final_answer, len(res.root.turns)) == ("max_iterations", None, 1)
    gen = scripted_generate(tok, script)
    # an agent_config is used as given: AgentConfig's own default leaves the extra turn off
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=1, agent_config=AgentConfig()) as rlm:
        res = rlm.completion("Q", context="c")
    assert (res.status, res.answer, len(res.root.turns)) == ("max_iterations", None, 1)


def test_a_spent_budget_skips_the_extra_turn(tok, sandbox):
    script = ReplayScript({"Q": [block("print('working')"), "FINAL(late)"]})
    gen = scripted_generate(tok, script)
    agent = AgentConfig(max_total_tokens=10, final_answer_on_exhaustion=True)
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=1, agent_config=agent) as rlm:
        res = rlm.completion("Q", context="c")
    assert (res.status, res.answer, len(res.root.turns)) == ("max_iterations", None, 1)
    assert res.root.error.startswith("no extra turn for a final answer: total-token budget of 10")
