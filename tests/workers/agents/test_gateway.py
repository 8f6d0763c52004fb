"""The OpenAI-compatible endpoint (``workers.agents.gateway``) with the real ``openai`` client over real HTTP.

A recording engine stands in for the model (``RecordingEngine``: one token per character, a tokenization that
re-tokenizing the text would not reproduce, and every prompt it was fed kept). An agent written only against
``openai.AsyncOpenAI`` -- echoing the reply message it got, answering tool calls with ``tool`` messages -- must
train on exactly the tokens the engine was fed and produced, whatever the template does (Qwen3's drops earlier
reasoning after a user message, DeepSeek-R1's at every turn, Llama 3's JSON tools), and when the agent rewrites
its own history or calls in parallel. Then every refusal: an OpenAI error body with the right status.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.workers.agents.test_template_exactness import TOOLS, RecordingEngine, rows_of
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.gateway import Gateway, GatewayConfig, TrajectorySampling
from workers.agents.llm import EngineLLM
from workers.agents.tool_calls import tool_parser
from workers.agents.trajectory import Trajectory
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model

PARSERS = {"qwen3": "hermes", "deepseek_r1": "hermes", "llama3": "llama3_json", "chatml": "hermes"}
START = [{"role": "system", "content": "Count up."}, {"role": "user", "content": "Start at 0."}]


def tokenizer(template: str):
    return load_tokenizer(ensure_tiny_model("nano", chat_template=template))


def script(template: str, turns: int, think: bool, tools: bool) -> list[str]:
    """Turn k's text: reasoning (closing the block DeepSeek-R1's generation prompt opened), then a tool call in
    the template's format, or prose."""
    parser = tool_parser(PARSERS[template])
    out = []
    for k in range(turns):
        opened = template == "deepseek_r1"
        thought = f"{'' if opened else '<think>'}step {k}</think>\n" if think else ""
        last = k == turns - 1
        body = (
            f"The count is {k + 1}."
            if last or not tools
            else parser.format_call("python", {"code": f"{k}+1"})
        )
        out.append(thought + body)
    return out


async def serve(gateway: Gateway):
    await gateway.start()
    return gateway


async def openai_agent(client: openai.AsyncOpenAI, turns: int, tools: bool) -> list:
    """A plain OpenAI-client agent: echo each reply, answer its tool calls (or give a user observation)."""
    messages, replies = [dict(m) for m in START], []
    for k in range(turns):
        kwargs = {"tools": TOOLS} if tools else {}
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=400, **kwargs)
        message = r.choices[0].message
        replies.append(r)
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(k + 1)})
        elif k < turns - 1:
            messages.append({"role": "user", "content": f"Result: {k + 1}. Go on."})
    return replies


def run_agent(template: str, turns: int, think: bool, tools: bool, agent=openai_agent):
    tok = tokenizer(template)
    engine = RecordingEngine(tok, script(template, turns, think, tools))
    llm = EngineLLM(engine, tok)

    async def go():
        gateway = await serve(Gateway(GatewayConfig(tool_parser=PARSERS[template])))
        try:
            gateway.open("t", llm, TrajectorySampling(max_new_tokens=400))
            client = openai.AsyncOpenAI(base_url=gateway.trajectory_url("t"), api_key="k", max_retries=0)
            replies = await agent(client, turns, tools)
            return replies, gateway.close("t")
        finally:
            await gateway.stop()

    replies, live = asyncio.run(go())
    traj = Trajectory(id="t", query="Start at 0.", root_uid="u", turns=live.turns, status="finished")
    return tok, engine, replies, traj


CASES = [
    # template, think, tools, rewrites
    ("chatml", True, False, False),
    ("qwen3", True, True, False),  # tool results are no user message: Qwen3 keeps the reasoning
    ("qwen3", True, False, True),  # a user message after reasoning: the earlier <think> is dropped
    ("deepseek_r1", True, True, True),  # every earlier reasoning is dropped
    ("llama3", False, True, False),
]


