"""The tool-use math environment: turn protocol, the outcome verifier, the agent loop in a real sandbox
(errors, timeouts, empty output and malformed calls become observations; token-exact records), and the env
role on a Ray worker group with group sampling."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest
import ray
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.env_worker import EnvWorker
from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.config import ModelConfig, RolloutConfig
from workers.math_env.agent import MathToolAgent, ToolAgentConfig
from workers.math_env.env_loop import MathToolEnvConfig
from workers.math_env.protocol import parse_action, verify_boxed
from workers.sandbox import ReplSandbox, SandboxConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    "text, kind, detail",
    [
        ("let me compute <python>print(2+3)</python>", "tool", "print(2+3)"),
        ("so the answer is \\boxed{42}.", "answer", "42"),
        ("<python>print(1)", "malformed", "not closed"),
        ("print(1)</python>", "malformed", "without"),
        ("<python>  \n</python>", "malformed", "empty"),
        ("\\boxed{12", "malformed", "closing brace"),
        ("\\boxed{}", "malformed", "empty"),
        ("I think it is 12", "malformed", "No tool call"),
        ("<python>print(7)</python> \\boxed{7}", "tool", "print(7)"),
    ],
)
def test_parse_action(text, kind, detail):
    a = parse_action(text)
    assert a.kind == kind
    assert detail in (a.code if kind == "tool" else a.answer if kind == "answer" else a.problem)


def test_verify_boxed():
    assert verify_boxed("\\boxed{1,234}", 1234) == 1.0
    assert verify_boxed("x \\boxed{5} then \\boxed{-12}", "-12") == 1.0  # the last box counts
    assert verify_boxed("\\boxed{12}", "13") == 0.0
    assert verify_boxed("\\boxed{x+1}", "2") == 0.0
    assert verify_boxed("no box", "2") == 0.0
    assert verify_boxed("\\boxed{0.5}", "0.5000000001") == 1.0


@pytest.fixture(scope="module")
def tokenizer():
    from workers.models import load_tokenizer
    from workers.models.tiny import ensure_tiny_model

    return load_tokenizer(ensure_tiny_model("nano"))


def test_agent_turns_errors_timeouts_and_corrections_become_observations(tokenizer):
    turns = [
        "<python>x = 1234 + 5678\nprint(x)</python>",  # output
        "<python>y = x * 2</python>",  # no output: a hint to print
        "<python>print(1/0)",  # unclosed: format correction, nothing runs
        "<python>1/0</python>",  # error
        "<python>while True:\n    pass</python>",  # timeout: REPL restarted
        "<python>print(x)</python>",  # x is gone after the restart: NameError
        "The sum is \\boxed{6912}",
    ]
    policy = EngineLLM(
        scripted_generate(tokenizer, ReplayScript({"PROBLEM": turns}), log_prob=-0.25), tokenizer
    )
    sandbox = ReplSandbox(SandboxConfig(timeout_s=10))
    cfg = ToolAgentConfig(max_turns=10, max_new_tokens=64, exec_timeout_s=1.0)
    try:
        traj = asyncio.run(MathToolAgent(policy, sandbox, cfg).run("PROBLEM", uid="u", traj_id="u.0", seed=3))
    finally:
        sandbox.close()
    assert traj.status == "finished" and traj.final_answer == "\\boxed{6912}"
    steps = traj.metadata["steps"]
    assert [s["kind"] for s in steps] == ["tool", "tool", "malformed", "tool", "tool", "tool", "answer"]
    obs = [s["observation"] for s in steps]
    assert "6912" in obs[0] and obs[0].startswith("Output:")
    assert obs[1].startswith("No output")
    assert obs[2].startswith("Format error") and "not closed" in obs[2]
    assert "ZeroDivisionError" in obs[3]
    assert obs[4].startswith("Timed out")
    assert "NameError" in obs[5]
    assert obs[6] == ""
    assert traj.metadata["tool"] == {
        "tool_calls": 5, "tool_errors": 2, "timeouts": 1, "malformed": 1, "empty_output": 1
    }  # fmt: skip
    # token-exact: each turn's tokens are exactly what the policy produced; observations are masked
    ids, mask, lps = traj.token_sequence()
    n_model = sum(len(t.response_token_ids) for t in traj.turns)
    assert sum(mask) == n_model and all(lp == -0.25 for lp, m in zip(lps, mask) if m)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "Output:\n6912" in text and "Format error" in text
    batch = trajectories_to_dataproto([traj], max_prompt_length=128, max_response_length=1024, pad_token_id=0)
    assert int(batch.batch["response_mask"].sum()) == n_model


def test_agent_stops_at_max_turns(tokenizer):
    policy = EngineLLM(scripted_generate(tokenizer, lambda _: "hmm"), tokenizer)
    sandbox = ReplSandbox(SandboxConfig(timeout_s=5))
    try:
        traj = asyncio.run(MathToolAgent(policy, sandbox, ToolAgentConfig(max_turns=2)).run("Q"))
    finally:
        sandbox.close()
    assert traj.status == "max_iterations" and len(traj.turns) == 2 and traj.final_answer is None
    assert all(s["kind"] == "malformed" for s in traj.metadata["steps"])


class Script:
    def __init__(self, by_query):
        self.by_query = by_query

    def __call__(self, tokenizer):
        return scripted_generate(tokenizer, ReplayScript(self.by_query))


def test_env_group_group_sampling(ray_session):
    from workers.models.tiny import ensure_tiny_model

    problems = {
        "Compute 111 + 222.": ["<python>print(111 + 222)</python>", "\\boxed{333}"],
        "Say 5.": ["\\boxed{5}"],
    }
    env = MathToolEnvConfig(agent=ToolAgentConfig(max_turns=3), sandbox=SandboxConfig(timeout_s=5))
    pool = ResourcePool([1], name="test_math_env_pool")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(
            EnvWorker,
            model=ModelConfig(path=ensure_tiny_model("nano")),
            rollout=RolloutConfig(n=1, prompt_length=96, response_length=128),
            env=env,
            policy_factory=Script(problems),
        ),
        name_prefix="math_env",
    )
    try:
        wg.init_model()
        qs = list(problems)
        col = np.empty(2, dtype=object)
        col[:] = [[{"role": "user", "content": q}] for q in qs]
        uid = np.array(["a", "b"], dtype=object)
        data = DataProto.from_dict(
            non_tensors={"raw_prompt": col, "uid": uid, "data_source": np.array(["s", "s"], dtype=object)}
        )
        data.meta_info.update(n=2, seed=5)
        out = wg.generate_sequences(data)
    finally:
        wg.close_env()
        wg.shutdown()
        pool.remove()
    nt = out.non_tensor_batch
    assert list(nt["uid"]) == ["a", "a", "b", "b"] and list(nt["data_source"]) == ["s"] * 4
    assert list(nt["answer"]) == ["\\boxed{333}"] * 2 + ["\\boxed{5}"] * 2
    steps = json.loads(nt["steps"][0])
    assert [s["kind"] for s in steps] == ["tool", "answer"] and "333" in steps[0]["observation"]
    assert out.batch["responses"].shape == (4, 128) and out.batch["prompts"].shape == (4, 96)
    m = out.meta_info["metrics"]
    assert m["tool/finished_frac"] == 1.0 and m["tool/calls/mean"] == 0.5 and m["tool/turns/mean"] == 1.5
    # two model turns on row 0 -> two runs of ones in the loss mask
    from algorithms.hybrid import step_index_from_mask

    assert int(step_index_from_mask(out.batch["response_mask"])[0].max()) == 1
    assert torch.all(out.batch["response_mask"][2:].sum(-1) > 0)
