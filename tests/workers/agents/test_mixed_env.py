"""Several environments in one batch (``env.loop: mixed``, ``workers.agents.mixed``): the env worker (in this
process, a scripted policy) runs each row in the environment its ``env_name`` names -- the RLM REPL, the math
tool and the word-count example --, keeps the rows' order, merges their columns and reports each one's metrics
as ``env/<name>/...``; an unknown name is an error naming the row; the replay replays each row through its own
environment; the config refuses what a mixed env cannot do."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dataproto import DataProto
from workers.agents.env_worker import EnvWorker
from workers.agents.examples.word_count import WordCountAgentConfig, WordCountEnvConfig
from workers.agents.loop import AgentJob, agent_loop_class
from workers.agents.mixed import MixedEnvConfig, MixedLoop
from workers.agents.replay import reference_batch
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import Trajectory
from workers.config import ModelConfig, RolloutConfig
from workers.math_env.agent import ToolAgentConfig
from workers.math_env.env_loop import MathToolEnvConfig
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig
from workers.rlm.env_loop import RLMEnvConfig
from workers.sandbox import SandboxConfig

pytestmark = pytest.mark.timeout(240)

F = "```"
RLM_Q = "What is the magic number in the context?"
TOOL_Q = "Compute 1234 + 4321."
WC_Q = "How many words: red green blue"
WC_Q1 = "How many words: one"
TURNS = {
    RLM_Q: [f"{F}repl\nimport re\nprint(re.findall(r'\\d+', context))\n{F}", f"{F}repl\nFINAL('4711')\n{F}"],
    TOOL_Q: ["<python>print(1234 + 4321)</python>", "\\boxed{5555}"],
    WC_Q: ["<count>red green blue</count>", "ANSWER: 3"],
    WC_Q1: ["ANSWER: 1"],
}
# batch rows: (env_name, query, extra_info); the order interleaves the environments
ROWS = [
    ("word_count", WC_Q, {}),
    ("rlm", RLM_Q, {"context": "filler text; the magic number is 4711; more filler"}),
    ("tool_math", TOOL_Q, {}),
    ("word_count", WC_Q1, {}),
]


def mixed_env(**kw) -> MixedEnvConfig:
    return MixedEnvConfig(
        envs={
            "rlm": RLMEnvConfig(agent=AgentConfig(max_iterations=3, max_depth=0)),
            "tool_math": MathToolEnvConfig(agent=ToolAgentConfig(max_turns=3, max_new_tokens=48)),
            "word_count": WordCountEnvConfig(agent=WordCountAgentConfig(max_turns=3)),
        },
        **kw,
    )


def env_worker(env: MixedEnvConfig) -> EnvWorker:
    w = EnvWorker(
        ModelConfig(path=ensure_tiny_model("nano")),
        RolloutConfig(n=2, prompt_length=1024, response_length=512),
        env,
        policy_factory=lambda tok: scripted_generate(tok, ReplayScript(TURNS)),
    )
    w.init_model()
    return w


def batch(rows=ROWS, with_names: bool = True) -> DataProto:
    col = lambda v: np.array(v, dtype=object)  # noqa: E731
    nt = {
        "raw_prompt": col([[{"role": "user", "content": q}] for _, q, _ in rows]),
        "extra_info": col([e for _, _, e in rows]),
        "uid": col([f"u{i}" for i in range(len(rows))]),
        "data_row": col([f"row {i} of mixed.parquet" for i in range(len(rows))]),
    }
    if with_names:
        nt["env_name"] = col([name for name, _, _ in rows])
    data = DataProto.from_dict(non_tensors=nt)
    data.meta_info.update(n=2, seed=5)
    return data


def test_each_row_runs_in_its_own_environment_in_order():
    w = env_worker(mixed_env())
    try:
        out = w.generate_sequences(batch())
        loop = w._agent_loop
        assert isinstance(loop, MixedLoop)
        # the RLM and word-count envs use the worker's sandbox (the top-level config); the math tool's differs
        # (echo_last_expr) and gets its own
        assert (
            loop.loops["rlm"].ctx.sandbox is w._sandbox and loop.loops["word_count"].ctx.sandbox is w._sandbox
        )
        assert loop.loops["tool_math"].ctx.sandbox is not w._sandbox and len(loop._sandboxes) == 1
        assert loop.loops["tool_math"].ctx.sandbox.config.echo_last_expr
    finally:
        w.close_env()
    nt = out.non_tensor_batch
    # rows keep the batch's order, n=2 samples each
    assert list(nt["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2", "u3", "u3"]
    assert list(nt["env_name"]) == ["word_count"] * 2 + ["rlm"] * 2 + ["tool_math"] * 2 + ["word_count"] * 2
    assert list(nt["answer"]) == ["3", "3", "4711", "4711", "\\boxed{5555}", "\\boxed{5555}", "1", "1"]
    assert set(nt["status"]) == {"finished"} and list(nt["num_turns"]) == [2, 2, 2, 2, 2, 2, 1, 1]
    assert list(nt["data_row"])[2] == "row 1 of mixed.parquet"  # input columns copied to their rows
    # each environment ran its own protocol: the math tool's steps column (its rows only), the RLM's REPL saw
    # the row's context, the word-count tool counted
    steps = [json.loads(s) if s else None for s in nt["steps"]]
    assert steps[:4] == [None] * 4 and steps[6:] == [None] * 2
    assert [s["kind"] for s in steps[4]] == ["tool", "answer"] and "5555" in steps[4][0]["observation"]
    rlm_traj = json.loads(nt["trajectory"][2])
    assert rlm_traj["metadata"]["env_name"] == "rlm" and "4711" in rlm_traj["turns"][1]["prompt_text"]
    assert "Count the words" in json.loads(nt["trajectory"][0])["turns"][0]["prompt_text"]
    # metrics per environment, on its own trajectories: env/<name>/<the loop's metric>
    m = out.meta_info["metrics"]
    assert (m["env/rlm/rows"], m["env/tool_math/rows"], m["env/word_count/rows"]) == (2.0, 2.0, 4.0)
    assert m["env/word_count/num_trajectories"] == 4.0 and m["env/rlm/num_trajectories"] == 2.0
    assert m["env/rlm/env/num_roots"] == 2.0 and m["env/rlm/env/finished_frac"] == 1.0
    assert m["env/rlm/env/turns/mean"] == 2.0
    assert m["env/tool_math/tool/calls/mean"] == 1.0 and m["env/tool_math/tool/status/finished"] == 2.0
    assert m["env/word_count/wc/calls/mean"] == 0.5 and m["env/word_count/wc/finished_frac"] == 1.0
    assert not any(k.startswith("env/") and "/timing_s/" in k for k in m) and "timing_s/gen" in m
    # the RLM's response length is measured on its own rows
    P = out.batch["prompts"].shape[1]
    rlm_len = float(out.batch["attention_mask"][2:4, P:].sum(-1).float().mean())
    assert m["env/rlm/env/response_length/mean"] == pytest.approx(rlm_len)


def test_unknown_env_name_is_an_error_naming_the_row():
    w = env_worker(mixed_env())
    try:
        rows = [ROWS[0], ("word_cnt", WC_Q1, {})]
        with pytest.raises(
            ValueError,
            match=r"batch row 1 \(row 1 of mixed.parquet\): env_name 'word_cnt' is not "
            r"one of \['rlm', 'tool_math', 'word_count'\]",
        ):
            w.generate_sequences(batch(rows))
        # rows without a name: refused with env.default ""
        with pytest.raises(
            ValueError, match="env_name '' is not one of .*rows without an env_name are refused"
        ):
            w.generate_sequences(batch(ROWS[:1], with_names=False))
    finally:
        w.close_env()
    # the loop refuses it too when it is called directly
    loop = MixedLoop.__new__(MixedLoop)
    loop.env, loop.loops = mixed_env(), {"rlm": None}
    with pytest.raises(ValueError, match=r"row 3: env_name 'nope' is not one of env.envs \['rlm'\]"):
        loop.env_of(AgentJob(3, 0, "q", {}, "u", "t", env_name="nope"))


def test_default_env_runs_the_rows_without_a_name():
    w = env_worker(mixed_env(default="word_count"))
    try:
        out = w.generate_sequences(batch([ROWS[0], ROWS[3]], with_names=False))
    finally:
        w.close_env()
    assert list(out.non_tensor_batch["env_name"]) == ["word_count"] * 4
    assert list(out.non_tensor_batch["answer"]) == ["3", "3", "1", "1"]
    assert (
        out.meta_info["metrics"]["env/word_count/rows"] == 4.0
        and "env/rlm/rows" not in out.meta_info["metrics"]
    )


def test_reference_replay_runs_each_row_in_its_environment():
    tok = load_tokenizer(ensure_tiny_model("nano"))
    rows = [
        {
            "env_name": name,
            "extra_info": {"question": q, "reference_turns": TURNS[q], **extra},
            "data_source": {"rlm": "exact_match", "tool_math": "hyflow/arithmetic"}.get(name, "word_count"),
            "reward_model": {"ground_truth": {"rlm": "4711", "tool_math": "5555"}.get(name, "3")},
        }
        for name, q, extra in ROWS
    ]
    out = reference_batch(rows, tok, mixed_env())
    # every row kept, in row order
    assert list(out.non_tensor_batch["answer"]) == ["3", "4711", "\\boxed{5555}", "1"]
    assert (out.batch["response_mask"].sum(-1) > 0).all()
    with pytest.raises(ValueError, match="reference replay, row 1: env_name 'nope' is not one of env.envs"):
        reference_batch([rows[0], {**rows[1], "env_name": "nope"}], tok, mixed_env())


def test_reference_hooks_and_config_route_per_env():
    env = mixed_env()
    loop = MixedLoop.__new__(MixedLoop)
    loop.env = env
    loop.loops = {name: agent_loop_class(sub.loop)(sub, None) for name, sub in env.envs.items()}
    settings = {"do_sample": True, "temperature": 0.5, "top_p": 1.0, "top_k": -1}
    config = loop.agent_config(settings, 300)
    assert config["rlm"].temperature == 0.5 and config["word_count"].max_sequence_tokens == 300
    ref = loop.reference_config(config, 5)
    assert ref["tool_math"].max_turns == 5 and ref["tool_math"].max_new_tokens == 1024  # MathToolLoop's
    assert ref["rlm"].max_new_tokens == 4096 and ref["word_count"] == config["word_count"]
    root = Trajectory(id="t", query="q", status="finished", final_answer="12")
    row = {"data_source": "exact_match", "reward_model": {"ground_truth": "13"}}
    assert loop.keep_reference(replace(root, metadata={"env_name": "word_count"}), row)  # finished is enough
    assert not loop.keep_reference(replace(root, metadata={"env_name": "rlm"}), row)  # the RLM's: also right


def test_config_refuses_what_a_mixed_env_cannot_do():
    with pytest.raises(ValueError, match="envs is empty"):
        MixedEnvConfig()
    with pytest.raises(
        ValueError, match=r"default='nope' is not one of the envs \['rlm', 'tool_math', 'word_count'\]"
    ):
        mixed_env(default="nope")
    with pytest.raises(
        ValueError, match=r"envs.rlm.step_wise=True: the rows of a mixed batch take env.step_wise"
    ):
        MixedEnvConfig(envs={"rlm": RLMEnvConfig(step_wise=True)})
    with pytest.raises(
        ValueError, match="envs.inner.loop='mixed': a mixed environment cannot hold another one"
    ):
        MixedEnvConfig(envs={"inner": mixed_env()})
    with pytest.raises(ValueError, match="envs.a/b is not a usable env name"):
        MixedEnvConfig(envs={"a/b": WordCountEnvConfig()})
    # a sub-env keeps its own sandbox; the names a row may carry
    env = mixed_env(sandbox=SandboxConfig(timeout_s=7.0))
    assert env.env_names() == ("rlm", "tool_math", "word_count")
    assert mixed_env(default="rlm").env_names() == ("rlm", "tool_math", "word_count", "")
    assert (
        env.env_config("tool_math") is env.envs["tool_math"]
        and mixed_env(default="rlm").env_config("").loop == "rlm"
    )
    # one environment: rows named "" or its own env.loop
    assert RLMEnvConfig().env_names() == ("", "rlm") and RLMEnvConfig().env_config("rlm").loop == "rlm"
    with pytest.raises(ValueError, match=r"env_name 'tool_math' is not one of \['', 'rlm'\]"):
        RLMEnvConfig().env_config("tool_math")
    assert agent_loop_class("mixed") is MixedLoop