@pytest.mark.parametrize("turns", [1, 4])
@pytest.mark.parametrize("template,think,tools,rewrites", CASES)
def test_an_openai_client_agent_trains_on_the_tokens_fed_and_produced(
    template, think, tools, rewrites, turns
):
    tok, engine, replies, traj = run_agent(template, turns, think, tools)
    assert len(engine.fed) == turns and traj.rewritten == (rewrites and turns > 1)
    # the client got OpenAI tool calls parsed from the model's own format, and the extension fields
    for k, r in enumerate(replies):
        calls = r.choices[0].message.tool_calls
        if tools and k < turns - 1:
            assert r.choices[0].finish_reason == "tool_calls"
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("python", {"code": f"{k}+1"})
            ]
        else:
            assert not calls and r.choices[0].message.content.endswith(f"The count is {k + 1}.")
        assert r.model_extra["prompt_token_ids"] == engine.fed[k]
        assert r.choices[0].model_extra["token_ids"] == engine.produced[k]
        assert r.usage.prompt_tokens == len(engine.fed[k]) and r.usage.completion_tokens == len(
            engine.produced[k]
        )
    # the model's own tokens were never re-tokenized: the canonical encoding of its text differs
    if think:
        text = tok.decode(engine.produced[0][:-1])
        assert tok.encode(text, add_special_tokens=False) != engine.produced[0][:-1]

    rows = rows_of(
        trajectories_to_dataproto([traj], max_prompt_length=4096, max_response_length=4096, pad_token_id=0),
        tok,
    )
    if traj.rewritten:  # one row per call, each exactly what that call fed and produced
        assert [(p, r, t) for p, r, t in rows] == [(f, o, o) for f, o in zip(engine.fed, engine.produced)]
    else:  # one growing sequence: every call extended the previous one token for token
        ((p, r, trained),) = rows
        assert p == engine.fed[0] and p + r == engine.fed[-1] + engine.produced[-1]
        assert trained == [t for ids in engine.produced for t in ids]
        for k in range(
            1, turns
        ):  # each call's prompt is the previous call's prompt and reply, then new tokens
            prev = engine.fed[k - 1] + engine.produced[k - 1]
            assert engine.fed[k][: len(prev)] == prev


async def history_editing_agent(client, turns, tools):
    """Keeps only the system prompt, the task and the last reply: each call after the second rewrites history."""
    messages, replies = [dict(m) for m in START], []
    for k in range(turns):
        r = await client.chat.completions.create(model="policy", messages=messages)
        replies.append(r)
        reply = r.choices[0].message.model_dump(exclude_none=True)
        messages = [*START, reply, {"role": "user", "content": f"Result: {k + 1}. Go on."}]
    return replies


def test_a_call_that_does_not_extend_the_previous_one_starts_a_new_segment():
    tok, engine, _, traj = run_agent("chatml", 4, False, False, agent=history_editing_agent)
    assert [t.full_prompt for t in traj.turns] == [False, False, True, True]
    rows = rows_of(
        trajectories_to_dataproto([traj], max_prompt_length=4096, max_response_length=4096, pad_token_id=0),
        tok,
    )
    # rewritten: one row per call; each row's prompt and reply are exactly what that call fed and produced
    assert [(p, r) for p, r, _ in rows] == list(zip(engine.fed, engine.produced))


async def parallel_agent(client, turns, tools):
    """Two calls at once from the same history (e.g. two samples to compare), then one continuing the first."""
    first, second = await asyncio.gather(
        *(client.chat.completions.create(model="policy", messages=START) for _ in range(2))
    )
    follow = [
        *START,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "More."},
    ]
    third = await client.chat.completions.create(model="policy", messages=follow)
    return [first, second, third]


def test_parallel_calls_in_one_trajectory_each_train_exactly():
    tok, engine, replies, traj = run_agent("chatml", 3, False, False, agent=parallel_agent)
    rows = rows_of(
        trajectories_to_dataproto([traj], max_prompt_length=4096, max_response_length=4096, pad_token_id=0),
        tok,
    )
    # every call the engine served is in a row, as fed and produced (none lost, none re-rendered)
    # three rows, one per call: the second call repeats the first's prompt and the third continues the first, so
    # neither extends the call recorded just before it; each row is exactly what its call fed and produced
    assert [t.full_prompt for t in traj.turns] == [False, True, True]
    assert sorted((p, r) for p, r, _ in rows) == sorted(zip(engine.fed, engine.produced))
    assert engine.fed[2][: len(engine.fed[0]) + len(engine.produced[0])] == engine.fed[0] + engine.produced[0]


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return tokenizer("qwen3")


def refusals(tok, config: GatewayConfig, requests):
    """Serve a default policy (and one live trajectory "live"); send ``requests`` (method, path, body or raw
    bytes, headers) with httpx; return (status, error body) of each."""

    async def go():
        engine = RecordingEngine(tok, ["hello"] * 100)
        llm = EngineLLM(engine, tok, max_model_len=600)
        gateway = await serve(Gateway(config, default=llm))
        gateway.open("live", llm, TrajectorySampling(max_calls=1))
        out = []
        try:
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                for method, path, body, headers in requests:
                    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                    r = await http.request(method, path, headers=headers or {}, **kwargs)
                    out.append((r.status_code, r.json()))
        finally:
            await gateway.stop()
        return out

    return asyncio.run(go())


