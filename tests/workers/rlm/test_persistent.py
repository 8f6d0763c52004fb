"""RLM(persistent=True): one REPL and one conversation across completion calls, compaction of the conversation
when it fills the window; through ``RLM()`` with a scripted policy (the tiny model's tokenizer, fixed turns) and a
real sandbox."""

from __future__ import annotations

import asyncio

import pytest
from rlm_testlib import block

from workers.agents.chat_format import ChatFormat
from workers.agents.llm import ChatLLM, Completion
from workers.agents.scripted import scripted_generate
from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM
from workers.rlm.prompts import build_messages
from workers.rlm.session import SUMMARY_INTRO
from workers.sandbox import ReplSandbox, SandboxConfig

pytestmark = pytest.mark.timeout(120)

ASSISTANT = "<|im_start|>assistant"
USER = "<|im_start|>user\n"  # a question starts its user message
RESTATED = "The question you are answering now:\n"  # ... or is restated after a compaction
SUMMARY = "SUMMARY: v0..v4 hold 0..4; next: add them."


class SessionScript:
    """A scripted policy that follows a session: the question being answered is the *last* one that starts a
    user message (or is restated after a compaction) -- `ReplayScript` takes the first query, which in a
    session is the first call's -- and each question's turns are replayed in the order they are asked for
    (a compacted prompt no longer shows how many turns came before). A summary request gets `SUMMARY`; any
    other prompt is an llm_query."""

    def __init__(self, by_query: dict[str, list[str]]):
        self.by_query = by_query
        self.asked = dict.fromkeys(by_query, 0)
        self.summary_requests: list[str] = []

    def __call__(self, prompt: str) -> str:
        if "Summarize it so you can continue without it" in prompt:
            self.summary_requests.append(prompt)
            return SUMMARY
        found = [
            (prompt.rfind(lead + q), q)
            for q in self.by_query
            for lead in (USER, RESTATED)
            if lead + q in prompt
        ]
        if not found or ASSISTANT not in prompt:
            return "sub-answer"
        query = max(found)[1]
        turns = self.by_query[query]
        self.asked[query] += 1
        return turns[min(self.asked[query] - 1, len(turns) - 1)]


SCRIPT = {
    "Q1-first": [block("secret = context.upper() + '-42'\nprint(secret)"), "FINAL_VAR(secret)"],
    "Q2-second": [
        block("print(secret, context, context_1)\nkid = rlm_query('Q-child', 'c')"),
        block("FINAL(secret + '|' + context_1 + '|' + kid)"),
    ],
    # a child of a persistent root still gets a fresh REPL of its own
    "Q-child": [block("FINAL(str('secret' in globals()))")],
}


@pytest.fixture
def sandbox():
    with ReplSandbox(SandboxConfig(timeout_s=5, max_output_chars=5000)) as sb:
        yield sb


def test_variables_and_history_carry_over_between_calls(tok, sandbox):
    gen = scripted_generate(tok, SessionScript(SCRIPT))
    with RLM(
        engine=gen, tokenizer=tok, sandbox=sandbox, max_depth=1, max_iterations=4, persistent=True
    ) as rlm:
        first = rlm.completion("Q1-first", context="alpha")
        second = rlm.completion("Q2-second", context="beta-doc")
        assert sandbox.num_repls == 1  # the session's REPL stays open between calls (children's are closed)
    assert sandbox.num_repls == 0  # close() ends the session
    assert (first.status, first.answer) == ("finished", "ALPHA-42")
    # the second call's code saw the first call's variable; `context` is still the first call's, the new
    # context is context_1; the child ran in a fresh REPL without the session's variables
    assert (second.status, second.answer) == ("finished", "ALPHA-42|beta-doc|False")
    assert second.root.turns[0].code_results[0].stdout == "ALPHA-42 alpha beta-doc\n"
    # history: the second call's first prompt holds the first call's question, turns and observation
    prompt = second.root.turns[0].prompt_text
    assert prompt.index("Q1-first") < prompt.index("secret = context.upper()") < prompt.index("Q2-second")
    assert "ALPHA-42" in prompt and "FINAL_VAR(secret)" in prompt
    assert "`context_1` is a str of 8 characters" in prompt
    assert prompt.count("<|im_start|>system") == 1  # one conversation, not two


def test_calls_without_persistent_stay_independent(tok, sandbox):
    gen = scripted_generate(tok, SessionScript(SCRIPT))
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_depth=1, max_iterations=2) as rlm:
        first = rlm.completion("Q1-first", context="alpha")
        second = rlm.completion("Q2-second", context="beta-doc")
        assert sandbox.num_repls == 0
    assert first.answer == "ALPHA-42"
    assert "NameError" in second.root.turns[0].code_results[0].error  # no `secret` in a fresh REPL
    assert "Q1-first" not in second.root.turns[0].prompt_text


# Each turn prints ~20 lines; with a window of the system prompt + 800 tokens the conversation fills up and is
# compacted; the variables live in the REPL, so the last turn still adds them all up.
FILL = "for i in range(20):\n    print(f'line {i}: value {i * 7}')"
LONG = {
    "Q-long": [block(f"v{k} = {k}\n{FILL}") for k in range(5)] + [block("FINAL(str(v0 + v1 + v2 + v3 + v4))")]
}


