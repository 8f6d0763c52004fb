"""Fixtures of the worker tests: loopback stand-ins for the model services the LM clients talk to
(``workers.agents.clients``), and ``sglang_module`` for the tests that start SGLang engines.

``chat_server(reply, kind="openai" | "anthropic", failures=[...])`` starts a stdlib HTTP server on 127.0.0.1
(port 0) in a thread. It stands in for an OpenAI-compatible server (OpenAI, vLLM, SGLang, OpenRouter:
``POST /v1/chat/completions``) or for Anthropic's Messages API (``POST /v1/messages``), answering in that
service's JSON shape with the text ``reply(body)`` returns (or a ``(text, "length")`` pair: an answer cut at
``max_tokens``) and a usage block the tests can predict:
``prompt_tokens`` (``input_tokens``) = characters of the request's messages (and system), ``completion_tokens``
(``output_tokens``) = characters of the answer. ``failures``: HTTP statuses answered to the first requests
(e.g. ``[429, 500]``), before any success. Every request is recorded as ``(path, headers, body, time)``.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch


class ChatServer:
    def __init__(self, reply, kind: str = "openai", failures=()):
        self.reply, self.kind = reply, kind
        self.failures = list(failures)
        self.requests: list[tuple[str, dict, dict, float]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                # the message object: header names case-insensitive (openai 3.5x sends them in lower case)
                status, data = server.answer(self.path, self.headers, body)
                out = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        root = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = root + "/v1" if kind == "openai" else root  # what each library takes as base_url

    def answer(self, path: str, headers, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append((path, headers, body, time.monotonic()))
            failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            return failure, {"error": {"message": f"scripted failure {failure}", "type": "server_error"}}
        text, finish = self.reply(body), "stop"
        if isinstance(text, tuple):
            text, finish = text
        prompt_chars = sum(len(m["content"]) for m in body["messages"]) + len(body.get("system", ""))
        if self.kind == "openai":
            return 200, {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {"index": k, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                    for k in range(body.get("n", 1))
                ],
                "usage": {
                    "prompt_tokens": prompt_chars,
                    "completion_tokens": len(text),
                    "total_tokens": prompt_chars + len(text),
                },
            }
        return 200, {
            "id": "msg-standin",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [{"type": "text", "text": text}],
            "stop_reason": "max_tokens" if finish == "length" else "end_turn",
            "usage": {"input_tokens": prompt_chars, "output_tokens": len(text)},
        }

    def paths(self) -> set[str]:
        return {p for p, _, _, _ in self.requests}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def chat_server():
    servers: list[ChatServer] = []

    def start(reply, kind: str = "openai", failures=()) -> ChatServer:
        servers.append(ChatServer(reply, kind, failures))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture
def closed_port_url():
    """``http://127.0.0.1:<port>/v1`` where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


SGLANG_HINT = "needs SGLang: run `make sglang-cpu` (CPU engine) or pip install -e '.[sglang]' (CUDA)"


@pytest.fixture(scope="module")
def sglang_module(needs):
    """Skips without SGLang (fails in CI, which installs it); afterwards undoes what starting an engine
    changes for the whole test process: the CPU import shims on PYTHONPATH / sys.path (later subprocesses,
    e.g. sandboxes, must not import a fake torchvision) and SGLang's forced "spawn" start method."""
    if importlib.util.find_spec("sglang") is None:
        needs(SGLANG_HINT)
    env = {k: os.environ.get(k) for k in ("PYTHONPATH", "SGLANG_CPU_OMP_THREADS_BIND")}
    path = list(sys.path)
    method = multiprocessing.get_start_method(allow_none=True)
    yield
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.path[:] = path
    multiprocessing.set_start_method(method, force=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: tiny models gain nothing from more, and on the shared 2-core CI
    machine a second thread that is not scheduled stalls every parallel op (``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
