"""``python -m recipes.serve``: a model on hyflow's own OpenAI-compatible endpoint, answering the ``openai`` client
(streaming included), ``curl`` and the RLM API's ``openai`` backend. The tiny model (Qwen3-style template) on the
native engine, in a subprocess as a user starts it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import openai
import pytest

from recipes.serve import main, model_directory
from workers.models.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def server():
    model = ensure_tiny_model("nano", chat_template="qwen3")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recipes.serve",
            "--model",
            model,
            "--port",
            "0",
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving tiny at http://127.0.0.1:"), line + proc.stderr.read()
        yield line.split(" at ")[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_openai_client_chats_streams_and_completes(server):
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "user", "content": "How many words: red cat"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True
    )
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and whole.usage.completion_tokens == len(
        choice.token_ids
    )
    assert len(choice.logprobs.content) == len(choice.token_ids) and whole.model_extra["prompt_token_ids"]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    text = client.completions.create(model="tiny", prompt="red cat", max_tokens=4, temperature=0)
    assert text.choices[0].text is not None and text.usage.completion_tokens <= 4
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.chat.completions.create(model="gpt-4o", messages=messages)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl(server):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    out = subprocess.run(
        ["curl", "-s", f"{server}/chat/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    reply = json.loads(out)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 3


def test_the_rlm_openai_backend_runs_on_it(server):
    from workers.rlm.inference import RLM

    rlm = RLM(
        backend="openai",
        backend_kwargs={"model_name": "tiny", "base_url": server, "api_key": "none"},
        max_iterations=2,
        max_depth=0,
    )
    try:
        res = rlm.completion("What is 2 + 2?", context="numbers")
    finally:
        rlm.close()
    root = res.root
    assert len(root.turns) >= 1 and all(
        t.usage["prompt_tokens"] > 0 for t in root.turns
    )  # our server's usage


def test_what_cannot_be_served_is_named(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="trainer.export_hf=true"):
        model_directory(str(tmp_path))
    with pytest.raises(SystemExit, match="neither a Hugging Face model directory"):
        main(["--model", str(tmp_path / "nothing")])
    model = tmp_path / "model"  # a chat API client is no engine to serve (it raised AttributeError: .engine)
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="--engine openai: a remote chat API, not a rollout engine"):
        main(["--model", str(model), "--engine", "openai", "--option", "base_url=http://127.0.0.1:9/v1"])


def test_engine_options_are_read_as_json_where_they_are():
    from recipes.serve import _option

    assert _option("max_num_seqs=32") == ("max_num_seqs", 32)
    assert _option("device=cpu") == ("device", "cpu")
    assert _option('engine_kwargs={"context_length": 2048}') == ("engine_kwargs", {"context_length": 2048})
    assert _option("compile=true") == ("compile", True)
