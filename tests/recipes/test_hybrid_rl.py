"""recipes/hybrid_rl.py end to end on CPU (nano model, tiny batches): warm start on replayed tool demonstrations,
then 2 hybrid steps with the real reference model as PRM (colocated in the actor-rollout process); then one
step with the PRM behind an HTTP endpoint (on its own pool; or inside the env workers of the disaggregated
placement) -- a local ``http.server`` with canned verdicts and hints stands in for a real OpenAI-compatible
judge -- so hints exist and the OPD term is exercised."""

from __future__ import annotations

import copy
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from recipes import compare_hybrid, hybrid_rl
from recipes.config import ConfigError, load_config, validate
from workers.agents.replay import reference_trajectories, sft_batch
from workers.models import load_tokenizer
from workers.models.tiny import tiny_config
from workers.prm import parse_hint

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


def _expression(question: str) -> str:
    """ "Compute 8 + 9." -> "8 + 9" (the task's prompts)."""
    assert question.startswith("Compute ") and question.endswith("."), question
    return question[len("Compute ") : -1]


def _hint_for_failed_attempt(question: str, failed: list[dict], truth: str) -> str:
    """The hindsight judge's hint (workers/prm/hindsight.py's table), written out by hand for the four failed
    attempts the tool_math task records in ``extra_info["failed_steps"]`` (recipes/tasks/tool_math.py)."""
    call = f"<python>print({_expression(question)})</python>"
    if len(failed) == 2:  # the right call, then a miscopied answer
        assert failed[0]["observation"] == f"Output:\n{truth}" and failed[1]["kind"] == "answer", failed
        return f"The tool printed {truth}. Answer exactly \\boxed{{{truth}}}"
    (step,) = failed
    if step["kind"] == "answer":  # a guess
        return f"Do not guess the value. Run the tool first: {call}"
    if step["observation"] == "Error: SyntaxError: invalid syntax":  # a call with a typo
        return f"The call failed (SyntaxError: invalid syntax). Run exactly {call}"
    assert step["observation"].startswith("Output:\n") and step["action"] != call, step  # a miscopied number
    return f"The code changed the numbers. Copy them exactly: {call}"


def test_hybrid_recipe_rule_judge_hints_failures_from_a_hinted_warm_start(ray_session, tmp_path, monkeypatch):
    """``prm.scorer=rule``: the hindsight judge votes on every step and writes, for each failed trajectory, the
    bridge thought of the failure it sees (the teacher's hint); the warm start includes hinted solutions."""
    warm = {}
    real = hybrid_rl.hinted_demonstrations

    def recording(rows, tokenizer, env, **kw):  # what the warm start trains on
        data = real(rows, tokenizer, env, **kw)
        warm.update(rows=rows, tokenizer=tokenizer, data=data)
        return data

    monkeypatch.setattr(hybrid_rl, "hinted_demonstrations", recording)
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
    # the warm start: the 8 training rows' demonstrations, then hybrid.hinted_demos=0.5 of the rows (the first
    # 4) again as [prompt + "Hint: <the judge's hint about the row's failed attempt>" + the correct tool call]
    rows, tok, data = warm["rows"], warm["tokenizer"], warm["data"]
    assert len(rows) == 8 and len(data) == 8 + 4
    texts = [
        tok.decode(ids[m.bool()].tolist())
        for ids, m in zip(data.batch["input_ids"], data.batch["attention_mask"])
    ]
    assert not any("Hint:" in t for t in texts[:8])
    for row, text in zip(rows[:4], texts[8:]):
        extra, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        hint = _hint_for_failed_attempt(extra["question"], json.loads(extra["failed_steps"]), truth)
        call = f"<python>print({_expression(extra['question'])})</python>"
        assert f"{extra['question']}" in text and f"Hint: {hint}\n{call}" in text, text
        assert text.count("Hint:") == 1 and f"\\boxed{{{truth}}}" in text, text

    # the step: hand-written hints and votes. The nano model writes neither a tool call nor an answer (all its
    # rows but a stray one): every step is malformed (-1), and the judge tells each failed trajectory how to
    # write the call for its own problem; the two problems differ, so a hint on the wrong row shows
    b, final = res["last_batch"], res["final"]
    nt = b.non_tensor_batch
    outcome = b.batch["token_level_scores"].sum(-1).tolist()
    width = b.batch["prm_step_scores"].shape[1]
    malformed_rows = 0
    for i in range(len(b)):
        steps = json.loads(nt["steps"][i])
        question = nt["extra_info"][i]["question"]
        call = f"<python>print({_expression(question)})</python>"
        assert b.batch["prm_step_mask"][i].tolist() == [1.0] * len(steps) + [0.0] * (width - len(steps))
        votes = b.batch["prm_step_scores"][i, : len(steps)].tolist()
        for step, vote in zip(steps, votes):
            if step["kind"] == "malformed":
                assert vote == -1.0, (i, step)
        if steps and outcome[i] < 1 and all(s["kind"] == "malformed" for s in steps):
            malformed_rows += 1
            assert votes == [-1.0] * len(steps), i
            assert nt["hint"][i] == f"Write the tool call as {call}", i
        elif outcome[i] >= 1 or not steps:
            assert nt["hint"][i] == "", i
        else:  # a row with a call or an answer: its hint is about its own problem
            truth = nt["reward_model"][i]["ground_truth"]
            assert call in nt["hint"][i] or f"\\boxed{{{truth}}}" in nt["hint"][i], (i, nt["hint"][i])
        assert nt["teacher_hint"][i] == (f"Hint: {nt['hint'][i]}\n" if nt["hint"][i] else ""), i
    assert malformed_rows >= len(b) // 2, [json.loads(x) for x in nt["steps"]]
    assert len({nt["hint"][i] for i in range(len(b))}) > 1  # two problems: two different hints
    assert final["prm/unparseable_frac"] == 0.0 and final["hybrid/hint_frac"] > 0
    assert final["hybrid/opd/abs_mean"] > 0


