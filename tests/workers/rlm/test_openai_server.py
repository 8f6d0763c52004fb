"""``RLM(backend="openai")`` against a real OpenAI-compatible server: SGLang's own HTTP server
(``python -m sglang.launch_server``, its CPU engine) serving the tiny model, not a loopback stand-in that accepts
anything. The server's window is set small (``--context-length``) so a few turns of the random model's long answers
fill it: each request's ``max_tokens`` is then cut to what is left (the server's own count, from its refusal) and,
once the messages alone fill the window, the trajectory ends with status ``budget`` naming the full context,
instead of an ``error`` carrying the server's 400. REPL code's ``llm_query`` goes to the same server, and usage is
counted from the server's replies."""

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from rlm_testlib import block

from tests.skips import skip_or_fail
from workers.agents.scripted import scripted_generate
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM
from workers.rlm.prompts import PromptConfig

pytestmark = pytest.mark.sglang

WINDOW = 600  # the server's --context-length: the compact system prompt and two or three long turns


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    if importlib.util.find_spec("sglang") is None:
        skip_or_fail("SGLang is not installed (make sglang-cpu)")
    from workers.rollout.sglang.rollout import CPU_SHIM_DIR

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = ensure_tiny_model("nano")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM_DIR), env.get("PYTHONPATH")) if p)
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu", "--port",
           str(port), "--host", "127.0.0.1", "--attention-backend", "torch_native", "--disable-cuda-graph",
           "--context-length", str(WINDOW), "--mem-fraction-static", "0.3", "--random-seed", "0",
           "--log-level", "warning", "--sleep-on-idle"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the SGLang server did not start: {Path(log).read_text()[-3000:]}")
            time.sleep(1)
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_rlm_on_a_real_server_keeps_within_its_window_and_ends_with_the_context_full(sglang_server):
    url, model = sglang_server
    agent = AgentConfig(
        max_iterations=8,
        max_new_tokens=160,
        temperature=0.0,  # greedy: the same turns each run
        prompt=PromptConfig(style="compact"),
    )
    with RLM(
        backend="openai",
        backend_kwargs={"model_name": model, "base_url": url, "max_retries": 0},
        agent_config=agent,
    ) as rlm:
        res = rlm.completion("What is 2+3?", context="two and three")
    root = res.root
    # turn 0 fits whole; turn 1's messages leave less than max_new_tokens: it is asked for what is left and
    # generates to the end of the window; turn 2's messages alone are longer than the window
    assert res.status == "budget", (res.status, root.error)
    assert f"the model's context window of {WINDOW} tokens is full (the messages take " in root.error
    first, second = (t.usage for t in root.turns)
    assert first["completion_tokens"] == 160 and first["prompt_tokens"] + 160 < WINDOW
    assert (
        second["completion_tokens"] < 160
        and WINDOW - 4 <= second["prompt_tokens"] + second["completion_tokens"]
    )
    assert second["prompt_tokens"] + second["completion_tokens"] <= WINDOW
    # usage is the server's count of each answered request
    assert res.usage.total.calls == 2
    assert res.usage.total.prompt_tokens == first["prompt_tokens"] + second["prompt_tokens"]


def test_llm_query_from_the_repl_is_answered_by_the_real_server(sglang_server):
    """The root is a scripted policy (the random tiny model writes no code: a stand-in for the policy only) whose
    code calls ``llm_query``; the sub-LM is the real server, as ``other_backends=["openai"]``."""
    url, model = sglang_server
    tokenizer = load_tokenizer(model)
    turns = iter([block("v = llm_query('Say hello.')\nprint(len(v))"), "FINAL_VAR(v)"])
    root = scripted_generate(tokenizer, lambda prompt: next(turns))
    with RLM(
        root,
        tokenizer=tokenizer,
        other_backends=["openai"],
        other_backend_kwargs=[{"model_name": model, "base_url": url}],
        agent_config=AgentConfig(max_iterations=3, sub_max_new_tokens=24, temperature=0.0),
    ) as rlm:
        res = rlm.completion("Ask the sub-LM to say hello.", context="")
    assert res.status == "finished", (res.status, res.root.error)
    [call] = res.root.metadata["subcalls"]
    assert "error" not in call and call["response"] == res.answer and res.answer
    assert call["usage"]["completion_tokens"] == 24 and call["usage"]["prompt_tokens"] > 0
    assert res.usage.by_model[model].calls == 1
