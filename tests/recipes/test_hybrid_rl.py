"""recipes/hybrid_rl.py end to end on CPU (nano model, tiny batches): warm start on replayed tool demonstrations,
then 2 hybrid steps with the real reference model as PRM (colocated in the actor-rollout process); then one
step with the PRM behind an HTTP endpoint (on its own pool; or inside the env workers of the disaggregated
placement) -- a local ``http.server`` with canned verdicts and hints stands in for a real OpenAI-compatible
judge -- so hints exist and the OPD term is exercised."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from recipes import compare_hybrid, hybrid_rl
from recipes.config import ConfigError, load_config, validate
from workers.prm import parse_hint
from workers.prm.hindsight import bridge_thought, step_votes

pytestmark = pytest.mark.e2e

TINY = [
    "model.tiny_size=nano",
    "task.n_train=8",
    "task.n_val=2",
    "data.val_max_samples=2",
    "data.val_batch_size=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "eval.pass_k=[1,2]",
    "prm.votes=2",
    "prm.max_new_tokens=8",
    "prm.hint_max_new_tokens=16",
    "env.agent.max_new_tokens=24",
    "trainer.logger=[console]",
    "trainer.plot=false",
    "trainer.progress_bar=false",
]


def finite(d: dict) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, float) and not math.isfinite(v)]


def test_hybrid_recipe_colocated_reference_prm(ray_session, tmp_path):
    res = hybrid_rl.main(
        [
            *TINY,
            "trainer.total_training_steps=2",
            "prm.scorer=reference",  # the model judge (the YAML's default is the rule judge)
            "prm.placement=colocated",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert res["step"] == 2 and [s for s, _ in res["val_history"]] == [0, 2]
    final = res["final"]
    for key in (
        "hybrid/hint_frac",  # fraction of trajectories with a bridge thought
        "hybrid/prm_score/mean",
        "hybrid/opd/abs_mean",  # OPD term magnitude
        "hybrid/opd_term/abs_mean",
        "prm/score/mean",
        "prm/unparseable_frac",
        "tool/turns/mean",
        "val/pass@1",
        "val/pass@2",
        "actor/pg_loss",
        "timing_s/prm",
        "timing_s/teacher",
    ):
        assert key in final, key
    assert not finite(final)
    b = res["last_batch"]
    assert len(b) == 4
    mask = b.batch["response_mask"]
    assert b.batch["teacher_log_prob"].shape == mask.shape
    assert torch.all(b.batch["advantages"][mask == 0] == 0)  # nothing off the policy's tokens
    assert b.batch["prm_step_scores"].shape == (4, 3)
    for hint, raw in zip(b.non_tensor_batch["hint"], b.non_tensor_batch["prm_hint_raw"]):
        assert hint == (parse_hint(raw) or "")  # a hint only where the judge wrote one between the markers
    votes = [json.loads(v) for v in b.non_tensor_batch["prm_votes"]]
    assert all(len(x) == 2 for v in votes for x in v)  # m = 2 votes per step, from the real reference model


class CannedJudge(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        if "<hint>" in prompt:
            texts = ["<hint>use python: print the whole expression</hint>"]
        else:
            texts = [
                "\\boxed{1}" if ("python" in prompt and i % 2 == 0) else "\\boxed{-1}"
                for i in range(body["n"])
            ]
        out = json.dumps({"choices": [{"message": {"content": t}} for t in texts]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "placement, prm_placement",
    [
        ("colocated", "separate"),  # the PRM on a pool of its own
        ("disaggregated", "colocated"),  # the tool env on the rollout pool, the PRM inside the env workers
    ],
)
def test_hybrid_recipe_http_prm_hints_drive_opd(ray_session, tmp_path, placement, prm_placement):
    devices = (
        ["trainer.n_gpus_per_node=2", "trainer.rollout_gpus_per_node=1"]
        if placement == "disaggregated"
        else []
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), CannedJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        res = hybrid_rl.main(
            [
                *TINY,
                "trainer.total_training_steps=1",
                "trainer.val_before_train=false",
                "prm.scorer=http",
                f"prm.endpoint=http://127.0.0.1:{server.server_address[1]}/v1",
                f"prm.placement={prm_placement}",
                f"trainer.placement={placement}",
                *devices,
                "prm.hint_on=always",
                f"trainer.default_local_dir={tmp_path}",
            ]
        )
    finally:
        server.shutdown()
    final = res["final"]
    assert final["hybrid/hint_frac"] == 1.0 and final["prm/hint_frac"] == 1.0
    assert final["hybrid/opd/abs_mean"] > 0 and final["hybrid/opd_term/abs_mean"] > 0
    assert final["prm/unparseable_frac"] == 0.0 and -1.0 <= final["prm/score/mean"] <= 1.0
    b = res["last_batch"]
    assert set(b.non_tensor_batch["teacher_hint"]) == {"Hint: use python: print the whole expression\n"}
    mask = b.batch["response_mask"] > 0
    diff = (b.batch["teacher_log_prob"] - b.batch["old_log_probs"])[mask]
    assert diff.abs().max() > 1e-4  # the hint changes the teacher's view of the same tokens
    assert torch.all(b.batch["advantages"][~mask] == 0)


def test_hybrid_recipe_rule_judge_hints_failures_from_a_hinted_warm_start(ray_session, tmp_path):
    """``prm.scorer=rule``: the hindsight judge votes on every step and writes, for each failed trajectory, the
    bridge thought of the failure it sees (the teacher's hint); the warm start includes hinted solutions."""
    res = hybrid_rl.main(
        [
            *TINY,
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "prm.scorer=rule",
            "hybrid.hinted_demos=0.5",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    b, final = res["last_batch"], res["final"]
    nt = b.non_tensor_batch
    outcome = b.batch["token_level_scores"].sum(-1).tolist()
    for i in range(len(b)):
        steps = json.loads(nt["steps"][i])
        truth = nt["reward_model"][i]["ground_truth"]
        want = (
            bridge_thought(nt["extra_info"][i]["question"], steps, truth) if outcome[i] < 1 and steps else ""
        )
        assert nt["hint"][i] == want
        assert nt["teacher_hint"][i] == (f"Hint: {want}\n" if want else "")
        assert b.batch["prm_step_scores"][i, : len(steps)].tolist() == step_votes(steps, truth)
    assert final["prm/unparseable_frac"] == 0.0 and final["hybrid/hint_frac"] > 0
    assert final["hybrid/opd/abs_mean"] > 0


def test_compare_hybrid_seeds_from_one_warm_start(ray_session, tmp_path):
    """``python -m recipes.compare_hybrid``: one warm start and its held-out hint gap, then both recipes for two
    seeds each (1 step here), summarised per validation step over seeds."""
    res = compare_hybrid.main(
        [
            "--out",
            str(tmp_path),
            "--seeds",
            "0,1",
            *TINY,
            "trainer.total_training_steps=1",
            "hybrid.hinted_demos=0.5",
        ]
    )
    gap = res["hint_gap"]
    assert gap["rows"] == 2 and math.isfinite(gap["gap"])
    assert gap["gap"] == pytest.approx(gap["log_prob_with_hint"] - gap["log_prob_without_hint"], abs=1e-5)
    for name in ("hybrid", "grpo"):
        rows = res["summary"][name]
        assert [r["step"] for r in rows] == [0, 1]
        assert all(
            r["pass@1"]["seeds"] == 2 and r["pass@1"]["min"] <= r["pass@1"]["mean"] <= r["pass@1"]["max"]
            for r in rows
        )
        assert sorted(res["per_seed"][name]) == [0, 1]
    for seed in (0, 1):  # the nano model fails everything: the rule judge hints every trajectory with steps
        assert 0 < res["hybrid_terms"][seed]["hybrid/hint_frac"] <= 1
        assert res["hybrid_terms"][seed]["hybrid/opd_term/abs_mean"] > 0
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["summary"] == res["summary"] and (tmp_path / "pass_at_k.png").stat().st_size > 0
    assert (tmp_path / "hybrid" / "seed1").is_dir() and (tmp_path / "grpo" / "seed0").is_dir()


def test_config_checks_name_keys(tmp_path):
    ok = ["trainer.val_before_train=false"]
    validate(load_config("hybrid_rl", ok))
    bad = {
        "prm.enable=false": "prm.enable",
        "hybrid.w_opd=-1": "hybrid.w_rl and hybrid.w_opd",
        "hybrid.hint_template=nohint": "hybrid.hint_template",
        "eval.temperature=0": "eval.temperature",
        "prm.max_steps=1": "prm.max_steps",
        "hybrid.hinted_demos=1.5": "hybrid.hinted_demos",
        "algorithm.adv_estimator=rloo": "algorithm.adv_estimator",
    }
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(load_config("hybrid_rl", [override]))
    with pytest.raises(ConfigError, match="prm"):
        load_config("hybrid_rl", ["prm.scorer=http"])  # no endpoint
    with pytest.raises(ConfigError, match="prm.voets"):
        load_config("hybrid_rl", ["prm.voets=3"])
    base = load_config(
        "hybrid_rl", [], config_path=hybrid_rl.__file__.replace("hybrid_rl.py", "hybrid_rl_grpo.yaml")
    )
    assert base.algorithm.adv_estimator == "grpo" and not base.prm.enable
    validate(base)
