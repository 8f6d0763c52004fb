"""Exact tokens whatever the chat template does (``workers.agents.llm.TokenConversation``, ``workers.agents.batch``).

A recording engine stands in for the model: it keeps every prompt it was fed and answers with scripted text split
into one token per character -- a valid but non-canonical tokenization that re-tokenizing the text would not
reproduce, so any re-tokenized model turn shows. Real ``transformers`` tokenizers carry the templates of
``workers/models/chat_templates.py`` (ChatML; Qwen3-style, which drops earlier ``<think>`` blocks once a user
message follows; DeepSeek-R1-style, which drops every earlier one; Llama 3-style JSON tools). For 1, 3 and 10
turns, with tool results and with user observations, the training rows must hold exactly the tokens the engine was
fed and produced; a template that rewrites history must be detected, and its rows must be per turn.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from workers.agents.batch import trajectories_to_dataproto
from workers.agents.llm import EngineLLM
from workers.agents.trajectory import Trajectory
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rollout.sampling import GenerationOutput, SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and see what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]
PARAMS = SamplingParams(max_new_tokens=400, temperature=1.0, logprobs=True)


class RecordingEngine:
    """Answers turn k with ``replies[k]`` (one token per character + EOS) and records every prompt it was fed."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, replies
        self.fed: list[list[int]] = []
        self.produced: list[list[int]] = []

    async def generate(self, prompt_ids, params):
        text = self.replies[len(self.fed)]
        ids = [t for ch in text for t in self.tokenizer.encode(ch, add_special_tokens=False)]
        ids.append(self.tokenizer.eos_token_id)
        self.fed.append(list(prompt_ids))
        self.produced.append(ids)
        return GenerationOutput(token_ids=ids, log_probs=[-0.25] * len(ids), finish_reason="stop")


def reply(k: int, think: bool, tools: bool, opened: bool = False) -> str:
    """Turn ``k``: reasoning (closing the block the generation prompt ``opened``), then a call or prose."""
    thought = f"{'' if opened else '<think>'}step {k}: add one</think>\n" if think else ""
    if tools:
        call = json.dumps({"name": "python", "arguments": {"code": f"print({k} + 1)"}})
        return f"{thought}<tool_call>\n{call}\n</tool_call>"
    return f"{thought}The count is {k} + 1."


def observation(k: int, tools: bool) -> dict:
    if tools:
        return {"role": "tool", "content": str(k + 1)}
    return {"role": "user", "content": f"Result: {k + 1}. Go on."}


def run(template: str, turns: int, think: bool, tools: bool):
    tok = load_tokenizer(ensure_tiny_model("nano", chat_template=template))
    opened = template == "deepseek_r1"
    engine = RecordingEngine(tok, [reply(k, think, tools, opened) for k in range(turns)])
    llm = EngineLLM(engine, tok)
    messages = [{"role": "system", "content": "Count up."}, {"role": "user", "content": "Start at 0."}]
    conv = llm.conversation(messages, None, tools=TOOLS if tools else None)
    traj = Trajectory(id="t", query="Start at 0.", root_uid="u")

    async def go():
        for k in range(turns):
            resp = await conv.respond(PARAMS)
            traj.turns.append(resp.turn(k))
            if k < turns - 1:
                assert conv.add_messages([observation(k, tools)])

    asyncio.run(go())
    traj.status, traj.final_answer = "finished", "done"
    return tok, engine, conv, traj


def rows_of(batch, tok):
    """Each row's (prompt ids, response ids, loss-masked response ids), padding removed."""
    P = batch.batch["prompts"].shape[1]
    out = []
    for i in range(len(batch)):
        keep = batch.batch["attention_mask"][i, :P].bool()
        p = [int(x) for x in batch.batch["prompts"][i][keep]]
        n = int(batch.batch["attention_mask"][i, P:].sum())
        r = [int(x) for x in batch.batch["responses"][i, :n]]
        m = [int(x) for x in batch.batch["response_mask"][i, :n]]
        out.append((p, r, [t for t, keep in zip(r, m) if keep]))
    return out


