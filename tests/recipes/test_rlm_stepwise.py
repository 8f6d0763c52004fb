"""The RLM recipe's advantage path on step-wise rows and on child trajectories, and the loud stop when every
trajectory of a step fails.

* ``recipes/rlm.py`` end to end with ``env.step_wise=true`` (CPU, nano model, as
  tests/recipes/test_rlm_recipe.py): one row per model turn, every turn of a trajectory with its trajectory's
  advantage.
* Children at depth 1 and 2 through the recipe's own pieces -- the env worker (real RLM loop, real sandbox, a
  scripted policy so that the tree is deterministic), the reward worker, ``compute_advantage`` -- get their
  root's advantage and are no samples of its group (issue 15, part 1), in both row layouts.
* An env step in which every trajectory ends with status "error" raises ``RunAborted`` naming the env rank and
  the errors; one failed trajectory fails only itself.
* The hybrid advantage (per-token PRM and teacher terms) refuses rows that inherit another row's advantage.
* The env metrics split by depth (``env/depth_<d>/...``), exact on a scripted tree, and carried to the step's
  metrics; children that train nothing (an environment failure, a prompt beyond the row limit) are dropped
  and counted (``env/dropped_children``), those the policy ended (budget, its own errors) keep the root's
  advantage; a root whose environment failed stays a sample of its group but trains none of its tokens.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from recipe_testlib import BRIEF_RLM

from dataproto import DataProto
from recipes import rlm
from recipes.sections import AlgorithmConfig
from recipes.trainer.hybrid import hybrid_advantage
from recipes.trainer.roles import metrics_of
from recipes.trainer.run import RunAborted
from recipes.trainer.sources import is_source
from recipes.trainer.steps import check_env_errors, compute_advantage
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.env_worker import EnvWorker
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import Trajectory, TrajectoryTurn
from workers.config import ModelConfig, RewardConfig, RolloutConfig
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig
from workers.rlm.env_loop import RLMEnvConfig
from workers.roles import RewardWorker
from workers.sandbox import SandboxConfig

F = "```"


def block(code: str) -> str:
    return f"{F}repl\n{code}\n{F}"


# One prompt, rollout.n=4 samples: the first sample to ask answers right through a child (depth 1) that
# starts a grandchild (depth 2), both of which answer wrong; the other three samples answer wrong in one turn.
TREE = {
    "Q-group": [block("a = rlm_query('child-1', context[:6])\nprint(a)"), "FINAL(abc)"],
    "child-1": [block("b = rlm_query('child-2', context[:3])\nprint(b)"), "FINAL(wrong-1)"],
    "child-2": ["FINAL(wrong-2)"],
}
ASSISTANT = "<|im_start|>assistant"


class OneRightSample:
    """The policy: TREE replayed, except that only the first root to ask takes the right path."""

    def __init__(self):
        self.script = ReplayScript(TREE, sub=lambda _: "?")
        self.right_taken = False

    def __call__(self, prompt_text: str) -> str:
        if "Q-group" in prompt_text and prompt_text.count(ASSISTANT) == 1:  # a root's first turn
            if self.right_taken:
                return "FINAL(nope)"
            self.right_taken = True
        return self.script(prompt_text)


def col(values) -> np.ndarray:
    a = np.empty(len(values), dtype=object)
    a[:] = values
    return a


def prompts(queries: list[str], uids: list[str]) -> DataProto:
    return DataProto.from_dict(
        non_tensors={
            "data_source": col(["exact_match"] * len(queries)),
            "reward_model": col([{"ground_truth": "abc"}] * len(queries)),
            "extra_info": col([{"context": "abcdefghij"}] * len(queries)),
            "raw_prompt": col([[{"role": "user", "content": q}] for q in queries]),
            "uid": col(uids),
        }
    )


def env_worker(
    respond,
    *,
    step_wise: bool = False,
    train_children: bool = True,
    limits: tuple[int, int] = (3072, 512),
    max_errors: int | None = None,
) -> EnvWorker:
    """The env role's worker in this process, its policy scripted: ``respond(prompt text) -> reply``;
    ``limits``: the rows' (max_prompt_length, max_response_length)."""

    def factory(tokenizer):
        return scripted_generate(tokenizer, respond)

    w = EnvWorker(
        ModelConfig(path=ensure_tiny_model("nano")),
        RolloutConfig(n=1, prompt_length=limits[0], response_length=limits[1]),
        RLMEnvConfig(
            agent=AgentConfig(max_iterations=4, max_depth=2, max_errors=max_errors),
            sandbox=SandboxConfig(timeout_s=10),
            step_wise=step_wise,
            train_children=train_children,
        ),
        policy_factory=factory,
    )
    w.init_model()
    return w