def _hint_gap_by_hand(model_path: str, rows: list[dict], env, template: str) -> tuple[float, float, float]:
    """The held-out hint gap's two arms recomputed here: each row's correct tool solution replayed, once as it is
    and once with the hand-written hint about the row's failed attempt after the prompt; the mean log-prob per
    trained token from a plain HF forward (log_softmax + gather). Returns (with hint, without, first-token gap)."""
    tok = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    solutions = [
        {**r, "extra_info": {**r["extra_info"], "reference_turns": list(r["extra_info"]["tool_turns"])}}
        for r in rows
    ]
    plain = reference_trajectories(solutions, tok, env)
    assert [t.query for t in plain] == [r["extra_info"]["question"] for r in rows]
    hinted = copy.deepcopy(plain)
    for t, r in zip(hinted, rows):
        extra = r["extra_info"]
        hint = _hint_for_failed_attempt(
            extra["question"], json.loads(extra["failed_steps"]), str(r["reward_model"]["ground_truth"])
        )
        t.turns[0].prompt_token_ids = [
            *t.turns[0].prompt_token_ids,
            *tok.encode(template.format(hint=hint), add_special_tokens=False),
        ]

    def arm(trajs):
        b = sft_batch(trajs, tok).batch
        R = b["responses"].shape[1]
        with torch.no_grad():
            logits = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
            ).logits[:, -R - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None]).squeeze(-1)
        mask = b["response_mask"].float()
        return (lp * mask).sum(-1) / mask.sum(-1), lp[:, 0]

    (with_hint, first_with), (without, first_without) = arm(hinted), arm(plain)
    return float(with_hint.mean()), float(without.mean()), float((first_with - first_without).mean())