CASES = [
    # template, think, tools, rewrites
    ("chatml", True, False, False),
    ("qwen3", True, True, False),  # tool results are no user message: Qwen3 keeps the reasoning
    ("qwen3", True, False, True),  # a user message after reasoning: the earlier <think> is dropped
    ("qwen3", False, False, False),
    ("deepseek_r1", True, True, True),  # every earlier reasoning is dropped
    ("deepseek_r1", False, True, True),  # ... and the <think> its generation prompt opened: rewritten anyway
    ("llama3", False, True, False),
    ("llama3", True, False, False),
]


@pytest.mark.parametrize("turns", [1, 3, 10])
@pytest.mark.parametrize("template,think,tools,rewrites", CASES)
def test_trained_tokens_are_the_tokens_fed_and_produced(template, think, tools, rewrites, turns):
    tok, engine, conv, traj = run(template, turns, think, tools)
    assert conv.rewrites == (rewrites and turns > 1) == traj.rewritten
    # every prompt the engine was fed is the template's rendering of the history at that turn (as text)
    history = conv.messages
    assistant_at = [i for i, m in enumerate(history) if m["role"] == "assistant"]
    for k, fed in enumerate(engine.fed):
        rendered = llm_render(tok, history[: assistant_at[k]], tools)
        assert tok.decode(fed, skip_special_tokens=False, clean_up_tokenization_spaces=False) == rendered
    # the model's own tokens are never re-tokenized: the canonical encoding differs from what it produced
    if think:
        text = tok.decode(engine.produced[0][:-1])
        assert tok.encode(text, add_special_tokens=False) != engine.produced[0][:-1]

    train = trajectories_to_dataproto(
        [traj], max_prompt_length=4096, max_response_length=4096, pad_token_id=0
    )
    rows = rows_of(train, tok)
    if traj.rewritten:  # one row per turn: its prompt is exactly what the engine was fed for that turn
        assert len(rows) == turns and list(train.non_tensor_batch["turn"]) == list(range(turns))
        for (p, r, trained), fed, produced in zip(rows, engine.fed, engine.produced):
            assert (p, r, trained) == (fed, produced, produced)
        assert train.meta_info["rewritten_trajectories"] == 1
    else:  # one growing sequence: the last prompt it was fed plus the last turn, every model token trained
        ((p, r, trained),) = rows
        assert p == engine.fed[0] and p + r == engine.fed[-1] + engine.produced[-1]
        assert trained == [t for ids in engine.produced for t in ids]
        assert train.meta_info["rewritten_trajectories"] == 0

    # validation keeps one row per trajectory: the last segment, exactly as fed
    val = trajectories_to_dataproto(
        [traj], max_prompt_length=4096, max_response_length=4096, pad_token_id=0, split_rewritten=False
    )
    ((p, r, _),) = rows_of(val, tok)
    start = traj.segment_start()
    assert p == engine.fed[start] and p + r == engine.fed[-1] + engine.produced[-1]


def llm_render(tok, messages, tools) -> str:
    return tok.apply_chat_template(
        messages, tools=TOOLS if tools else None, tokenize=False, add_generation_prompt=True
    )


def test_a_rewriting_template_trains_step_wise_on_the_env_worker_path():
    """The trajectory's JSON round trip keeps the flag, so rows built later split it the same way."""
    _, engine, _, traj = run("deepseek_r1", 3, True, True)
    back = Trajectory.from_json(traj.to_json())
    assert [t.full_prompt for t in back.turns] == [False, True, True] and back.rewritten
    batch = trajectories_to_dataproto(
        [back], max_prompt_length=4096, max_response_length=4096, pad_token_id=0
    )
    assert len(batch) == 3 and set(batch.non_tensor_batch["advantage_source"]) == {"t@2"}