def long_session(tok, sandbox, script, compaction_threshold) -> RLM:
    """A persistent RLM whose window holds the system prompt plus 800 tokens: the LONG script's six turns
    overflow it."""
    system_tokens = len(ChatFormat(tok).prompt_ids(build_messages("Q-long", context="data")))
    cfg = AgentConfig(max_iterations=6, max_new_tokens=64, max_sequence_tokens=system_tokens + 800)
    return RLM(
        engine=scripted_generate(tok, script),
        tokenizer=tok,
        sandbox=sandbox,
        agent_config=cfg,
        persistent=True,
        compaction_threshold=compaction_threshold,
    )


def test_compaction_summarises_older_turns_and_the_run_finishes(tok, sandbox):
    script = SessionScript({**LONG, "Q-next": [block("FINAL(str(v4 * 10))")]})
    with long_session(tok, sandbox, script, 0.9) as rlm:
        cfg = rlm.config
        res = rlm.completion("Q-long", context="data")
        nxt = rlm.completion("Q-next")
    assert (res.status, res.answer, len(res.root.turns)) == ("finished", "10", 6)
    compactions = res.root.metadata["compactions"]
    assert compactions and all(c["method"] == "model" and c["summary"] == SUMMARY for c in compactions)
    first = compactions[0]
    assert first["trigger"] == "threshold" and first["tokens_after"] < first["tokens_before"]
    assert first["tokens_before"] + cfg.max_new_tokens > 0.9 * cfg.max_sequence_tokens  # it was due
    assert compactions[0]["usage"]["completion_tokens"] > 0  # the summary call is accounted for
    # the model was asked to summarise the older turns (the first turn's code), and then saw the summary
    # instead of them, with its question restated and the last exchange kept
    assert "v0 = 0" in script.summary_requests[0]
    after = res.root.turns[compactions[0]["turn"]].prompt_text
    assert SUMMARY_INTRO + SUMMARY in after and "Q-long" in after and "v0 = 0" not in after
    assert all(
        len(t.prompt_token_ids) + len(t.response_token_ids) <= cfg.max_sequence_tokens for t in res.root.turns
    )
    # the session goes on from the compacted history
    assert (nxt.status, nxt.answer) == ("finished", "40")
    assert SUMMARY in nxt.root.turns[0].prompt_text


class FailingSummaries(SessionScript):
    def __call__(self, prompt: str) -> str:
        if "Summarize it so you can continue without it" in prompt:
            raise RuntimeError("the summary request failed")
        return super().__call__(prompt)


def test_a_failed_summary_falls_back_to_the_truncated_transcript(tok, sandbox):
    with long_session(tok, sandbox, FailingSummaries(LONG), 0.9) as rlm:
        res = rlm.completion("Q-long", context="data")
    assert (res.status, res.answer) == ("finished", "10")
    first = res.root.metadata["compactions"][0]
    assert first["method"] == "truncated" and first["usage"] == {}
    assert first["summary"].startswith("[assistant]") and "v0 = 0" in first["summary"]


def test_without_compaction_a_full_window_ends_the_call_with_budget(tok, sandbox):
    """The same run with compaction off stops when the window is full: the test above is not vacuous."""
    with long_session(tok, sandbox, SessionScript(LONG), None) as rlm:
        res = rlm.completion("Q-long", context="data")
    assert res.status == "budget" and "compactions" not in res.root.metadata


def test_a_text_only_chat_model_gets_the_whole_conversation_each_call(sandbox):
    """A message-level model (`ChatLLM`; a Python chat function stands in for an OpenAI-compatible server):
    the second call's requests carry the first call's messages."""
    requests: list[list[dict]] = []
    replies = {
        "Q1-first": [block("secret = context.upper() + '-42'"), "FINAL_VAR(secret)"],
        "Q2-second": [block("FINAL(secret + '|' + context_1)")],
    }

    async def chat(messages, **kwargs):
        requests.append([dict(m) for m in messages])

        # the question: the last user message that starts with one; the turn: assistant messages after it
        def asks(m):
            return next((q for q in replies if m["role"] == "user" and m["content"].startswith(q)), None)

        start = max(i for i, m in enumerate(messages) if asks(m))
        question = asks(messages[start])
        turn = sum(m["role"] == "assistant" for m in messages[start:])
        return Completion(replies[question][turn], 5, 100, "chat-model")

    with RLM(engine=ChatLLM(chat, name="chat-model"), sandbox=sandbox, persistent=True) as rlm:
        first = rlm.completion("Q1-first", context="alpha")
        second = rlm.completion("Q2-second", context="beta")
    assert (first.answer, second.answer) == ("ALPHA-42", "ALPHA-42|beta")
    last = requests[-1]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2]["content"] == replies["Q1-first"][0] and last[4]["content"] == "FINAL_VAR(secret)"
    assert last[5]["content"].startswith("Q2-second") and "`context_1`" in last[5]["content"]


def test_a_session_runs_one_completion_at_a_time(tok, sandbox):
    gen = scripted_generate(tok, SessionScript(SCRIPT), delay_s=0.05)
    rlm = RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=4, persistent=True)

    async def both():
        return await asyncio.gather(
            rlm.acompletion("Q1-first", context="alpha"),
            rlm.acompletion("Q1-first", context="beta"),
            return_exceptions=True,
        )

    try:
        first, second = asyncio.run(both())
    finally:
        rlm.close()
    assert first.answer == "ALPHA-42"
    assert isinstance(second, RuntimeError) and "one completion at a time" in str(second)
    assert sandbox.num_repls == 0