def test_compare_hybrid_seeds_from_one_warm_start(ray_session, tmp_path, monkeypatch):
    """``python -m recipes.compare_hybrid``: one warm start and its held-out hint gap, then both recipes for two
    seeds each (1 step here) and an ablation, summarised per validation step over seeds and paired by seed at
    the last; run again, it reads every finished run instead of running it."""
    # the PRM in the rollout worker's process: one process per run, not two (the separate pool: the recipe's tests)
    overrides = [
        *TINY,
        "trainer.total_training_steps=1",
        "hybrid.hinted_demos=0.5",
        "prm.placement=colocated",
    ]
    argv = ["--out", str(tmp_path), "--seeds", "0,1", "--arms", "hybrid,grpo,opd_no_hint", *overrides]
    res = compare_hybrid.main(argv)
    # the hint gap's arms, each recomputed here from the warm model: with the hint and without, not swapped and
    # not one run twice (a hint changes the log-probs)
    gap = res["hint_gap"]
    assert res["warm_model"] == str(tmp_path / "warm" / "sft_model")
    cfg = load_config(hybrid_rl.RECIPE, overrides)
    val = pd.read_parquet(tmp_path / "warm" / "data" / "val.parquet").to_dict("records")
    with_hint, without, first_gap = _hint_gap_by_hand(
        res["warm_model"], val, cfg.env, cfg.hybrid.hint_template
    )
    assert gap["rows"] == len(val) == 2 and abs(with_hint - without) > 1e-4
    assert gap["log_prob_with_hint"] == pytest.approx(with_hint, abs=1e-5)
    assert gap["log_prob_without_hint"] == pytest.approx(without, abs=1e-5)
    assert gap["gap"] == pytest.approx(with_hint - without, abs=1e-5)
    assert gap["first_token_gap"] == pytest.approx(first_gap, abs=1e-5)
    for name, estimator in (("hybrid", "hybrid"), ("grpo", "grpo")):
        rows = res["summary"][name]
        assert [r["step"] for r in rows] == [0, 1]
        assert sorted(res["per_seed"][name]) == [0, 1]
        # each arm's runs: its own recipe from the warm start, and the summary is over their own logs
        logged = {}
        for seed in (0, 1):
            run = tmp_path / name / f"seed{seed}"
            run_cfg = yaml.safe_load((run / "config.yaml").read_text())
            assert run_cfg["algorithm"]["adv_estimator"] == estimator
            assert run_cfg["model"]["path"] == res["warm_model"] and run_cfg["data"]["seed"] == seed
            lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            logged[seed] = {m["step"]: m for m in lines if "val/pass@1" in m}
            assert [
                {k: v for k, v in m.items() if k == "step" or k.startswith("val/")}
                for m in logged[seed].values()
            ] == res["per_seed"][name][seed]
            assert any(k.startswith("hybrid/") for m in lines for k in m) == (name == "hybrid")
        for r in rows:
            for k in (1, 2):
                vals = [logged[seed][r["step"]][f"val/pass@{k}"] for seed in (0, 1)]
                assert r[f"pass@{k}"] == {
                    "mean": pytest.approx(sum(vals) / 2),
                    "std": pytest.approx(abs(vals[0] - vals[1]) / 2),
                    "min": min(vals),
                    "max": max(vals),
                    "seeds": 2,
                }
    terms = res["hybrid_terms"]
    assert sorted(terms) == ["hybrid", "opd_no_hint"]  # the arms with the hybrid estimator
    for seed in (0, 1):  # the nano model fails everything: the rule judge hints every trajectory with steps
        assert 0 < terms["hybrid"][seed]["hybrid/hint_frac"] <= 1
        assert terms["hybrid"][seed]["hybrid/opd_term/abs_mean"] > 0
        # the ablation's teacher is the plain reference, which at step 1 is the policy itself: no OPD signal,
        # on as many hinted rows
        assert terms["opd_no_hint"][seed]["hybrid/hint_frac"] == terms["hybrid"][seed]["hybrid/hint_frac"]
        assert terms["opd_no_hint"][seed]["hybrid/opd_term/abs_mean"] == 0
    # the nano model fails everything: every GRPO group scores alike, the regime where GRPO has no signal
    assert res["zero_variance_groups"]["grpo"] == {0: {"1": 1.0}, 1: {"1": 1.0}}
    final = res["final"]
    assert final["seeds"] == [0, 1] and sorted(final["equal_steps"]) == ["grpo", "hybrid", "opd_no_hint"]
    diff = final["equal_steps"]["hybrid"]["pass@1"]["diff"]
    assert (
        diff["wins"] + diff["ties"] + diff["losses"] == 2
        and "diff" not in final["equal_steps"]["grpo"]["pass@1"]
    )
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["summary"] == res["summary"] and (tmp_path / "pass_at_k.png").stat().st_size > 0

    # run again: the warm start and every arm and seed finished, so each is read from its record and none is run
    def no_run(*args):
        raise AssertionError(f"ran again: {args}")

    monkeypatch.setattr(hybrid_rl, "main", no_run)
    monkeypatch.setattr(compare_hybrid, "warm_start", no_run)
    again = compare_hybrid.main(argv)
    assert again["summary"] == res["summary"] and again["final"] == res["final"]

    # a teacher trained longer (--teacher-sft-steps): the arms with an OPD term load it as their reference, so
    # the ablation's teacher, without a hint, now differs from the policy at step 1; GRPO has no teacher
    monkeypatch.undo()
    argv = ["--out", str(tmp_path), "--seeds", "0", "--arms", "opd_no_hint,grpo", "--teacher-sft-steps", "4"]
    taught = compare_hybrid.main([*argv, *overrides])
    teacher = taught["teacher"]
    assert teacher["model"] == str(tmp_path / "teacher" / "sft_model") and teacher["sft_steps"] == 4
    assert teacher["hint_gap"]["log_prob_with_hint"] != gap["log_prob_with_hint"]  # the teacher's own
    assert taught["warm_model"] == res["warm_model"]
    configs = {
        arm: yaml.safe_load((tmp_path / arm / "seed0" / "config.yaml").read_text())["hybrid"]
        for arm in ("opd_no_hint", "grpo")
    }
    assert (
        configs["opd_no_hint"]["teacher_path"] == teacher["model"] and configs["grpo"]["teacher_path"] is None
    )
    assert taught["hybrid_terms"]["opd_no_hint"][0]["hybrid/opd_term/abs_mean"] > 0


