"""A recipe that trains through OpenAI-style tool calls with a chat template that rewrites history:
``python -m recipes.rlm --config recipes/rlm_tool_calls.yaml`` (the tool-math env with ``env.agent.tool_format:
hermes``, the tiny model with a DeepSeek-R1-style template whose generation prompt opens ``<think>`` and which drops
earlier reasoning). Every trajectory of more than one turn is rewritten, so it trains one row per turn, and each
row holds exactly the prompt the engine was fed for that turn (the template's rendering, recorded as the turn's
``prompt_text``) and the tokens it produced. A brief run on the nano model."""

import json
import math
from pathlib import Path

import pytest

from recipes import rlm
from recipes.config import load_config
from workers.math_env.env_loop import MathToolEnvConfig
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model

YAML = Path(__file__).resolve().parents[2] / "recipes" / "rlm_tool_calls.yaml"

BRIEF = [
    "model.tiny_size=nano",
    "task.n_train=8",
    "task.n_val=2",
    "data.train_batch_size=2",
    "data.val_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "env.agent.max_turns=2",
    "env.agent.max_new_tokens=16",
    "env.include_json=true",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


def test_the_yaml_reads_into_the_tool_call_format():
    cfg = load_config("rlm", config_path=YAML)
    assert type(cfg.env) is MathToolEnvConfig and cfg.env.agent.tool_format == "hermes"
    assert cfg.model.tiny_chat_template == "deepseek_r1" and cfg.task.knobs["tool_format"] == "hermes"


@pytest.mark.e2e
def test_tool_calls_recipe_trains_through_a_history_rewriting_template(ray_session, tmp_path, capsys):
    run_dir = tmp_path / "run"
    result = rlm.main(["--config", str(YAML), *BRIEF, f"trainer.default_local_dir={run_dir}"])
    assert "reference trajectories replayed in the sandbox" in capsys.readouterr().out
    final = result["final"]
    for key in ("tool/turns/mean", "tool/malformed/mean", "critic/score/mean", "actor/pg_loss"):
        assert key in final and math.isfinite(final[key]), key
    batch = result["last_batch"]
    nt = batch.non_tensor_batch
    trajs = {t: json.loads(j) for t, j in zip(nt["traj_id"], nt["trajectory"])}
    assert len(trajs) == 4  # 2 prompts x rollout.n=2
    multi = [t for t in trajs.values() if len(t["turns"]) > 1]
    assert multi  # the nano model's turns are neither a call nor an answer: a second turn follows
    # the generation prompt's <think> is never in the re-rendered history: every longer trajectory is rewritten
    assert all(any(turn["full_prompt"] for turn in t["turns"][1:]) for t in multi)
    assert final["env/rewritten_frac"] == len(multi) / len(trajs)
    assert len(batch) == sum(len(t["turns"]) for t in trajs.values())  # one row per turn of each

    tok = load_tokenizer(ensure_tiny_model("nano", chat_template="deepseek_r1"))  # the run's tokenizer
    P = batch.batch["prompts"].shape[1]
    for i, (traj_id, turn_index) in enumerate(zip(nt["traj_id"], nt["turn"])):
        traj = trajs[traj_id]
        turn = traj["turns"][turn_index if turn_index >= 0 else 0]
        keep = batch.batch["attention_mask"][i, :P].bool()
        prompt = batch.batch["prompts"][i][keep].tolist()
        if turn_index <= 0 or turn["full_prompt"]:  # the prompt the engine was fed, token for token
            assert prompt == tok.encode(turn["prompt_text"], add_special_tokens=False)
            assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n")
        n = int(batch.batch["attention_mask"][i, P:].sum())
        response = batch.batch["responses"][i, :n].tolist()
        assert tok.decode(response, skip_special_tokens=True) == turn["response_text"]  # the record's text
        assert int(batch.batch["response_mask"][i].sum()) == n  # every produced token is trained
    # Independent of the records: the trainer, re-reading each row (its prompt and response tokens) with the
    # weights that sampled it, gets the engine's log-probs back. A row whose prompt were not the one the engine
    # was fed (a re-rendered or re-tokenized history) or whose tokens were not the sampled ones would not.
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    assert diff.numel() > 0 and float(diff.max()) < 1e-3, float(diff.max())