def chat(**extra):
    return {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_bad_requests_get_a_clear_openai_error(tok):
    P = "/v1/chat/completions"
    cases = [
        ("POST", P, b"{not json", None, 400, None, "not valid JSON"),
        ("POST", P, chat(model="gpt-4o"), None, 404, "model", "does not exist here; this server serves 'policy'"),
        ("POST", P, chat(n=2), None, 400, "n", "one choice per request"),
        ("POST", P, chat(tool_choice="required", tools=TOOLS), None, 400, "tool_choice", "'auto' or 'none'"),
        ("POST", P, chat(frequency_penalty=0.5), None, 400, "frequency_penalty", "not supported"),
        ("POST", P, chat(temperature=3), None, 400, "temperature", "[0.0, 2.0]"),
        ("POST", P, chat(best_guess=1), None, 400, "best_guess", "unrecognized request argument"),
        ("POST", P, {"model": "policy", "messages": []}, None, 400, "messages", "non-empty list"),
        ("POST", P, chat(messages=[{"role": "robot", "content": "x"}]), None, 400, "messages[0]", "role must be"),
        ("POST", P, chat(messages=[{"role": "user", "content": "word " * 700}]), None, 400, "messages",
         "no room to generate"),
        ("POST", "/trajectories/gone/v1/chat/completions", chat(), None, 404, "trajectory_id", "is not live"),
        ("POST", "/trajectories/live/v1/chat/completions", chat(), None, 200, None, None),
        ("POST", "/trajectories/live/v1/chat/completions", chat(), None, 400, None, "made its 1 calls"),
        ("POST", "/v1/completions", {"model": "policy", "prompt": "hi", "echo": True}, None, 400, "echo", "echo"),
        ("POST", "/v1/completions", {"model": "policy", "prompt": []}, None, 400, "prompt", "non-empty"),
        ("GET", "/v1/nothing", None, None, 404, None, "GET /v1/nothing"),
    ]  # fmt: skip
    got = refusals(tok, GatewayConfig(), [c[:4] for c in cases])
    for (_, path, _, _, status, param, words), (code, body) in zip(cases, got):
        assert code == status, (path, body)
        if status != 200:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
            assert param is None or err["param"] == param, err


def test_size_concurrency_and_key_limits(tok):
    config = GatewayConfig(api_key="secret", max_request_bytes=2000, max_concurrent_requests=1)
    auth = {"Authorization": "Bearer secret"}
    got = refusals(
        tok,
        config,
        [
            ("POST", "/v1/chat/completions", chat(), None),
            ("POST", "/v1/chat/completions", chat(), {"Authorization": "Bearer wrong"}),
            ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 3000}]), auth),
            ("POST", "/v1/chat/completions", chat(), auth),
        ],
    )
    assert [c for c, _ in got] == [401, 401, 413, 200]
    assert "server.max_request_bytes" in got[2][1]["error"]["message"]

    async def crowd():  # two at once through a server that takes one: the second is told to retry
        slow = RecordingEngine(tok, ["hi"] * 4)
        original = slow.generate

        async def generate(prompt_ids, params):
            await asyncio.sleep(0.3)
            return await original(prompt_ids, params)

        slow.generate = generate
        gateway = await serve(Gateway(GatewayConfig(max_concurrent_requests=1), default=EngineLLM(slow, tok)))
        try:
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                return await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=chat()) for _ in range(2))
                )
        finally:
            await gateway.stop()

    codes = sorted(r.status_code for r in asyncio.run(crowd()))
    assert codes == [200, 429]


def test_streaming_gives_the_same_reply_and_tool_calls(tok):
    parser = tool_parser("hermes")
    text = "<think>ok</think>\n" + parser.format_call("python", {"code": "1+1"})

    async def go():
        engine = RecordingEngine(tok, [text, text])
        gateway = await serve(Gateway(default=EngineLLM(engine, tok)))
        try:
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
            kwargs = {"model": "policy", "messages": START, "tools": TOOLS}
            whole = await client.chat.completions.create(**kwargs)
            stream = await client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            return whole, [c async for c in stream]
        finally:
            await gateway.stop()

    whole, chunks = asyncio.run(go())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == whole.choices[0].message.content == "<think>ok</think>"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert finish == ["tool_calls"] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_trajectory_can_be_named_by_header_or_body_and_completions_are_recorded(tok):
    """A client whose base_url it cannot change names its trajectory in a header or in extra_body; a plain
    completion in a trajectory is recorded like a chat call (its prompt as given)."""

    async def go():
        engine = RecordingEngine(tok, ["one", "two", "three"])
        llm = EngineLLM(engine, tok)
        gateway = await serve(Gateway())
        try:
            for tid in ("by-header", "by-body"):
                gateway.open(tid, llm, TrajectorySampling())
            headed = openai.AsyncOpenAI(
                base_url=gateway.url + "/v1",
                api_key="k",
                default_headers={"X-Hyflow-Trajectory": "by-header"},
            )
            await headed.chat.completions.create(model="policy", messages=START)
            await headed.completions.create(model="policy", prompt="red cat", max_tokens=8)
            plain = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k")
            await plain.chat.completions.create(
                model="policy", messages=START, extra_body={"trajectory_id": "by-body"}
            )
            return engine, gateway.close("by-header"), gateway.close("by-body")
        finally:
            await gateway.stop()

    engine, headed, bodied = asyncio.run(go())
    assert [t.response_token_ids for t in headed.turns] == engine.produced[:2]
    assert headed.turns[1].full_prompt and headed.turns[1].prompt_token_ids == tok.encode("red cat")
    assert [t.response_token_ids for t in bodied.turns] == [engine.produced[2]]
