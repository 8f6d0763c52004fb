"""recipes/rlm.py end to end on CPU (nano model, short S-NIAH): reference trajectories replayed in the sandbox
for the warm start, then one GRPO step on RLM trajectories; loss mask 0 on observations, finite metrics; the
README's RLM inference snippet run against the run's exported model."""

import json
import math
from pathlib import Path

import pytest
from recipe_testlib import BRIEF_RLM

from recipes import rlm
from recipes.config import load_config
from tests.readme import readme_rlm_snippet

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OOLONG_YAML = ROOT / "recipes" / "rlm_oolong.yaml"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def colocated(ray_session, tmp_path_factory):
    """One colocated run of the brief recipe in ``<tmp>/runs/rlm`` (where README's snippet looks from ``<tmp>``):
    ``(result, tmp)``."""
    root = tmp_path_factory.mktemp("rlm_recipe")
    return rlm.main([*BRIEF_RLM, f"trainer.default_local_dir={root / 'runs' / 'rlm'}"]), root


def test_rlm_recipe_colocated(colocated):
    result, root = colocated
    assert result["step"] == 1
    assert [s for s, _ in result["val_history"]] == [0, 1]  # success rate before and after
    # the session validated (rlm.yaml: trainer.val_before_train, trainer.test_freq) through the env role
    assert result["history"][0]["step"] == 0 and "val/accuracy" in result["history"][0]
    for _, val in result["val_history"]:
        assert val["val/num_samples"] == 2 and "val-env/turns/mean" in val and "val-env/finished_frac" in val
    assert 0.0 <= result["val_before"] <= 1.0 and 0.0 <= result["val_after"] <= 1.0
    # the printed result as data, what README's figures are checked against (tests/test_readme_figures.py)
    recorded = json.loads((root / "runs" / "rlm" / "result.json").read_text())
    assert recorded == {
        "val_before": result["val_before"],
        "val_after": result["val_after"],
        "wall_s": round(result["wall_s"], 1),
        "steps": 1,
    }

    batch = result["last_batch"]
    assert len(batch) == 4  # 2 prompts x rollout.n=2 root trajectories
    R = batch.batch["responses"].shape[1]
    attn = batch.batch["attention_mask"][:, -R:].float()
    mask = batch.batch["response_mask"]
    assert bool(((mask == 0) | (attn == 1)).all())  # loss only on real tokens
    for i, turns in enumerate(batch.non_tensor_batch["num_turns"]):
        traj = json.loads(batch.non_tensor_batch["trajectory"][i])
        assert len(traj["turns"]) == turns
        if turns >= 2:  # an observation came after turn 1: attended to, never trained on
            first = int(mask[i].nonzero()[0]) if mask[i].any() else 0
            ones = mask[i, first:].tolist()
            gap = ones.index(0.0)  # the end of the first model turn
            assert attn[i, gap] == 1 and mask[i, gap] == 0
    assert any(t >= 2 for t in batch.non_tensor_batch["num_turns"]), "every trajectory ended after one turn"

    final = result["final"]
    for key in ("env/turns/mean", "env/finished_frac", "critic/score/mean", "actor/pg_loss", "timing_s/gen"):
        assert key in final, key
    bad = [k for k, v in final.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad


def test_readme_snippet_answers_with_the_exported_model(colocated, monkeypatch):
    """README's inference block, run as written from the directory holding the recipe's ``runs/rlm``: it loads
    ``hf_model`` (exported by ``trainer.export_hf`` in rlm.yaml) and answers a held-out problem to a status;
    its agent settings are exactly ``env.agent`` of recipes/rlm.yaml (what the recipe trains with)."""
    result, root = colocated
    assert result["hf_model"] == str(root / "runs" / "rlm" / "hf_model")
    monkeypatch.chdir(root)
    namespace: dict = {}
    exec(compile(readme_rlm_snippet(), "README.md", "exec"), namespace)
    res = namespace["res"]
    assert res.status in ("finished", "max_iterations", "budget") and 1 <= len(res.root.turns) <= 3
    assert all(t.response_token_ids for t in res.root.turns)  # the exported weights generated every turn
    assert namespace["tree"]["id"] == res.root.id
    assert (root / "outputs" / "rlm.jsonl").is_file()
    assert namespace["trained"] == load_config("rlm").env.agent


def test_rlm_recipe_disaggregated_on_oolong(ray_session, tmp_path):
    """The env role on its own pool (``EnvWorker``), weights broadcast from the training pool, on the
    OOLONG-style aggregation task with the compact prompt."""
    result = rlm.main(
        [
            *BRIEF_RLM,
            "task.name=oolong",  # rlm.yaml's S-NIAH knobs are dropped with the task switch
            "env.agent.max_iterations=4",  # the OOLONG reference solutions take 3 turns
            "env.agent.prompt.style=compact",
            "data.max_prompt_length=384",
            "trainer.placement=disaggregated",
            "trainer.n_gpus_per_node=2",
            "trainer.rollout_gpus_per_node=1",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert result["step"] == 1 and [s for s, _ in result["val_history"]] == [0, 1]
    batch = result["last_batch"]
    assert len(batch) == 4 and set(batch.non_tensor_batch["data_source"]) == {"hyflow/oolong"}
    assert batch.batch["input_ids"].shape[1] <= 384 + batch.batch["responses"].shape[1]
    final = result["final"]
    assert final["perf/weight_sync_bytes"] > 0  # the actor's weights crossed to the env pool
    for key in ("env/turns/mean", "critic/score/mean", "actor/pg_loss", "timing_s/update_weights"):
        assert key in final and math.isfinite(final[key]), key


def test_rlm_oolong_yaml_brief_run(ray_session, tmp_path):
    """recipes/rlm_oolong.yaml (OOLONG most-common-label questions, compact counting program, sloppy warm-start
    demonstrations), two brief GRPO steps: every trajectory's first prompt fits ``data.max_prompt_length``
    uncut, the programs ran in the sandbox and were scored, and the task kept the yaml's knobs."""
    args = ["--config", str(OOLONG_YAML), *BRIEF_RLM, "trainer.total_training_steps=2", "trainer.test_freq=2"]
    result = rlm.main([*args, "env.agent.max_new_tokens=48", f"trainer.default_local_dir={tmp_path}"])
    assert result["step"] == 2 and [s for s, _ in result["val_history"]] == [0, 2]
    cfg = load_config("rlm", config_path=OOLONG_YAML)
    assert cfg.task.knobs["program"] == "compact" and cfg.task.knobs["sloppy_frac"] > 0
    batch = result["last_batch"]
    assert set(batch.non_tensor_batch["data_source"]) == {"hyflow/oolong"}
    assert all("most common" in json.loads(t)["query"] for t in batch.non_tensor_batch["trajectory"])
    assert "prompt" not in set(batch.non_tensor_batch["truncated"])  # system prompt + question fit uncut
    final = result["final"]
    for key in ("env/turns/mean", "critic/score/mean", "actor/pg_loss"):
        assert key in final and math.isfinite(final[key]), key


# the share of the answer's characters that are digits: the nano model's random answers earn a little of it
DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def test_rlm_recipe_fully_async_step_wise(ray_session, tmp_path):
    """async_rl.mode=full: RLM trajectories stream from the env pool while the trainer trains. Step-wise rows
    vary in number per prompt; a group is still released whole (every root of a prompt, all its turns), and
    every model token carries the version of the weights that sampled it, within max_staleness. The brief warm
    start never teaches the S-NIAH program, so the reward is one the trajectories earn: when the turns run out,
    one more turn asks for the answer (env.agent.final_answer_on_exhaustion) and the share of digits in it is
    the score; the run earns it, and its advantages move the weights (three steps do not show it rising)."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)
    result = rlm.main(
        [
            *BRIEF_RLM,
            "env.step_wise=true",
            "env.agent.final_answer_on_exhaustion=true",
            f"custom_reward_function.path={reward}",
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.placement=disaggregated",
            "trainer.n_gpus_per_node=2",
            "trainer.rollout_gpus_per_node=1",
            "async_rl.mode=full",
            "async_rl.max_staleness=1",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert result["step"] == 3
    rows = [r for r in result["history"] if r["step"] >= 1]
    for r in rows:
        assert r["async/staleness_max"] <= 1 and math.isfinite(r["env/turns/mean"])
        assert math.isfinite(r["off_policy/behaviour_kl"]) and math.isfinite(r["actor/pg_loss"])
    # the reward is earned: some answers score, a group's samples differ, and the update has a gradient
    earned = [r for r in rows if r["critic/advantages/max"] > 0]
    assert earned and all(r["critic/score/max"] > 0 and r["actor/grad_norm"] > 0 for r in earned)
    batch = result["last_batch"]
    nt, mask = batch.non_tensor_batch, batch.batch["response_mask"] > 0
    roots: dict[str, set] = {}
    for uid, traj in zip(
        nt["uid"], nt["traj_id"]
    ):  # (mini-batch filler rows copy a row: same uid, same root)
        roots.setdefault(uid, set()).add(traj.split("/", 1)[0])
    assert len(roots) == 2 and all(len(r) == 2 for r in roots.values())  # 2 prompts x rollout.n=2, whole
    assert set(batch.batch["rollout_versions"][mask].tolist()) <= {1, 2}  # the trainer holds version 2
