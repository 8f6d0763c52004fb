"""The one-file tool-call example (``workers/agents/examples/word_count_tools.py``): its tool declared as an OpenAI
schema and rendered by a Qwen3-style template, Hermes calls answered by ``tool`` messages, a bad call answered with
an error the model reads, and its demonstrations replayed for the warm start."""

from __future__ import annotations

import asyncio

from workers.agents.examples.word_count_tools import WordCountToolEnvConfig, WordCountToolLoop, write_dataset
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentJob, LoopContext
from workers.agents.replay import reference_batch
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model

CALL = '<tool_call>\n{"name": "count_words", "arguments": {"text": "red green blue"}}\n</tool_call>'


def test_calls_and_errors_in_the_models_format():
    tok = load_tokenizer(ensure_tiny_model("nano", chat_template="qwen3"))
    turns = [
        '<tool_call>\n{"name": "count_words", "arguments": {"words": 3}}\n</tool_call>',
        CALL,
        "ANSWER: 3",
    ]
    seen: list[str] = []
    script = ReplayScript({"How many words: red green blue": turns})
    policy = EngineLLM(scripted_generate(tok, lambda text: seen.append(text) or script(text)), tok)
    env = WordCountToolEnvConfig()
    loop = WordCountToolLoop(env, LoopContext(policy, None, tok))
    job = AgentJob(0, 0, "How many words: red green blue", {}, "u", "u.0", seed=1)
    (traj,) = asyncio.run(loop.run(job, env.agent))
    assert (traj.status, traj.final_answer) == ("finished", "3")
    assert '"name": "count_words"' in seen[0] and "<tools>" in seen[0]  # the template rendered the schema
    assert "<tool_response>\nError: missing required argument 'text'\n</tool_response>" in seen[1]
    assert seen[2].endswith("<tool_response>\n3 words\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.metadata["tool_use"] == {"calls": 1, "malformed": 0, "invalid": 1, "failed": 0}


def test_demonstrations_replay_for_the_warm_start(tmp_path):
    import pyarrow.parquet as pq

    tok = load_tokenizer(ensure_tiny_model("nano", chat_template="qwen3"))
    paths = write_dataset(str(tmp_path), n_train=4, n_val=2)
    rows = pq.read_table(paths["train"]).to_pylist()
    batch = reference_batch(rows, tok, WordCountToolEnvConfig())
    assert len(batch) == 4  # every demonstration finished, one row each (the template keeps the history)
    for i, row in enumerate(rows):
        n = row["reward_model"]["ground_truth"]
        text = tok.decode(
            batch.batch["responses"][i][
                batch.batch["attention_mask"][i, -batch.batch["responses"].shape[1] :].bool()
            ],
            skip_special_tokens=False,
        )
        assert f"<tool_response>\n{n} words\n</tool_response>" in text and text.rstrip().endswith(
            f"ANSWER: {n}<|im_end|>"
        )


def test_a_rewritten_demonstration_trains_every_turn(tmp_path):
    """A DeepSeek-R1-style template re-renders the history each turn: the replay's SFT batch is one row per turn,
    each as wide as its own prompt -- none dropped for being longer than the first turn's prompt."""
    import pyarrow.parquet as pq

    tok = load_tokenizer(ensure_tiny_model("nano", chat_template="deepseek_r1"))
    rows = pq.read_table(write_dataset(str(tmp_path), n_train=3, n_val=1)["train"]).to_pylist()
    batch = reference_batch(rows, tok, WordCountToolEnvConfig())
    assert list(batch.non_tensor_batch["turn"]) == [0, 1] * 3 and "dropped_turns" not in batch.meta_info
    P = batch.batch["prompts"].shape[1]
    for i in range(len(batch)):
        prompt = tok.decode(batch.batch["prompts"][i][batch.batch["attention_mask"][i, :P].bool()])
        assert prompt.endswith("<think>\n") and (("<tool_response>" in prompt) == (i % 2 == 1))
        assert int(batch.batch["response_mask"][i].sum()) > 0
