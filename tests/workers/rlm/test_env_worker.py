"""The RLM env role on real worker groups (Ray, CPU): DP dispatch of prompts with group sampling, many
trajectories per worker, the task generators' reference solutions replayed through real sandboxes and
scored by the long-context scorers, sub-calls and children as rows, and the real engine path in the
colocated actor-rollout worker (its multi-turn batch is scored by the trainer with the same log-probs,
and weights reach the rollout replica by ``sync_weights``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
from dataproto import DataProto
from recipes.tasks import generate_splits
from resource_pools import ResourcePool
from workers.agents.env_worker import EnvWorker, env_role
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import OptimConfig
from workers.reward.long_context import score_oolong, score_sniah
from workers.rlm.agent import AgentConfig
from workers.rlm.env_loop import RLMEnvConfig
from workers.rlm.prompts import PromptConfig
from workers.roles import hybrid_roles
from workers.sandbox import SandboxConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)

F = "```"
SUB_SCRIPT = {
    "Q-sub": [
        f"{F}repl\nfirst = llm_query('summarise: ' + context[:5])\n"
        f"parts = rlm_query_batched(['child-A', 'child-B'], [context[:4], context[4:]])\nprint(first, parts)\n{F}",
        "FINAL_VAR(parts)",
    ],
    "child-A": [f"{F}repl\nFINAL(context.upper())\n{F}"],
    "child-B": [f"{F}repl\nFINAL(len(context))\n{F}"],
}


class ScriptFactory:
    """policy_factory for the env worker: a scripted policy replaying fixed turns per query."""

    def __init__(self, by_query: dict):
        self.by_query = by_query

    def __call__(self, tokenizer):
        def sub(prompt_text: str) -> str:
            return "SUMMARY" if "summarise: abcde" in prompt_text else "?"

        return scripted_generate(tokenizer, ReplayScript(self.by_query, sub=sub))


def rows_to_proto(rows: list[dict], uids: list[str]) -> DataProto:
    def col(values):
        a = np.empty(len(values), dtype=object)
        a[:] = values
        return a

    return DataProto.from_dict(
        non_tensors={
            "data_source": col([r["data_source"] for r in rows]),
            "reward_model": col([r["reward_model"] for r in rows]),
            "extra_info": col([r["extra_info"] for r in rows]),
            "raw_prompt": col([r["prompt"] for r in rows]),
            "uid": col(uids),
        }
    )


@pytest.fixture(scope="module")
def model_path():
    from workers.models.tiny import ensure_tiny_model

    return ensure_tiny_model("nano")


@pytest.fixture(scope="module")
def tasks():
    sniah = generate_splits("sniah", 2, 0, seed=0, lengths="3000")["train"]
    oolong = generate_splits("oolong", 1, 0, seed=0, lengths="3000", final_style="literal_line")["train"]
    sub_row = {
        "data_source": "test/sub",
        "prompt": [{"role": "user", "content": "Q-sub"}],
        "reward_model": {"ground_truth": "x"},
        "extra_info": {"context": "abcdefghij"},
    }
    return sniah + oolong + [sub_row]


@pytest.fixture(scope="module")
def env_group(ray_session, model_path, tasks):
    by_query = {r["extra_info"]["question"]: r["extra_info"]["reference_turns"] for r in tasks[:3]}
    by_query.update(SUB_SCRIPT)
    rollout = RolloutConfig(n=1, prompt_length=1536, response_length=1536, temperature=1.0)
    env = RLMEnvConfig(
        agent=AgentConfig(max_iterations=6, max_depth=1),
        sandbox=SandboxConfig(timeout_s=10),
        max_concurrent=16,
    )
    pool = ResourcePool([2], name="test_rlm_env_pool")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(
            EnvWorker,
            model=ModelConfig(path=model_path),
            rollout=rollout,
            env=env,
            policy_factory=ScriptFactory(by_query),
        ),
        name_prefix="rlm_env",
    )
    wg.init_model()
    yield wg
    wg.close_env()
    wg.shutdown()
    pool.remove()


def test_env_group_replays_reference_solutions_with_group_sampling(env_group, tasks):
    data = rows_to_proto(tasks, [f"p{i}" for i in range(len(tasks))])
    data.meta_info.update(n=2, seed=7)
    out = env_group.generate_sequences(data)
    nt, b = out.non_tensor_batch, out.batch
    assert len(out) == 8  # 4 prompts x 2 samples, roots only
    assert list(nt["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]  # a,a,b,b across both ranks
    assert list(nt["data_source"]) == [r["data_source"] for r in tasks for _ in range(2)]
    assert list(nt["status"]) == ["finished"] * 8 and set(nt["depth"]) == {0}
    # the reference RLM solutions, executed in real sandboxes, earn full marks
    for i in range(6):
        truth = nt["reward_model"][i]["ground_truth"]
        score = (score_sniah if i < 4 else score_oolong)(nt["answer"][i], truth)
        assert score == 1.0, (nt["answer"][i], truth)
    assert list(nt["answer"][6:]) == ["['ABCD', '6']"] * 2  # sub-LM and children answered across Ray
    assert b["responses"].shape == (8, 1536) and b["prompts"].shape == (8, 1536)
    mask = b["response_mask"]
    assert ((mask > 0) <= (b["attention_mask"][:, 1536:] > 0)).all()
    assert (mask.sum(-1) > 0).all() and (mask.sum(-1) < b["attention_mask"][:, 1536:].sum(-1)).all()
    assert torch.allclose(b["rollout_log_probs"][mask > 0], torch.tensor(-0.5))
    m = out.meta_info["metrics"]  # merged over both ranks' chunks (4 roots each)
    assert m["env/finished_frac"] == 1.0 and m["env/errors"] == 0 and m["env/num_roots"] == 8
    assert m["env/turns/mean"] == pytest.approx(float(np.mean(nt["num_turns"])))  # the mean over all 8 roots
    assert m["env/trajectories_per_s"] > 0 and m["timing_s/gen"] > 0
    assert out.meta_info["n"] == 2 and out.meta_info["pad_token_id"] >= 0


def test_children_as_rows_and_uneven_chunks(env_group, tasks):
    one = rows_to_proto(tasks[3:], ["only"])  # 1 prompt on 2 ranks: rank 1 gets a placeholder chunk
    one.meta_info.update(n=1, train_children=True)
    out = env_group.generate_sequences(one)
    nt = out.non_tensor_batch
    assert len(out) == 3  # the root and its two children
    assert list(nt["uid"]) == ["only"] * 3 and list(nt["depth"]) == [0, 1, 1]
    root_id = nt["traj_id"][0]
    assert list(nt["parent_id"]) == ["", root_id, root_id] and list(nt["answer"]) == [
        "['ABCD', '6']",
        "ABCD",
        "6",
    ]
    assert list(nt["data_source"]) == ["test/sub"] * 3  # children inherit their prompt's columns
    assert out.meta_info["metrics"]["env/children/mean"] == 2.0
    assert out.meta_info["metrics"]["env/subcalls/mean"] == 3.0

    info = env_group.env_info()
    assert len(info) == 2 and all(i["repls_open"] == 0 for i in info)  # every REPL was closed
    assert all(i["isolation"]["mode"] in ("bwrap", "rlimits") for i in info)


def test_colocated_actor_rollout_rlm_with_real_engine(ray_session, model_path):
    """generate_sequences with the real tiny engine; the trainer re-scores the multi-turn batch with the same
    log-probs on model tokens; after an SFT step and ``sync_weights`` the rollout's log-probs move and
    match the trainer again."""
    rollout = RolloutConfig(n=1, prompt_length=1536, response_length=512, temperature=1.0, max_num_seqs=8)
    env = RLMEnvConfig(
        agent=AgentConfig(max_iterations=2, max_new_tokens=16), sandbox=SandboxConfig(timeout_s=10)
    )
    actor = ActorConfig(ppo_mini_batch_size=2, optim=OptimConfig(lr=1e-2, grad_clip=None))
    pool = ResourcePool([1], name="test_rlm_colocated_pool")
    model = ModelConfig(path=model_path)
    roles = hybrid_roles(model, actor, rollout) | {"env": env_role(model, rollout, env)}
    wgs = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix="rlm_actor_rollout").spawn(
        roles
    )
    trainer, wg = wgs["actor"], wgs["env"]
    try:
        for role in roles:  # in build order: the rollout role shares the actor, the env role the rollout
            wgs[role].init_model()
        rows = [
            {
                "data_source": "t",
                "prompt": [{"role": "user", "content": f"question {i}?"}],
                "reward_model": {"ground_truth": "1"},
                "extra_info": {"context": "alpha beta gamma " * 20},
            }
            for i in range(2)
        ]
        data = rows_to_proto(rows, ["a", "b"])
        data.meta_info.update(n=2, seed=11)
        out = wg.generate_sequences(data)
        assert len(out) == 4 and set(out.non_tensor_batch["status"]) <= {
            "finished",
            "max_iterations",
            "budget",
        }
        mask = out.batch["response_mask"]
        assert (mask.sum(-1) >= 16).all()  # at least one full model turn per row
        old = trainer.compute_log_prob(out).batch["old_log_probs"]
        assert float(((old - out.batch["rollout_log_probs"]).abs() * mask).max()) < 1e-4

        trainer.sft_step(out)
        wgs["rollout"].sync_weights()
        again = wg.generate_sequences(data)
        new_old = trainer.compute_log_prob(again).batch["old_log_probs"]
        mask2 = again.batch["response_mask"]
        assert float(((new_old - again.batch["rollout_log_probs"]).abs() * mask2).max()) < 1e-4
        first = out.batch["rollout_log_probs"][:, 0] - again.batch["rollout_log_probs"][:, 0]
        assert (
            not torch.equal(out.batch["responses"], again.batch["responses"])
            or float(first.abs().max()) > 1e-3
        )
    finally:
        wg.close_env()
        wg.shutdown()
        pool.remove()


def test_llm_query_goes_to_the_configured_frozen_sub_model(ray_session, model_path):
    """``env.sub_model_path``: llm_query from sandbox code is answered by a separately loaded frozen model
    (here the real nano checkpoint on the native engine), not by the policy -- whose scripted ``sub`` would
    answer "SUMMARY"; greedy sub-calls are reproducible."""
    script = {
        "Q-frozen": [f"{F}repl\nfirst = llm_query('summarise: ' + context[:5])\n{F}", "FINAL_VAR(first)"]
    }
    rollout = RolloutConfig(n=1, prompt_length=512, response_length=512, temperature=1.0)
    env = RLMEnvConfig(
        agent=AgentConfig(
            max_iterations=3, max_depth=0, sub_max_new_tokens=12, prompt=PromptConfig(style="compact")
        ),
        sandbox=SandboxConfig(timeout_s=10),
        sub_model_path=model_path,
        sub_max_num_seqs=4,
    )
    pool = ResourcePool([1], name="test_rlm_sub_model_pool")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(
            EnvWorker,
            model=ModelConfig(path=model_path),
            rollout=rollout,
            env=env,
            policy_factory=ScriptFactory(script),
        ),
        name_prefix="rlm_env_sub",
    )
    try:
        wg.init_model()
        row = {
            "data_source": "test/sub",
            "prompt": [{"role": "user", "content": "Q-frozen"}],
            "reward_model": {"ground_truth": "x"},
            "extra_info": {"context": "abcdefghij"},
        }
        answers = []
        for _ in range(2):
            data = rows_to_proto([row], ["u"])
            data.meta_info.update(n=1, do_sample=False, seed=3)
            out = wg.generate_sequences(data)
            assert list(out.non_tensor_batch["status"]) == ["finished"]
            assert out.meta_info["metrics"]["env/subcalls/mean"] == 1.0
            answers.append(out.non_tensor_batch["answer"][0])
        assert answers[0] == answers[1]  # greedy frozen model: the same completion twice
        assert answers[0] not in ("SUMMARY", "?") and not answers[0].startswith("Error")
    finally:
        wg.close_env()
        wg.shutdown()
        pool.remove()
