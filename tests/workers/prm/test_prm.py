"""The PRM worker: vote and hint parsing, m votes per step from a real frozen tiny model (native engine), and
the HTTP scorer against a local ``http.server`` that stands in for a real OpenAI-compatible endpoint
(vLLM/SGLang/hosted API; none is reachable here) returning canned completions."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from dataproto import DataProto
from workers.prm import PRMConfig, PRMWorker, parse_hint, parse_vote
from workers.prm.scorers import HTTPScorer, Scorer

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "text, vote",
    [
        ("good step \\boxed{1}", 1),
        ("\\boxed{+1}", 1),
        ("bad: \\boxed{-1}", -1),
        ("\\boxed{1} no wait \\boxed{-1}", -1),  # the last box counts
        ("\\boxed{yes}", 0),
        ("I think it is fine", 0),
        ("\\boxed{1", 0),
        ("", 0),
    ],
)
def test_parse_vote(text, vote):
    assert parse_vote(text) == vote


def test_parse_hint():
    assert parse_hint("ok <hint> print the sum first </hint> done") == "print the sum first"
    assert parse_hint("<hint>NO_INTERVENTION</hint>") is None
    assert parse_hint("NO_INTERVENTION") is None
    assert parse_hint("<hint>   </hint>") is None
    assert parse_hint("<hint>never closed") is None
    assert parse_hint("<hint>" + "x" * 50 + "</hint>", max_chars=10) == "x" * 10


def steps_batch() -> DataProto:
    steps = [
        [
            {"kind": "tool", "action": "<python>print(1234+5678)</python>", "observation": "Output:\n6912"},
            {"kind": "answer", "action": "\\boxed{6912}", "observation": ""},
        ],
        [{"kind": "answer", "action": "\\boxed{7000}", "observation": ""}],
        [],  # a trajectory with no step (e.g. the sandbox failed): nothing to judge, no hint
    ]
    col = np.empty(3, dtype=object)
    col[:] = [json.dumps(s) for s in steps]
    extra = np.empty(3, dtype=object)
    extra[:] = [{"question": "Compute 1234 + 5678."}] * 3
    scores = torch.zeros(3, 4)
    scores[0, 2] = 1.0  # row 0 correct, rows 1-2 wrong
    return DataProto.from_dict(
        {"token_level_scores": scores}, non_tensors={"steps": col, "extra_info": extra}
    )


class Canned(BaseHTTPRequestHandler):
    """Answers judge prompts with \\boxed{1}, \\boxed{-1} or nonsense in turn, hint prompts with a hint; one
    choice per request whatever ``n`` asks for (so the scorer has to repeat requests)."""

    requests: list = []
    counter = [0]

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        prompt = body["messages"][-1]["content"]
        if "hint" in prompt:
            text = "<hint>print the sum with python first</hint>"
        else:
            self.counter[0] += 1
            text = ["\\boxed{1}", "\\boxed{-1}", "hmm"][self.counter[0] % 3]
        out = json.dumps(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    Canned.requests, Canned.counter = [], [0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_http_scorer_votes_and_hints(endpoint, monkeypatch):
    monkeypatch.setenv("PRM_TEST_KEY", "secret")
    cfg = PRMConfig(scorer="http", endpoint=endpoint, api_model="judge", api_key_env="PRM_TEST_KEY", votes=3)
    w = PRMWorker(cfg)
    w.init_model()
    out = w.score_steps(steps_batch())
    scores, mask = out.batch["prm_step_scores"], out.batch["prm_step_mask"]
    assert mask[:, :3].tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
    votes = [json.loads(v) for v in out.non_tensor_batch["prm_votes"]]
    assert [len(v) for v in votes] == [2, 1, 0] and all(len(x) == 3 for v in votes for x in v)
    for i, v in enumerate(votes):  # each step's score is the mean of its m parsed votes
        for k, x in enumerate(v):
            assert set(x) <= {-1, 0, 1} and scores[i, k].item() == pytest.approx(sum(x) / 3)
    # hints: only the wrong row with steps is asked (failure), the correct one and the empty one are not
    assert list(out.non_tensor_batch["hint"]) == ["", "print the sum with python first", ""]
    m = out.meta_info["metrics"]
    assert m["prm/hint_frac"] == pytest.approx(1 / 3) and m["prm/hint_requested_frac"] == pytest.approx(1 / 3)
    assert m["prm/unparseable_frac"] == pytest.approx(1 / 3)  # every third canned vote is nonsense
    paths = {p for p, _, _ in Canned.requests}
    assert paths == {"/v1/chat/completions"}
    assert all(h.get("Authorization") == "Bearer secret" for _, h, _ in Canned.requests)
    assert all(b["model"] == "judge" for _, _, b in Canned.requests)
    assert (
        len([b for _, _, b in Canned.requests if "hint" not in b["messages"][0]["content"]]) == 9
    )  # 3 steps x 3


def test_http_scorer_errors_name_the_endpoint():
    with pytest.raises(ValueError, match="http"):
        HTTPScorer("localhost:8000")
    with pytest.raises(ValueError, match="NOPE_NOT_SET"):
        HTTPScorer("http://127.0.0.1:9/v1", api_key_env="NOPE_NOT_SET")
    s = HTTPScorer("http://127.0.0.1:9/v1", timeout_s=2)
    with pytest.raises(RuntimeError, match="127.0.0.1:9"):
        s.complete(["x"], 1, max_new_tokens=4, temperature=1.0)


def test_config_errors():
    with pytest.raises(ValueError, match="prm.endpoint"):
        PRMConfig(scorer="http")
    with pytest.raises(ValueError, match="prm.model_path"):
        PRMConfig(scorer="checkpoint")
    with pytest.raises(ValueError, match="prm.scorer"):
        PRMConfig(scorer="magic")


def test_reference_model_votes(monkeypatch):
    """The frozen tiny model on the native engine produces m votes per step (mostly unparseable: it is a
    1M-parameter model); the hint column holds parsed hints or "" -- never the raw text."""
    from workers.models.tiny import ensure_tiny_model

    cfg = PRMConfig(scorer="reference", votes=2, max_new_tokens=8, hint_max_new_tokens=8, hint_on="always")
    w = PRMWorker(cfg, reference_path=ensure_tiny_model("nano"))
    w.init_model()
    data = steps_batch()
    out = w.score_steps(data)
    votes = [json.loads(v) for v in out.non_tensor_batch["prm_votes"]]
    assert [len(v) for v in votes] == [2, 1, 0] and all(len(x) == 2 for v in votes for x in v)
    raw = list(out.non_tensor_batch["prm_hint_raw"])
    assert raw[0] and raw[1] and raw[2] == ""  # always: every row with steps is asked
    for h, r in zip(out.non_tensor_batch["hint"], raw):
        assert h == (parse_hint(r) or "")
    again = w.score_steps(data)  # a second call draws new seeds: still well-formed
    assert again.batch["prm_step_mask"].sum() == 3


class _RecordingScorer(Scorer):
    def __init__(self):
        self.calls = []

    def _complete(self, prompts, n, max_new_tokens, temperature, seeds):
        self.calls.append((list(prompts), seeds))
        return [[f"{p}#{k}" for k in range(n)] for p in prompts]


def test_scorer_base_handles_empty_input_and_gives_each_prompt_its_seeds():
    s = _RecordingScorer()
    assert s.complete([], 3, max_new_tokens=8, temperature=1.0, seed=7) == []
    assert s.calls == []  # nothing asked for no prompts
    out = s.complete(["a", "b"], 3, max_new_tokens=8, temperature=1.0, seed=7)
    assert out == [["a#0", "a#1", "a#2"], ["b#0", "b#1", "b#2"]]
    assert s.calls[-1] == (["a", "b"], [7, 10])  # prompt i draws seeds seed + n * i, ...
    s.complete(["a"], 2, max_new_tokens=8, temperature=1.0)
    assert s.calls[-1] == (["a"], [None])