def scored_advantages(w: EnvWorker, query: str = "Q-group", n: int = 4) -> DataProto:
    """generate -> reward worker -> the recipe's compute_advantage (GRPO), as rl_step runs them."""
    data = prompts([query], ["g"])
    data.meta_info["n"] = n
    try:
        batch = w.generate_sequences(data)
    finally:
        w.close_env()
    batch = batch.union(RewardWorker(ensure_tiny_model("nano"), RewardConfig()).compute_rm_score(batch))
    compute_advantage(batch, AlgorithmConfig(adv_estimator="grpo"), kl_ctrl=None)
    return batch


def advantage_of_rows(batch: DataProto) -> list[float]:
    """Each row's advantage (the one value on its loss mask)."""
    out = []
    for adv, mask in zip(batch.batch["advantages"], batch.batch["response_mask"]):
        values = adv[mask > 0].unique()
        assert len(values) == 1, values
        out.append(float(values[0]))
    return out


def tree_rows(batch: DataProto) -> np.ndarray:
    """Rows of the right sample's tree (its root and descendants)."""
    nt = batch.non_tensor_batch
    right = {t for t, a, d in zip(nt["traj_id"], nt["answer"], nt["depth"]) if d == 0 and a == "abc"}
    assert len(right) == 1, list(nt["answer"])
    return np.asarray([r in right for r in nt["root_id"]])


@pytest.mark.timeout(300)
def test_children_at_depth_1_and_2_take_their_roots_advantage():
    batch = scored_advantages(env_worker(OneRightSample()))
    nt = batch.non_tensor_batch
    tree = tree_rows(batch)
    assert sorted(nt["depth"][tree]) == [0, 1, 2] and len(batch) == 6
    assert (
        sorted(nt["answer"][tree]) == ["abc", "wrong-1", "wrong-2"]
        and list(nt["answer"][~tree]) == ["nope"] * 3
    )
    scores = batch.batch["token_level_scores"].sum(-1)
    assert scores[torch.as_tensor(tree)].tolist() == [1.0, 0.0, 0.0]  # each child scored on its own answer
    # GRPO over the 4 roots [1, 0, 0, 0]; the children are no samples of the group and take the right
    # root's 1.5 (counted as samples they got [1.5, -0.5, -0.5, ...] with a 6-sample mean)
    adv = np.asarray(advantage_of_rows(batch))
    assert adv[tree] == pytest.approx([1.5] * 3, abs=1e-4) and adv[~tree] == pytest.approx(
        [-0.5] * 3, abs=1e-4
    )
    assert list(is_source(batch)) == [int(d) == 0 for d in nt["depth"]]
    assert torch.equal(batch.batch["returns"], batch.batch["advantages"])  # GRPO's returns, inherited too


@pytest.mark.timeout(300)
def test_step_wise_children_rows_per_turn_with_the_roots_advantage():
    batch = scored_advantages(env_worker(OneRightSample(), step_wise=True))
    nt = batch.non_tensor_batch
    tree = tree_rows(batch)
    rows = sorted(zip(nt["depth"][tree], nt["turn"][tree]))
    assert rows == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]  # a row per model turn, children's too
    assert list(nt["turn"][~tree]) == [0, 0, 0]
    adv = np.asarray(advantage_of_rows(batch))
    assert adv[tree] == pytest.approx([1.5] * 5, abs=1e-4) and adv[~tree] == pytest.approx(
        [-0.5] * 3, abs=1e-4
    )
    sources = is_source(batch)  # the samples of the group: each root's last turn
    assert sources.sum() == 4 and set(nt["row_id"][sources & tree]) == {nt["root_id"][tree][0] + "@1"}
    assert (batch.batch["response_mask"].sum(-1) > 0).all()  # every turn row trains its own tokens


