"""``RLM(backend=..., backend_kwargs=..., other_backends=..., raise_on_error=...)`` end to end: a real sandbox,
the official ``openai`` / ``anthropic`` clients talking to loopback stand-ins for an OpenAI-compatible server and
for Anthropic's Messages API (``chat_server`` in tests/workers/conftest.py), and the tiny model on the native
engine (token-exact turns)."""

from __future__ import annotations

import pytest
from rlm_testlib import block

from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM, RLMError

pytestmark = pytest.mark.timeout(120)


def is_agent_turn(body: dict) -> bool:
    """An RLM turn carries the system prompt (an ``llm_query`` is one plain user message)."""
    return bool(body.get("system")) or body["messages"][0]["role"] == "system"


def rlm_script(turns: list[str], sub_prefix: str = "SUB:"):
    """A stand-in model: agent turn k answers ``turns[k]``; a sub-call answers ``sub_prefix + prompt``."""

    def reply(body: dict) -> str:
        if is_agent_turn(body):
            k = sum(m["role"] == "assistant" for m in body["messages"])
            return turns[min(k, len(turns) - 1)]
        return sub_prefix + body["messages"][-1]["content"]

    return reply


ASK_AND_FINISH = [block("v = llm_query('hi')\nprint(v)"), "FINAL_VAR(v)"]


def prompt_chars(body: dict) -> int:
    return sum(len(m["content"]) for m in body["messages"]) + len(body.get("system", ""))