def test_paired_tests_by_hand():
    every_seed_better = compare_hybrid.paired_tests([1.0] * 8)
    assert (every_seed_better["wins"], every_seed_better["losses"]) == (8, 0)
    # a fair coin gives 8 of 8 (either way) with p 2/256; of 256 sign flips, two reach |sum| 8
    assert every_seed_better["sign_p"] == every_seed_better["permutation_p"] == 2 / 256
    mixed = compare_hybrid.paired_tests([0.3, -0.1, 0.2])
    # sign: 2 wins 1 loss -> p = 2 * (C(3,0) + C(3,1)) / 8 = 1; flips of (0.3, 0.1, 0.2) with |sum| >= 0.4:
    # 0.6, 0.4, -0.4, -0.6 of 8
    assert (mixed["wins"], mixed["ties"], mixed["losses"], mixed["sign_p"]) == (2, 0, 1, 1.0)
    assert mixed["permutation_p"] == 0.5
    assert compare_hybrid.paired_tests([0.0, 0.1])["ties"] == 1


def test_final_comparison_scores_equal_steps_and_equal_training_time():
    def run(vals, step_s):
        return {
            "val_history": [[s, {"val/pass@1": v}] for s, v in vals],
            "step_s": {"1": step_s, "2": step_s},
        }

    records = {  # grpo: 1 s a step, validated at 0 and 2; hybrid: 1.5 s a step, validated at 0, 1 and 2
        "grpo": {0: run([(0, 0.2), (2, 0.4)], 1.0), 1: run([(0, 0.2), (2, 0.3)], 1.0)},
        "hybrid": {0: run([(0, 0.2), (1, 0.5), (2, 0.6)], 1.5), 1: run([(0, 0.2), (1, 0.25), (2, 0.5)], 1.5)},
    }
    final = compare_hybrid.final_comparison(records, [1])
    assert final["budget_s"] == {0: 2.0, 1: 2.0}  # grpo's 2 steps; hybrid's step 2 ends at 3 s
    steps, time_ = final["equal_steps"]["hybrid"]["pass@1"], final["equal_time"]["hybrid"]["pass@1"]
    assert steps["per_seed"] == [0.6, 0.5] and steps["diff"]["mean"] == pytest.approx(0.2)
    assert steps["diff"]["se"] == pytest.approx(0.0, abs=1e-12) and steps["diff"]["wins"] == 2
    assert time_["per_seed"] == [0.5, 0.25]  # at 2 s hybrid has validated at step 1 only
    assert time_["diff"]["mean"] == pytest.approx(0.025) and (
        time_["diff"]["wins"],
        time_["diff"]["losses"],
    ) == (1, 1)
    assert final["equal_time"]["grpo"]["pass@1"]["per_seed"] == [0.4, 0.3]


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
    # hybrid.teacher_path: a model directory sharing the policy's tokenizer, loaded by the reference role
    for name, vocab in (("policy", 100), ("teacher", 100), ("other", 200)):
        tiny_config("nano", vocab_size=vocab).save_pretrained(tmp_path / name)
    (tmp_path / "policy" / "tokenizer.json").write_text("{}")  # model.path is checked to be a model folder
    teach = [f"model.path={tmp_path / 'policy'}", f"hybrid.teacher_path={tmp_path / 'teacher'}"]
    validate(load_config("hybrid_rl", teach))
    bad_teacher = {
        f"hybrid.teacher_path={tmp_path / 'missing'}": "is not a Hugging Face model directory",
        f"hybrid.teacher_path={tmp_path / 'other'}": "vocab_size 200, the policy",
        "actor.use_kl_loss=true": "the reference role loads the teacher, so actor.use_kl_loss",
        "actor.lora.rank=4": "no reference role to load a teacher",
        "algorithm.adv_estimator=grpo": "no OPD term",
    }
    for override, message in bad_teacher.items():
        with pytest.raises(ConfigError, match=message):
            validate(load_config("hybrid_rl", [*teach, override]))
    base = load_config(
        "hybrid_rl", [], config_path=hybrid_rl.__file__.replace("hybrid_rl.py", "hybrid_rl_grpo.yaml")
    )
    assert base.algorithm.adv_estimator == "grpo" and not base.prm.enable
    validate(base)
