"""The interface an agent relies on, written once (``workers.agents.llm.Conversation`` and ``LLM``): every LLM client
and every conversation implements it, and one agent-like routine written against the protocol alone runs on each
of them: the token-exact conversation, the message-level one, and the RLM session's compacting wrapper over both."""

from __future__ import annotations

import asyncio

import pytest

from workers.agents.llm import LLM, ChatLLM, Completion, Conversation, EngineLLM
from workers.agents.scripted import scripted_generate
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.session import SessionConversation
from workers.rollout.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=16, temperature=0.0)
START = [{"role": "system", "content": "count"}, {"role": "user", "content": "how many words: red cat"}]


async def _chat(messages, **_):
    return Completion(f"reply {len(messages)}", completion_tokens=2, prompt_tokens=5, model="chat")


def _llms() -> dict[str, LLM]:
    tok = load_tokenizer(ensure_tiny_model("nano"))
    engine = EngineLLM(scripted_generate(tok, lambda prompt: "ANSWER: 2"), tok, max_model_len=512)
    return {"engine": engine, "chat": ChatLLM(_chat)}


def _conversations() -> dict[str, Conversation]:
    llms = _llms()
    convs: dict[str, Conversation] = {name: llm.conversation(START, 256) for name, llm in llms.items()}
    for name, llm in llms.items():
        convs[f"session/{name}"] = SessionConversation(llm, START, 256, None, lambda record: None)
    return convs


async def _two_turns(conv: Conversation) -> list[str]:
    """What an agent does, through the protocol only: a turn, an observation, a turn."""
    first = await conv.respond(PARAMS)
    assert conv.add_user("observation: 2 words")
    second = await conv.respond(PARAMS)
    return [first.text, second.text]


def test_every_client_is_an_llm_and_says_whether_it_can_be_trained_on():
    llms = _llms()
    assert all(isinstance(llm, LLM) for llm in llms.values())
    assert (llms["engine"].token_exact, llms["chat"].token_exact) == (True, False)


@pytest.mark.parametrize("kind", ["engine", "chat", "session/engine", "session/chat"])
def test_one_agent_routine_runs_on_every_conversation(kind):
    conv = _conversations()[kind]
    assert isinstance(conv, Conversation)
    before = len(conv.messages)
    texts = asyncio.run(_two_turns(conv))
    roles = [m["role"] for m in conv.messages[before:]]
    assert roles == ["assistant", "user", "assistant"], conv.messages
    assert conv.messages[-1]["content"] == texts[1]
    assert (len(conv) > 0) == kind.endswith("engine")  # token counts exist where token ids do