@pytest.mark.timeout(300)
def test_every_trajectory_failing_stops_the_run_loudly():
    def engine_down(prompt_text: str) -> str:
        raise ConnectionError("rollout engine at 127.0.0.1:1 unreachable")

    w = env_worker(engine_down)
    try:
        failed = w.generate_sequences(prompts(["Q-group", "Q-other"], ["a", "b"]))
    finally:
        w.close_env()
    assert list(failed.non_tensor_batch["status"]) == ["error", "error"]
    with pytest.raises(RunAborted, match=r"every one of the 2 trajectories.*env rank 0.*unreachable"):
        check_env_errors(failed, step=3)

    def one_down(prompt_text: str) -> str:
        if "Q-other" in prompt_text:
            raise ConnectionError("rollout engine unreachable")
        return OneRightSample()(prompt_text)

    w = env_worker(one_down, train_children=False)
    try:
        mixed = w.generate_sequences(prompts(["Q-group", "Q-other"], ["a", "b"]))
    finally:
        w.close_env()
    assert list(mixed.non_tensor_batch["status"]) == ["finished", "error"]
    check_env_errors(mixed, step=3)  # one failed trajectory: only it fails (reward 0), the run goes on


@pytest.mark.timeout(300)
def test_env_metrics_split_by_depth():
    batch = scored_advantages(env_worker(OneRightSample()))
    m = metrics_of(batch)  # what the recipe's step logs (Session.end_step), after the reward worker's union
    nt = batch.non_tensor_batch
    P = batch.batch["prompts"].shape[1]
    assert not any(nt["truncated"])
    tokens = batch.batch["attention_mask"][:, P:].sum(-1).float()  # a whole row's response, uncut
    # depth 0: the 4 roots (the right one 2 turns, the others 1); depth 1: child-1 (2 turns); depth 2: child-2
    for d, (n, turns) in {0: (4, 1.25), 1: (1, 2.0), 2: (1, 1.0)}.items():
        at = torch.as_tensor([int(x) == d for x in nt["depth"]])
        key = f"env/depth_{d}"
        assert m[f"{key}/num_trajectories"] == n and m[f"{key}/turns/mean"] == turns
        assert m[f"{key}/finished_frac"] == m[f"{key}/answered_frac"] == 1.0
        assert m[f"{key}/errors"] == m[f"{key}/status/error"] == m[f"{key}/status/budget"] == 0.0
        assert m[f"{key}/status/finished"] == n
        assert m[f"{key}/response_length/mean"] == pytest.approx(float(tokens[at].mean()))
    assert not any(k.startswith("env/depth_3") for k in m)
    assert m["env/num_trajectories"] == 6 and m["env/dropped_children"] == 0.0


