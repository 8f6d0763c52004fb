"""The one-file example environment (``workers.agents.examples.word_count``) through the agent layer: the env
worker's ``generate_sequences`` on a real worker group (scripted policy), the reference replay, and how
``env.loop`` finds a plugin."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from recipes.config import load_config
from resource_pools import ResourcePool
from workers.agents.env_worker import EnvWorker
from workers.agents.examples import word_count
from workers.agents.examples.word_count import WordCountEnvConfig, WordCountLoop
from workers.agents.loop import AgentLoop, agent_loop_class, register_agent_loop
from workers.agents.replay import reference_batch
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.config import ModelConfig, RolloutConfig
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)

TURNS = {
    "How many words: red green blue": ["<count>red green blue</count>", "ANSWER: 3"],
    "How many words: one": ["ANSWER: 1"],
}


class Script:
    def __call__(self, tokenizer):
        return scripted_generate(tokenizer, ReplayScript(TURNS))


def _generate_on_a_worker_group(env) -> DataProto:
    """The two scripted questions, two samples each, through an ``EnvWorker`` group of the environment ``env``."""
    pool = ResourcePool([1], name="test_word_count_pool")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(
            EnvWorker,
            model=ModelConfig(path=ensure_tiny_model("nano")),
            rollout=RolloutConfig(n=1, prompt_length=128, response_length=64),
            env=env,
            policy_factory=Script(),
        ),
        name_prefix="word_count",
    )
    try:
        wg.init_model()
        prompts = np.empty(2, dtype=object)
        prompts[:] = [[{"role": "user", "content": q}] for q in TURNS]
        data = DataProto.from_dict(
            non_tensors={
                "raw_prompt": prompts,
                "uid": np.array(["a", "b"], dtype=object),
                "tag": np.array([7, 8]),
            }
        )
        data.meta_info.update(n=2, seed=3)
        return wg.generate_sequences(data)
    finally:
        wg.close_env()
        wg.shutdown()
        pool.remove()


def test_word_count_env_on_a_worker_group(ray_session):
    out = _generate_on_a_worker_group(WordCountEnvConfig())
    nt, b = out.non_tensor_batch, out.batch
    assert list(nt["uid"]) == ["a", "a", "b", "b"] and list(nt["tag"]) == [7, 7, 8, 8]  # input columns copied
    assert list(nt["answer"]) == ["3", "3", "1", "1"] and set(nt["status"]) == {"finished"}
    assert list(nt["num_turns"]) == [2, 2, 1, 1]
    assert b["responses"].shape == (4, 64) and b["prompts"].shape == (4, 128) and set(nt["truncated"]) == {""}
    # the observation "3 words" sits between the two model turns with loss mask 0
    mask = b["response_mask"][0]
    assert mask[0] == 1 and 0 in mask[: int(b["attention_mask"][0, 128:].sum())].tolist()
    m = out.meta_info["metrics"]
    assert m["wc/finished_frac"] == 1.0 and m["wc/calls/mean"] == 0.5 and "timing_s/gen" in m


def test_a_users_env_file_runs_on_a_worker_group(ray_session, tmp_path, monkeypatch):
    """``env.loop=envs/my_count.py:MyCountLoop``: a user's copy of the example in a folder on no ``sys.path``
    (neither the driver's nor the Ray workers', which started elsewhere), named by a path relative to the current
    directory. The recipe config check imports it (its ``@dataclass`` config under ``from __future__ import
    annotations``) and makes the path absolute; the env worker imports it by that path, and the config object of
    the file's class reaches the worker by value."""
    source = Path(word_count.__file__).read_text().replace("WordCount", "MyCount")
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "my_count.py").write_text(source.replace('"count_calls"', '"my_count_calls"'))
    monkeypatch.chdir(tmp_path)
    env = load_config("rlm", ["env.loop=envs/my_count.py:MyCountLoop", "env.agent.max_turns=2"]).env
    assert (
        env.loop == f"{tmp_path / 'envs' / 'my_count.py'}:MyCountLoop"
        and type(env).__name__ == "MyCountEnvConfig"
    )
    out = _generate_on_a_worker_group(env)
    nt = out.non_tensor_batch
    assert list(nt["answer"]) == ["3", "3", "1", "1"] and set(nt["status"]) == {"finished"}
    calls = [json.loads(t)["metadata"]["my_count_calls"] for t in nt["trajectory"]]  # the file's own loop ran
    assert calls == [1, 1, 0, 0]


def test_word_count_reference_replay():
    rows = [
        {"extra_info": {"question": q, "reference_turns": turns}, "data_source": "x", "reward_model": {}}
        for q, turns in TURNS.items()
    ]
    tok = load_tokenizer(ensure_tiny_model("nano"))
    batch = reference_batch(rows, tok, WordCountEnvConfig())
    assert list(batch.non_tensor_batch["answer"]) == ["3", "1"]
    assert (batch.batch["response_mask"].sum(-1) > 0).all()


def test_env_loop_names_a_plugin():
    assert agent_loop_class("workers.agents.examples.word_count:WordCountLoop") is WordCountLoop
    assert (
        agent_loop_class("rlm").__name__ == "RLMLoop"
        and agent_loop_class("math_tool").__name__ == "MathToolLoop"
    )
    register_agent_loop("word_count_test", WordCountLoop)
    assert agent_loop_class("word_count_test") is WordCountLoop
    with pytest.raises(ValueError, match="unknown agent loop"):
        agent_loop_class("nope")
    with pytest.raises(TypeError, match="not an AgentLoop"):
        agent_loop_class("workers.agents.examples.word_count:WordCountEnvConfig")
    assert issubclass(WordCountLoop, AgentLoop)