def test_openai_backend_end_to_end_with_usage_headers_and_body(chat_server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env-must-not-leave")
    server = chat_server(rlm_script(ASK_AND_FINISH))
    kwargs = {
        "model_name": "root-m",
        "base_url": server.url,
        "api_key": "sk-explicit",
        "default_headers": {"X-Team": "hyflow"},
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    with RLM(backend="openai", backend_kwargs=kwargs, max_iterations=3) as rlm:
        res = rlm.completion("What does the sub-LM say?", context="xyz")
    assert (res.answer, res.status) == ("SUB:hi", "finished")
    assert server.paths() == {"/v1/chat/completions"}
    for _, headers, body, _ in server.requests:
        assert headers["Authorization"] == "Bearer sk-explicit" and headers["X-Team"] == "hyflow"
        assert body["model"] == "root-m" and body["chat_template_kwargs"] == {"enable_thinking": False}
    # each turn records the server's usage for its request
    agent_bodies = [b for _, _, b, _ in server.requests if is_agent_turn(b)]
    assert len(agent_bodies) == len(res.root.turns) == 2
    for turn, body in zip(res.root.turns, agent_bodies):
        assert turn.usage["prompt_tokens"] == prompt_chars(body) > 0
        assert turn.usage["completion_tokens"] == len(turn.response_text) > 0
        assert turn.usage["model"] == "root-m" and turn.response_token_ids == []
    assert res.root.metadata["subcalls"][0]["tokens"] == len("SUB:hi")


def test_api_key_goes_only_where_asked(chat_server, monkeypatch):
    """No key is sent to a URL other than the provider's unless given; ``api_key_env`` names a variable."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env-must-not-leave")
    monkeypatch.setenv("MY_SERVER_KEY", "sk-mine")
    server = chat_server(rlm_script(["FINAL(ok)"]))
    with RLM(backend_kwargs={"model_name": "m", "base_url": server.url}, max_iterations=1) as rlm:
        assert rlm.completion("q").answer == "ok"  # backend "openai" is the default without an engine
    with RLM(
        backend="openai",
        backend_kwargs={"model_name": "m", "base_url": server.url, "api_key_env": "MY_SERVER_KEY"},
        max_iterations=1,
    ) as rlm:
        assert rlm.completion("q").answer == "ok"
    first, second = (h for _, h, _, _ in server.requests)
    assert "Authorization" not in first and second["Authorization"] == "Bearer sk-mine"
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE"):
        RLM(backend="openai", backend_kwargs={"model_name": "m", "api_key_env": "NOT_SET_ANYWHERE"})


def test_429_then_500_are_retried_with_backoff_and_max_retries_0_fails(chat_server):
    server = chat_server(rlm_script(["FINAL(done)"]), failures=[429, 500])
    kw = {"model_name": "m", "base_url": server.url, "max_retries": 2}
    with RLM(backend="openai", backend_kwargs=kw, max_iterations=1) as rlm:
        res = rlm.completion("q")
    assert (res.status, res.answer) == ("finished", "done")
    times = [t for _, _, _, t in server.requests]
    assert len(times) == 3  # 429, 500, then the answer
    assert all(b - a > 0.3 for a, b in zip(times, times[1:]))  # the library's backoff (0.5 s, 1 s; jittered)

    server = chat_server(rlm_script(["FINAL(done)"]), failures=[429])
    kw = {"model_name": "m", "base_url": server.url, "max_retries": 0}
    with RLM(backend="openai", backend_kwargs=kw, max_iterations=1) as rlm:
        res = rlm.completion("q")
    assert res.status == "error" and len(server.requests) == 1
    assert f"backend 'openai' (model m) at {server.url}: HTTP 429" in res.root.error


def test_unreachable_endpoint_error_names_backend_and_url(closed_port_url):
    kw = {"model_name": "m", "base_url": closed_port_url, "max_retries": 1}
    with RLM(backend="openai", backend_kwargs=kw, max_iterations=1) as rlm:
        res = rlm.completion("q")
    assert res.status == "error" and res.answer is None
    assert f"backend 'openai' (model m) at {closed_port_url}: connection failed" in res.root.error
    assert res.root.error.endswith("after 2 attempts")
    with RLM(backend="openai", backend_kwargs=kw, max_iterations=1, raise_on_error=True) as rlm:
        with pytest.raises(RLMError, match="backend 'openai'.*" + closed_port_url) as info:
            rlm.completion("q")
    assert info.value.result.status == "error" and info.value.result.root.error in str(info.value)


def test_anthropic_backend_end_to_end(chat_server, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-env-must-not-leave")
    server = chat_server(rlm_script(ASK_AND_FINISH, sub_prefix="CLAUDE:"), kind="anthropic")
    kw = {"model_name": "claude-x", "base_url": server.url, "api_key": "sk-ant-explicit"}
    agent = AgentConfig(max_new_tokens=64, final_answer_on_exhaustion=True)
    with RLM(backend="anthropic", backend_kwargs=kw, max_iterations=3, agent_config=agent) as rlm:
        res = rlm.completion("What does the sub-LM say?", context="xyz")
    assert (res.answer, res.status) == ("CLAUDE:hi", "finished")
    assert server.paths() == {"/v1/messages"}
    for _, headers, body, _ in server.requests:
        sent = headers.get("X-Api-Key") or headers.get("Authorization", "")
        assert sent.endswith("sk-ant-explicit") and body["model"] == "claude-x"
        assert all(m["role"] in ("user", "assistant") for m in body["messages"])  # system goes in system=
    agent_bodies = [b for _, _, b, _ in server.requests if is_agent_turn(b)]
    assert agent_bodies[0]["max_tokens"] == 64 and "llm_query" in agent_bodies[0]["system"]
    for turn, body in zip(res.root.turns, agent_bodies):
        assert turn.usage["prompt_tokens"] == prompt_chars(body) and turn.usage["model"] == "claude-x"
        assert turn.usage["completion_tokens"] == len(turn.response_text)


def test_other_backends_are_reached_by_model_name(chat_server):
    code = (
        "a = llm_query('x')\n"  # the first other backend answers llm_query without model=
        "b = llm_query('x', model='c-model')\n"
        "r = llm_query('x', model='root-m')\n"
        "u = llm_query('x', model='nope')\n"
        "out = [a, b, r, u[:40]]"
    )
    root = chat_server(rlm_script([block(code), "FINAL_VAR(out)"], sub_prefix="ROOT:"))
    b = chat_server(rlm_script([], sub_prefix="B:"))
    c = chat_server(rlm_script([], sub_prefix="C:"), kind="anthropic")
    with RLM(
        backend="openai",
        backend_kwargs={"model_name": "root-m", "base_url": root.url},
        other_backends=["openai", "anthropic"],
        other_backend_kwargs=[
            {"model_name": "b-model", "base_url": b.url},
            {"model_name": "c-model", "base_url": c.url},
        ],
        max_iterations=3,
    ) as rlm:
        res = rlm.completion("route")
    assert res.status == "finished"
    assert res.answer == "['B:x', 'C:x', 'ROOT:x', 'Error: llm_query failed: ValueError: unk']"
    assert [b["model"] for _, _, b, _ in b.requests] == ["b-model"]
    assert [b["model"] for _, _, b, _ in c.requests] == ["c-model"]
    assert len(root.requests) == 3  # two agent turns and the model='root-m' sub-call


def test_construction_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown backend 'bedrock'"):
        RLM(backend="bedrock", backend_kwargs={"model_name": "m"})
    with pytest.raises(ValueError, match="model_name"):
        RLM(backend="openai", backend_kwargs={"base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ValueError, match="'temprature'"):
        RLM(backend="openai", backend_kwargs={"model_name": "m", "temprature": 0.5})
    with pytest.raises(ValueError, match="other_backend_kwargs has 0 entries for 1"):
        RLM(backend_kwargs={"model_name": "m"}, other_backends=["openai"], other_backend_kwargs=[])
    with pytest.raises(ValueError, match=r"other_backends\[0\]: backend 'anthropic' needs .*model_name"):
        RLM(backend_kwargs={"model_name": "m"}, other_backends=["anthropic"])
    with pytest.raises(ValueError, match="share the model_name 'm'"):
        RLM(
            backend_kwargs={"model_name": "m"},
            other_backends=["openai"],
            other_backend_kwargs=[{"model_name": "m"}],
        )
    with pytest.raises(ValueError, match="backend='openai'"):
        RLM("openai")  # rlms' positional habit: the first argument here is an engine
    with pytest.raises(ValueError, match="not both"):
        RLM(engine=lambda ids, p: None, tokenizer=object(), backend="openai")


def check_token_exact_turns(root, model: str) -> None:
    """The model's tokens are the engine's, each turn's usage counts the sequence before it and its tokens."""
    ids, mask, lps = root.token_sequence()
    assert [t for t, m in zip(ids, mask) if m] == [t for turn in root.turns for t in turn.response_token_ids]
    seen = 0
    for turn in root.turns:
        seen += len(turn.prompt_token_ids)
        usage = {k: turn.usage[k] for k in ("prompt_tokens", "completion_tokens", "model")}
        assert usage == {
            "prompt_tokens": seen,
            "completion_tokens": len(turn.response_token_ids),
            "model": model,
        }
        assert len(turn.response_token_ids) == len(turn.response_logprobs) > 0
        seen += len(turn.response_token_ids)


def test_native_backend_gives_token_exact_turns():
    from workers.models.tiny import ensure_tiny_model

    path = ensure_tiny_model("nano")
    kw = {"model_name": path, "seed": 0, "max_num_seqs": 4}
    agent = AgentConfig(max_new_tokens=8, temperature=0.0, final_answer_on_exhaustion=True)
    rlm = RLM(backend="native", backend_kwargs=kw, max_iterations=2, agent_config=agent)
    try:
        res = rlm.completion("What is in the context?", context="some text")
        engine = rlm.policy.engine
    finally:
        rlm.close()
    assert engine._executor is None  # close() shut the engine it built down
    assert res.status in ("finished", "max_iterations") and len(res.root.turns) >= 1
    check_token_exact_turns(res.root, path)


@pytest.mark.sglang
@pytest.mark.timeout(600)
def test_sglang_backend_gives_token_exact_turns(sglang_module):
    """SGLang's offline engine (CPU engine without a GPU): RLM drives it on the engine's own loop."""
    import torch

    from workers.models.tiny import ensure_tiny_model

    path = ensure_tiny_model("nano")
    kw = {
        "model_name": path,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": "float32",
        "mem_fraction_static": 0.3,
        "engine_kwargs": {"max_total_tokens": 4096, "chunked_prefill_size": 1024, "context_length": 2048},
    }
    agent = AgentConfig(max_new_tokens=8, temperature=0.0, final_answer_on_exhaustion=True)
    rlm = RLM(backend="sglang", backend_kwargs=kw, max_iterations=2, agent_config=agent)
    try:
        first = rlm.completion("What is in the context?", context="some text")
        again = rlm.completion("What is in the context?", context="some text")
        life = rlm.policy.engine.life
    finally:
        rlm.close()
    assert life._closed  # close() shut the engine it built down
    assert first.status in ("finished", "max_iterations") and len(first.root.turns) >= 1
    check_token_exact_turns(first.root, path)
    # greedy: the same prompt gives the same tokens
    assert [t.response_token_ids for t in first.root.turns] == [
        t.response_token_ids for t in again.root.turns
    ]