def drop_tree_policy():
    """One root that starts five children, each ending its own way; the other samples answer wrong at once."""
    tree = {
        "Q-drop": [
            block(
                "a = rlm_query('child-ok', context[:3])\n"
                "b = rlm_query('child-down', context[:3])\n"
                "c = rlm_query('child-budget', context[:3])\n"
                "d = rlm_query('child-raise', context[:3])\n"
                "e = rlm_query('child-long ' + 'w ' * 1500, context[:3])\n"
                "print(a, b, c, d, e)"
            ),
            "FINAL(abc)",
        ],
        "child-ok": ["FINAL(ok)"],
        "child-down": [block("print(1)"), "FINAL(never)"],  # the engine fails on its second turn
        "child-budget": [block("print(' '.join(str(i) for i in range(3000)))")],  # no room for that output
        "child-raise": [block("1/0")],  # its code raises in max_errors=2 turns in a row
        "child-long": ["FINAL(long)"],  # its query alone is longer than the rows' max_prompt_length
    }
    script = ReplayScript(tree, sub=lambda _: "?")
    first = [True]

    def respond(text: str) -> str:
        if text.count(ASSISTANT) == 1 and "Q-drop" in text:  # a root's first turn
            if not first[0]:
                return "FINAL(nope)"
            first[0] = False
        if "child-down" in text and "Q-drop" not in text and text.count(ASSISTANT) == 2:
            raise ConnectionError("rollout engine at 127.0.0.1:1 unreachable")
        return script(text)

    return respond


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step_wise", [False, True])
def test_children_that_train_nothing_are_dropped_and_counted(step_wise):
    w = env_worker(drop_tree_policy(), step_wise=step_wise, limits=(2000, 2000), max_errors=2)
    batch = scored_advantages(w, "Q-drop", n=2)
    nt, m = batch.non_tensor_batch, metrics_of(batch)
    # the two samples run concurrently: "R" names the one that took the tree, "W" the other
    right = next(t for t, a in zip(nt["traj_id"], nt["answer"]) if a == "abc")
    name = {right: "R", next(t for t in nt["root_id"] if t != right): "W"}
    ids = [name[r] + t.removeprefix(r) for t, r in zip(nt["traj_id"], nt["root_id"])]
    rows = sorted(zip(ids, nt["turn"], nt["status"]))
    if step_wise:
        assert m["env/dropped_turns"] == 1.0  # child-long's one turn
        assert rows == [
            ("R", 0, "finished"),
            ("R", 1, "finished"),
            ("R/0", 0, "finished"),
            ("R/2", 0, "budget"),
            ("R/3", 0, "error"),
            ("R/3", 1, "error"),
            ("W", 0, "finished"),
        ]
    else:
        assert rows == [
            ("R", -1, "finished"),
            ("R/0", -1, "finished"),
            ("R/2", -1, "budget"),
            ("R/3", -1, "error"),
            ("W", -1, "finished"),
        ]
    depth_1 = {k.removeprefix("env/depth_1/"): v for k, v in m.items() if k.startswith("env/depth_1/")}
    assert (depth_1["num_trajectories"], depth_1["turns/mean"], depth_1["finished_frac"]) == (5, 6 / 5, 0.4)
    assert (depth_1["status/finished"], depth_1["status/budget"], depth_1["errors"]) == (2, 1, 2)
    # child-down: the engine failed under it (environment, not policy): its first turn is not trained;
    # child-long: its prompt does not fit max_prompt_length, so its row would be all masked -- both dropped
    assert m["env/dropped_children"] == 2.0
    assert "max_errors" in nt["error"][ids.index("R/3")]
    # the children the policy ended (an answer, out of budget, its own errors) train with the root's advantage
    adv = np.asarray(advantage_of_rows(batch))
    root = np.asarray([r == right for r in nt["root_id"]])
    assert adv[root] == pytest.approx([1 / math.sqrt(2)] * int(root.sum()), abs=1e-4)
    assert adv[~root] == pytest.approx([-1 / math.sqrt(2)], abs=1e-4)


@pytest.mark.timeout(300)
def test_a_root_whose_environment_failed_stays_in_its_group_untrained():
    script = ReplayScript({"Q-fail": [block("print(1)"), "FINAL(abc)"]})
    failed = [False]

    def respond(text: str) -> str:  # the engine fails under the first root to reach its second turn
        if text.count(ASSISTANT) == 2 and not failed[0]:
            failed[0] = True
            raise ConnectionError("rollout engine at 127.0.0.1:1 unreachable")
        return script(text)

    batch = scored_advantages(env_worker(respond), "Q-fail", n=2)
    nt, b = batch.non_tensor_batch, batch.batch
    assert sorted(nt["status"]) == ["error", "finished"] and list(is_source(batch)) == [True, True]
    bad = list(nt["status"]).index("error")
    assert nt["num_turns"][bad] == 1 and b["attention_mask"][bad, b["prompts"].shape[1] :].sum() > 0
    assert b["response_mask"][bad].sum() == 0  # its first turn's tokens are not trained
    assert b["token_level_scores"][bad].sum() == 0  # and it scores 0 in its group: GRPO [1, 0]
    assert advantage_of_rows(batch[[1 - bad]]) == pytest.approx([1 / math.sqrt(2)], abs=1e-4)


def test_hybrid_advantage_refuses_rows_that_inherit():
    turns = [TrajectoryTurn(k, prompt_token_ids=[5, 6], response_token_ids=[7, 8]) for k in range(2)]
    traj = Trajectory("u.0", "q", root_uid="u", turns=turns, status="finished")
    rows = trajectories_to_dataproto(
        [traj], max_prompt_length=8, max_response_length=4, pad_token_id=0, step_wise=True
    )
    with pytest.raises(ValueError, match="one row per trajectory: turn off env.step_wise"):
        hybrid_advantage(rows, cfg=None)


TINY = [*BRIEF_RLM, "trainer.val_before_train=false"]


