"""``env.loop: openai_agent`` (``workers.agents.openai_agent``): a user's agent program, written against the
``openai`` client (a function, or a command run as a subprocess), runs once per trajectory against the endpoint;
what it returns is the answer, what its calls fed and produced are the turns. A failing agent fails its own
trajectory with the reason, never the run; one that makes no call is reported. A scripted policy stands in for
the model (it answers "ANSWER: 3" to everything)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from workers.agents import openai_agent
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentJob, LoopContext
from workers.agents.openai_agent import OpenAIAgentConfig, OpenAIAgentEnvConfig, OpenAIAgentLoop
from workers.agents.scripted import scripted_generate
from workers.event_loop import LoopThread
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model

AGENTS = """
import asyncio

async def answers(client, row):
    r = await client.chat.completions.create(model=row["model"], messages=row["messages"], temperature=0.1)
    text = r.choices[0].message.content
    r2 = await client.chat.completions.create(
        model=row["model"], messages=row["messages"] + [r.choices[0].message.model_dump(exclude_none=True),
                                                        {"role": "user", "content": "Sure?"}])
    return text.split(":")[1].strip() + "/" + str(row["sample"])

async def raises(client, row):
    await client.chat.completions.create(model=row["model"], messages=row["messages"])
    raise KeyError("no such tool")

async def silent(client, row):
    return "42"

async def slow(client, row):
    await asyncio.sleep(30)

def not_async(client, row):
    return "x"
"""

COMMAND = """
import json, os, sys
from openai import OpenAI
row = json.load(sys.stdin)
assert row == json.loads(os.environ["HYFLOW_ROW"])
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=row["messages"])
print("thinking...")
print(r.choices[0].message.content.split(":")[1].strip())
if row["sample"] == 1:
    sys.exit("the agent gave up")
"""


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_tiny_model("nano"))


@pytest.fixture
def agents(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    script = tmp_path / "agent_cmd.py"
    script.write_text(COMMAND)
    return str(path), str(script)


def run_jobs(tok, env: OpenAIAgentEnvConfig, n: int):
    policy = EngineLLM(scripted_generate(tok, lambda prompt: "ANSWER: 3"), tok)
    loop = OpenAIAgentLoop(env, LoopContext(policy, None, tok))
    thread = LoopThread()
    jobs = [
        AgentJob(
            0,
            k,
            "How many?",
            {"index": 0},
            "u",
            f"u.{k}",
            seed=k,
            messages=[{"role": "user", "content": "How many?"}],
        )
        for k in range(n)
    ]
    try:

        async def all_jobs():
            return await asyncio.gather(*(loop.run(job, env.agent) for job in jobs))

        runs = thread.run(all_jobs())
        metrics = loop.metrics(runs, 1.0, None)
        url = next(iter(openai_agent._GATEWAYS.values())).gateway.url
        loop.close()
        assert not openai_agent._GATEWAYS  # the last user stopped the endpoint
        return [r[0] for r in runs], metrics, url
    finally:
        thread.stop()


def test_an_agent_function_runs_per_trajectory_and_its_calls_are_its_turns(tok, agents):
    env = OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(program=f"{agents[0]}:answers", temperature=0.8))
    trajs, metrics, url = run_jobs(tok, env, 3)
    assert [t.final_answer for t in trajs] == ["3/0", "3/1", "3/2"] and {t.status for t in trajs} == {
        "finished"
    }
    for t in trajs:  # two calls, the second continuing the first token for token
        assert len(t.turns) == 2 and not t.rewritten and t.metadata["calls"] == 2
        assert t.turns[0].response_text == "ANSWER: 3" and "Sure?" in t.turns[1].prompt_text
    assert metrics["agent/finished_frac"] == 1.0 and metrics["agent/calls/mean"] == 2.0
    import httpx

    with pytest.raises(httpx.ConnectError):  # closed: nothing listens any more
        httpx.get(url + "/v1/models")


def test_a_failing_agent_fails_its_own_trajectory_with_the_reason(tok, agents):
    cases = {"raises": "KeyError", "silent": "no_call", "slow": "timeout"}
    for name, reason in cases.items():
        env = OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(program=f"{agents[0]}:{name}", timeout_s=1.0))
        (traj,), metrics, _ = run_jobs(tok, env, 1)
        assert traj.status == "error" and traj.metadata["agent_failure"] == reason, traj.error
        assert metrics["agent/error_frac"] == 1.0 and metrics[f"agent/error/{reason}"] == 1.0


def test_an_agent_command_runs_as_a_subprocess_with_the_openai_environment(tok, agents):
    env = OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(command=[sys.executable, agents[1]]))
    trajs, metrics, _ = run_jobs(tok, env, 2)
    assert trajs[0].status == "finished" and trajs[0].final_answer == "3" and len(trajs[0].turns) == 1
    assert trajs[1].status == "error" and "the agent gave up" in trajs[1].error
    assert metrics["agent/error/RuntimeError"] == 0.5


def test_config_errors_name_the_key(agents):
    errors: list[str] = []
    OpenAIAgentEnvConfig().check(errors)  # the recipe's check before Ray starts
    assert errors == [
        "env.agent.program (an 'async def agent(client, row)' as 'file.py:agent') or env.agent.command (a program "
        "run per trajectory) is required with env.loop=openai_agent"
    ]
    with pytest.raises(ValueError, match=r"env.agent.program .* or env.agent.command .* is required"):
        OpenAIAgentLoop(OpenAIAgentEnvConfig(), None)
    with pytest.raises(ValueError, match="one of program and command"):
        OpenAIAgentConfig(program=f"{agents[0]}:answers", command=["x"])
    with pytest.raises(ValueError, match=r"env.agent.program=.*must be an 'async def agent\(client, row\)'"):
        OpenAIAgentConfig(program=f"{agents[0]}:not_async")
    with pytest.raises(ValueError, match=r"env.agent.program=.*has no 'missing'"):
        OpenAIAgentConfig(program=f"{agents[0]}:missing")
    # the default endpoint listens on localhost only
    assert (
        OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(program=f"{agents[0]}:answers")).server.host
        == "127.0.0.1"
    )


def test_the_error_reason_text(tok, agents):
    env = OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(program=f"{agents[0]}:silent"))
    (traj,), _, url = run_jobs(tok, env, 1)
    assert (
        traj.error == f"the agent made no model call through its client (base_url {url}/trajectories/u.0/v1)"
    )
    assert (
        traj.final_answer == "42" and not traj.turns
    )  # answered without the model: nothing to train, reported
