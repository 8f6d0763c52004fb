"""The LM clients (``workers.agents.clients``): the official ``openai`` / ``anthropic`` libraries talking to loopback
stand-ins for an OpenAI-compatible server and Anthropic's Messages API (``chat_server`` in
tests/workers/conftest.py): answers, usage and finish reasons, n choices, the API-key rule, errors that name the
endpoint, timeouts, and closing. The RLM paths over the same clients: tests/workers/rlm/test_inference_backends.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.agents.clients import (
    AnthropicChat,
    AzureOpenAIChat,
    GeminiChat,
    LLMClientError,
    OpenAIChat,
    VercelChat,
    context_overflow,
    make_llm,
)
from workers.agents.llm import ChatLLM
from workers.event_loop import LoopThread
from workers.rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

PARAMS = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["</s>"])
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_openai_chat_request_answer_usage_and_finish_reason(chat_server):
    server = chat_server(lambda body: ("cut sho", "length"))
    llm = make_llm("openai", {"model_name": "m", "base_url": server.url})
    assert isinstance(llm, ChatLLM) and llm.name == "m"
    conv = llm.conversation(MESSAGES, None)
    resp = asyncio.run(conv.respond(PARAMS))
    assert (resp.text, resp.num_tokens, resp.prompt_tokens) == ("cut sho", 7, len("be brief") + len("hello"))
    assert (resp.model, resp.finish_reason) == ("m", "length")  # the turn records that it was cut
    (_, _, body, _) = server.requests[0]
    assert body["messages"] == MESSAGES
    assert (body["max_completion_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)
    assert (body["seed"], body["stop"]) == (3, ["</s>"])


def test_openai_choices_draws_n_answers_in_one_request(chat_server):
    server = chat_server(lambda body: "vote")
    chat = OpenAIChat("judge", base_url=server.url)
    out = asyncio.run(chat.choices([{"role": "user", "content": "q"}], 3, max_tokens=4, temperature=1.0))
    assert out == ["vote"] * 3 and len(server.requests) == 1 and server.requests[0][2]["n"] == 3


def test_anthropic_chat_system_stop_and_finish_reason(chat_server):
    server = chat_server(lambda body: ("partial", "length"), kind="anthropic")
    llm = make_llm("anthropic", {"model_name": "claude-x", "base_url": server.url, "api_key": "k"})
    out = asyncio.run(llm.chat(MESSAGES, max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["</s>"]))
    assert (out.text, out.completion_tokens, out.prompt_tokens, out.model) == ("partial", 7, 13, "claude-x")
    assert out.finish_reason == "length"
    (path, _, body, _) = server.requests[0]
    assert path == "/v1/messages" and body["system"] == "be brief"
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert (body["max_tokens"], body["stop_sequences"]) == (7, ["</s>"])
    assert "seed" not in body and "temperature" not in body  # the Messages SDK takes neither


def test_provider_key_only_for_the_providers_host(chat_server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-env")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-env")
    assert OpenAIChat("m").api_key == "sk-openai-env"  # base_url unset: OpenAI's own host
    assert OpenAIChat("m", base_url="https://api.openai.com/v1").api_key == "sk-openai-env"
    assert AnthropicChat("c").api_key == "sk-ant-env"
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-env")
    assert OpenAIChat("m", base_url="https://openrouter.ai/api/v1").api_key == "sk-or-env"
    assert OpenAIChat("m", base_url="https://proxy.example/v1").api_key is None
    openai_like = chat_server(lambda body: "ok")
    anthropic_like = chat_server(lambda body: "ok", kind="anthropic")
    asyncio.run(make_llm("openai", {"model_name": "m", "base_url": openai_like.url}).complete("q", PARAMS))
    asyncio.run(
        make_llm("anthropic", {"model_name": "c", "base_url": anthropic_like.url}).complete("q", PARAMS)
    )
    for server in (openai_like, anthropic_like):
        headers = server.requests[0][1]
        assert "Authorization" not in headers and "X-Api-Key" not in headers


def test_errors_name_backend_model_and_url(chat_server, closed_port_url):
    server = chat_server(lambda body: "never", failures=[400])
    with pytest.raises(
        LLMClientError, match=f"backend 'openai' \\(model m\\) at {server.url}: HTTP 400"
    ) as e:
        asyncio.run(make_llm("openai", {"model_name": "m", "base_url": server.url}).complete("q", PARAMS))
    assert "attempts" not in str(e.value) and len(server.requests) == 1  # a 400 is not retried
    slow = chat_server(lambda body: time.sleep(1.0) or "late")
    llm = make_llm("openai", {"model_name": "m", "base_url": slow.url, "timeout": 0.3, "max_retries": 0})
    with pytest.raises(LLMClientError, match="no answer within the timeout of 0.3s"):
        asyncio.run(llm.complete("q", PARAMS))
    llm = make_llm("anthropic", {"model_name": "c", "base_url": closed_port_url, "max_retries": 1})
    with pytest.raises(
        LLMClientError, match=f"backend 'anthropic' \\(model c\\) at {closed_port_url}: connection"
    ):
        asyncio.run(llm.complete("q", PARAMS))


def test_bad_kwargs_are_value_errors_naming_the_key():
    with pytest.raises(ValueError, match="max_retries"):
        make_llm("openai", {"model_name": "m", "max_retries": -1})
    with pytest.raises(ValueError, match="timeout"):
        make_llm("anthropic", {"model_name": "m", "timeout": 0})
    with pytest.raises(ValueError, match="'max_num_seq'"):
        make_llm("native", {"model_name": "/nowhere", "max_num_seq": 2})
    with pytest.raises(ValueError, match="api_key or api_key_env"):
        make_llm("openai", {"model_name": "m", "api_key": "a", "api_key_env": "B"})


def test_close_closes_the_clients_on_their_loops(chat_server):
    server = chat_server(lambda body: "ok")
    chat = OpenAIChat("m", base_url=server.url)
    loop = LoopThread(name="test-clients")
    try:
        assert loop.run(chat([{"role": "user", "content": "q"}], max_tokens=2, temperature=1.0)).text == "ok"
        client = next(iter(chat._clients.values()))
        chat.close()
        assert client.is_closed() and len(chat._clients) == 0
    finally:
        loop.stop()


def test_gemini_vercel_and_azure_presets(chat_server, monkeypatch):
    """gemini/vercel: presets of the OpenAI client (their default URL and key variable, for their own host
    only); azure_openai: the deployment URL scheme and Azure's api-key header. The loopback server stands in
    for Google's, Vercel's and Azure's endpoints (no network here)."""
    monkeypatch.setenv("GEMINI_API_KEY", "g-env")
    monkeypatch.setenv("AI_GATEWAY_API_KEY", "v-env")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "az-env")
    gemini = GeminiChat("gemini-2.5-flash")
    assert (gemini.url, gemini.api_key) == (
        "https://generativelanguage.googleapis.com/v1beta/openai",
        "g-env",
    )
    assert VercelChat("openai/gpt-5").api_key == "v-env"
    assert AzureOpenAIChat("dep", base_url="https://res.openai.azure.com").api_key == "az-env"
    assert AzureOpenAIChat("dep", base_url="https://proxy.example").api_key is None
    with pytest.raises(ValueError, match="azure_openai.*base_url"):
        make_llm("azure_openai", {"model_name": "dep"})
    with pytest.raises(ValueError, match="api_version"):
        make_llm("gemini", {"model_name": "g", "api_version": "x"})  # an Azure-only key

    server = chat_server(lambda body: "hi")
    out = asyncio.run(make_llm("gemini", {"model_name": "g", "base_url": server.url}).complete("q", PARAMS))
    assert out.text == "hi" and server.requests[0][0] == "/v1/chat/completions"
    assert "Authorization" not in server.requests[0][1]  # GEMINI_API_KEY is for Google's host only

    azure = chat_server(lambda body: "az")
    root = azure.url.removesuffix("/v1")
    llm = make_llm(
        "azure_openai", {"model_name": "dep", "base_url": root, "api_key": "k", "api_version": "2024-10-21"}
    )
    assert asyncio.run(llm.complete("q", PARAMS)).text == "az"
    path, headers, _, _ = azure.requests[0]
    assert path == "/openai/deployments/dep/chat/completions?api-version=2024-10-21"
    assert headers.get("api-key") == "k"


def test_context_refusals_of_sglang_and_vllm_are_read_for_the_window_and_the_input():
    sglang = (
        "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total "
        "of 2409 tokens: 1897 tokens from the input messages and 512 tokens for the completion."
    )
    assert context_overflow(sglang) == (2048, 1897)
    assert context_overflow(
        "The input (2160 tokens) is longer than the model's context length (2048 tokens)."
    ) == (
        2048,
        2160,
    )
    vllm = (
        "This model's maximum context length is 4096 tokens. However, you requested 4600 tokens (4100 in the "
        "messages, 500 in the completion). Please reduce the length of the messages or completion."
    )
    assert context_overflow(vllm) == (4096, 4100)
    assert context_overflow("top_k must be -1 (disable) or at least 1, got 0") is None
