"""An agent written only against the ``openai`` client trains through a recipe: ``recipes/rlm_openai_agent.yaml``
(``env.loop: openai_agent``) runs ``workers/agents/examples/openai_word_count.py:agent`` once per trajectory
against the rollout engine's OpenAI-compatible endpoint, warm start included (the reference turns answered by a
scripted policy, the agent making its own calls). A brief run on the nano model."""

import json
from pathlib import Path

import pytest

from recipes import rlm
from recipes.config import load_config
from workers.agents.examples.word_count_tools import write_dataset
from workers.agents.openai_agent import OpenAIAgentEnvConfig

YAML = Path(__file__).resolve().parents[2] / "recipes" / "rlm_openai_agent.yaml"

BRIEF = [
    "model.tiny_size=nano",
    "data.train_batch_size=2",
    "data.val_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "env.agent.max_new_tokens=16",
    "trainer.total_training_steps=1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
    "trainer.export_hf=false",
]


@pytest.mark.e2e
def test_an_openai_client_agent_trains_from_the_command_line(ray_session, tmp_path, capsys):
    paths = write_dataset(str(tmp_path / "data"), n_train=8, n_val=2)
    data = [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]
    run_dir = tmp_path / "run"
    result = rlm.main(["--config", str(YAML), *BRIEF, *data, f"trainer.default_local_dir={run_dir}"])
    out = capsys.readouterr().out
    assert "reference trajectories replayed in the sandbox" in out and "open-AI-agent success rate" in out
    final = result["final"]
    assert (
        final["agent/error_frac"] == 0.0 and final["agent/calls/mean"] >= 1.0
    )  # every agent called the model
    batch = result["last_batch"]
    nt = batch.non_tensor_batch
    assert len(batch) >= 4 and set(nt["status"]) == {"finished"}
    for traj in map(json.loads, nt["trajectory"]):
        assert traj["query"].startswith("How many words: ") and traj["metadata"]["calls"] == len(
            traj["turns"]
        )
    # the agent's return value is the answer that reward.default_scorer=exact_match scored
    roots = [i for i in range(len(batch)) if nt["advantage_source"][i] == nt["row_id"][i]]
    want = [float(str(nt["answer"][i]) == nt["reward_model"][i]["ground_truth"]) for i in roots]
    assert [float(batch.batch["token_level_scores"][i].sum()) for i in roots] == want
    # the rows are what the engine was fed and sampled through the endpoint: the trainer, reading them with the
    # weights that sampled them, gets the engine's log-probs back (a re-tokenized or re-rendered row would not)
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    assert diff.numel() > 0 and float(diff.max()) < 1e-3, float(diff.max())
    assert type(load_config("rlm", config_path=run_dir / "config.yaml").env) is OpenAIAgentEnvConfig