@pytest.mark.e2e
def test_rlm_recipe_step_wise(ray_session, tmp_path):
    # the same P + R = 704 tokens as rlm.yaml's 320 + 384, split for turns: prefixes up to 640, turns up to 64
    limits = ["env.max_prompt_length=640", "env.max_response_length=64"]
    # a reward that differs on every row stands in for the task scorer (the nano model never answers, so every
    # score would be 0 and every advantage trivially equal): a turn row inheriting anything but its source's
    # value shows
    reward = tmp_path / "random_reward.py"
    reward.write_text(
        "import random\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return random.random()\n"
    )
    custom = [f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score"]
    result = rlm.main(
        [*TINY, "env.step_wise=true", *limits, *custom, f"trainer.default_local_dir={tmp_path}"]
    )
    assert result["step"] == 1
    batch = result["last_batch"]
    nt, b = batch.non_tensor_batch, batch.batch
    fill = np.asarray(["#fill" in r for r in nt["row_id"]])
    assert len(batch) % 4 == 0  # whole PPO mini-batches (2 prompts x rollout.n=2 per optimizer step)
    assert (b["response_mask"][torch.as_tensor(fill)].sum() == 0).all()
    turns = defaultdict(list)
    for i in np.flatnonzero(~fill):
        turns[nt["traj_id"][i]].append(int(nt["turn"][i]))
    assert len(turns) == 4  # 2 prompts x rollout.n=2 trajectories
    for tid, ts in turns.items():
        n = int(nt["num_turns"][list(nt["traj_id"]).index(tid)])
        # a row per turn, in order (a tail of turns whose prefix exceeds P is dropped)
        assert ts == list(range(len(ts))) and 1 <= len(ts) <= n, (tid, ts, n)
    assert any(len(ts) >= 2 for ts in turns.values()), "every trajectory ended after one turn"
    # a turn row's response is that turn alone: all model tokens, no observation inside. Each row says which
    # case it is in: a row whose prefix is longer than P (the one row kept for a trajectory none of whose turns
    # fit) or whose environment failed trains nothing; any other row (a response cut at R keeps its first R
    # tokens: env.mask_truncated is off) trains exactly the tokens it attends to
    R = b["responses"].shape[1]
    cases = defaultdict(list)
    for i in np.flatnonzero(~fill):
        trained, attended = b["response_mask"][i] > 0, b["attention_mask"][i, -R:] > 0
        cut = str(nt["truncated"][i])
        assert cut in ("", "response", "prompt"), (i, cut)
        env_failed = nt["status"][i] == "error" and not json.loads(nt["trajectory"][i])["metadata"].get(
            "policy_error"
        )
        if cut == "prompt" or env_failed:
            cases["trains nothing"].append(i)
            assert attended.any() and not trained.any(), (i, cut, nt["status"][i])
        else:
            cases["one turn"].append(i)
            assert trained.any() and torch.equal(trained, attended), (i, cut)
    # here every turn fits (turns of at most env.agent.max_new_tokens=24 tokens, first prefixes under 640) and
    # no environment fails: the check above ran on every row
    assert len(cases["one turn"]) == int((~fill).sum()), dict(cases)
    # the trajectory's GRPO advantage on every one of its turns
    src = is_source(batch)
    scores = b["token_level_scores"].sum(-1)
    assert len(set(scores[torch.as_tensor(~fill)].tolist())) == int((~fill).sum())  # every row scored apart
    for uid in set(nt["uid"]):
        group = [i for i in np.flatnonzero(src) if nt["uid"][i] == uid]
        assert len(group) == 2  # rollout.n samples, one source row each
        s = scores[group]
        expected = (s - s.mean()) / (s.std() + 1e-6)
        for k, i in enumerate(group):
            for j in np.flatnonzero(~fill):
                if nt["traj_id"][j] == nt["traj_id"][i]:
                    m = b["response_mask"][j] > 0
                    assert torch.allclose(b["advantages"][j][m], expected[k].expand(int(m.sum())), atol=1e-5)
    final = result["final"]
    for key in ("env/rows", "env/dropped_turns", "critic/score/mean", "actor/pg_loss"):
        assert key in final and math.isfinite(final[key]), key
    assert final["env/depth_0/num_trajectories"] == 4  # the env's metrics by depth reach the step's log
