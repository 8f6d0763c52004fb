"""RLM agent loop: protocol end to end (real sandboxes, scripted policy), token-exact multi-turn sequences,
budgets, failure isolation, the real native engine path, trajectories -> DataProto, and the inference API
(token engine and an OpenAI-compatible HTTP endpoint on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from rlm_testlib import block

from recipes.trainer.sources import run_estimator_on_sources
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.llm import ChatLLM, EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import load_jsonl
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rlm.inference import RLM
from workers.sandbox import ExecResult

pytestmark = pytest.mark.timeout(120)

LP = -0.5  # the scripted policy's log-prob per token


def run(coro):
    return asyncio.run(coro)


# A root that reads its context, asks the sub-LM, starts two children, and finishes with a FINAL_VAR line;
# child B first writes a near-miss ("I will call FINAL(x) later") and finishes on its second turn.
TREE_SCRIPT = {
    "Q-root": [
        "Look first.\n"
        + block("print(len(context))\nfirst = llm_query('summarise: ' + context[:5])\nprint(first)"),
        block("parts = rlm_query_batched(['child-A', 'child-B'], [context[:4], context[4:]])\nprint(parts)"),
        "Both helpers answered.\nFINAL_VAR(parts)",
    ],
    "child-A": [block("FINAL(context.upper())")],
    "child-B": ["I will call FINAL(x) later.\n" + block("n = len(context)\nprint(n)"), "FINAL_VAR(n)"],
}


def sub_reply(prompt_text: str) -> str:
    return "SUMMARY" if "summarise: abcde" in prompt_text else "?"


def recorder(gen):
    calls = []

    async def rec(ids, params):
        out = await gen(ids, params)
        calls.append((list(ids), out))
        return out

    return rec, calls


def test_protocol_tree_with_subcalls_and_children(tok, sandbox):
    gen = scripted_generate(tok, ReplayScript(TREE_SCRIPT, sub=sub_reply))
    agent = RLMAgent(EngineLLM(gen, tok), sandbox, AgentConfig(max_iterations=5, max_depth=1))
    res = run(agent.run("Q-root", "abcdefghij", uid="uid-1", traj_id="r0", seed=0))
    root = res.root
    assert (root.status, root.final_answer) == ("finished", "['ABCD', '6']")
    assert [t.id for t in res.trajectories] == ["r0", "r0/0", "r0/1"]
    a, b = res.children
    assert (a.depth, a.parent_id, a.root_uid, a.final_answer, a.status) == (
        1,
        "r0",
        "uid-1",
        "ABCD",
        "finished",
    )
    assert (b.final_answer, len(b.turns)) == ("6", 2)  # the near-miss on turn 1 did not finish it
    assert b.turns[0].final is None and b.turns[1].final.var_name == "n"
    assert root.children == ["r0/0", "r0/1"] and root.turns[1].child_ids == ["r0/0", "r0/1"]
    # observations the model saw: the context length and the sub-LM's answer, then the children's answers
    assert "10\nSUMMARY" in root.turns[1].prompt_text
    assert "['ABCD', '6']" in root.turns[2].prompt_text
    calls = root.metadata["subcalls"]
    assert [(c["kind"], c["turn"]) for c in calls] == [("llm_query", 0), ("rlm_query", 1), ("rlm_query", 1)]
    assert calls[0]["response"] == "SUMMARY" and {c.get("child_id") for c in calls[1:]} == {"r0/0", "r0/1"}
    # the context is only described in the prompt, never copied into it
    assert "abcdefghij" not in root.turns[0].prompt_text and "10 characters" in root.turns[0].prompt_text
    assert all(t.timings["total_s"] > 0 for t in res.trajectories)


def check_token_exact(traj, calls, tok):
    """The engine calls of ``traj`` are its turns; each prompt extends the previous one literally."""
    first = traj.turns[0].prompt_token_ids
    mine = sorted((c for c in calls if c[0][: len(first)] == first), key=lambda c: len(c[0]))
    assert len(mine) == len(traj.turns)
    for k, turn in enumerate(traj.turns):
        prompt, out = mine[k]
        assert turn.response_token_ids == out.token_ids and turn.response_logprobs == out.log_probs
        if k + 1 < len(traj.turns):
            nxt = mine[k + 1][0]
            assert nxt == prompt + out.token_ids + traj.turns[k + 1].prompt_token_ids
    ids, mask, lps = traj.token_sequence()
    assert ids == mine[-1][0] + mine[-1][1].token_ids  # the whole sequence = last prompt + last response
    assert [t for t, m in zip(ids, mask) if m] == [t for _, o in mine for t in o.token_ids]
    assert [lp for lp, m in zip(lps, mask) if m] == [lp for _, o in mine for lp in o.log_probs]
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
    # decoding does not drift: the sequence decodes to the concatenation of what each piece decodes to
    pieces = "".join(
        t.prompt_text + tok.decode(t.response_token_ids, skip_special_tokens=False) for t in traj.turns
    )
    assert tok.decode(ids, skip_special_tokens=False) == pieces
    for t in traj.turns:
        assert t.response_text == tok.decode(t.response_token_ids, skip_special_tokens=True)
        assert tok.decode(t.prompt_token_ids, skip_special_tokens=False) == t.prompt_text


def test_token_exact_multi_turn_sequences(tok, sandbox):
    # "chars": every character is its own token -- valid ids that re-tokenising the text would not give
    rec, calls = recorder(
        scripted_generate(tok, ReplayScript(TREE_SCRIPT, sub=sub_reply), tokenization="chars")
    )
    agent = RLMAgent(EngineLLM(rec, tok), sandbox, AgentConfig(max_iterations=5))
    res = run(agent.run("Q-root", "abcdefghij", uid="u", seed=1))
    assert res.root.status == "finished" and len(res.root.turns) == 3
    for traj in res.trajectories:
        check_token_exact(traj, calls, tok)
    turn = res.root.turns[0]
    assert turn.response_token_ids[:-1] != tok.encode(turn.response_text, add_special_tokens=False)
    assert turn.response_token_ids[-1] == tok.eos_token_id
    # the EOS the engine produced closes the turn: the next segment does not repeat it
    assert not res.root.turns[1].prompt_text.startswith("<|im_end|>")
    assert res.root.turns[1].prompt_text.startswith("\n<|im_start|>user\n[REPL block 1/1")


def test_turn_cut_at_token_limit_is_closed_by_the_template(tok, sandbox):
    script = ReplayScript({"Q": ["x" * 200, "FINAL(done)"]})
    agent = RLMAgent(EngineLLM(scripted_generate(tok, script), tok), sandbox, AgentConfig(max_new_tokens=8))
    res = run(agent.run("Q", "ctx"))
    t0, t1 = res.root.turns
    assert len(t0.response_token_ids) == 8 and t0.timings["truncated"] == 1.0
    assert t1.prompt_text.startswith("<|im_end|>\n<|im_start|>user\n")  # closed by the template (mask 0)
    assert res.root.final_answer == "done"


def test_budgets(tok, sandbox):
    def agent_for(turns, cfg, **gen_kw):
        gen = scripted_generate(tok, ReplayScript({"Q": turns}, sub=lambda p: "s"), **gen_kw)
        return RLMAgent(EngineLLM(gen, tok), sandbox, cfg)

    loop_forever = [block("print('again')")]
    res = run(agent_for(loop_forever, AgentConfig(max_iterations=2)).run("Q", "c"))
    assert res.root.status == "max_iterations" and len(res.root.turns) == 2
    assert "Next turn is the last" in res.root.turns[1].prompt_text

    three = [block("print(llm_query_batched(['a', 'b', 'c']))"), "FINAL(x)"]
    res = run(agent_for(three, AgentConfig(max_subcalls=2)).run("Q", "c"))
    out = res.root.turns[0].code_results[0].stdout
    assert out.count("'s'") == 2 and "refused: the sub-call budget of 2 calls per root is spent" in out
    assert res.root.status == "finished"  # a refused sub-call is an observation, not a failure

    res = run(
        agent_for(loop_forever, AgentConfig(max_iterations=50, max_wall_s=0.6), delay_s=0.25).run("Q", "c")
    )
    assert res.root.status == "budget" and "wall-clock" in res.root.error and res.elapsed_s < 3

    res = run(agent_for(loop_forever, AgentConfig(max_iterations=50, max_tokens=5)).run("Q", "c"))
    assert res.root.status == "budget" and len(res.root.turns) == 1 and "token budget" in res.root.error

    res = run(agent_for(loop_forever, AgentConfig(max_iterations=50, max_sequence_tokens=1500)).run("Q", "c"))
    assert res.root.status == "budget"
    assert len(res.root.token_sequence()[0]) <= 1500

    # at the depth cap rlm_query is a plain completion with the context appended: no child
    seen = []
    capped = [block("print(rlm_query('inner question', context='CTX-TEXT'))"), "FINAL(ok)"]
    gen = scripted_generate(tok, ReplayScript({"Q": capped}, sub=lambda p: seen.append(p) or "plain"))
    res = run(RLMAgent(EngineLLM(gen, tok), sandbox, AgentConfig(max_depth=0)).run("Q", "c"))
    assert res.children == [] and res.root.turns[0].code_results[0].stdout == "plain\n"
    assert "inner question\n\nContext:\nCTX-TEXT" in seen[0]
    assert res.root.metadata["subcalls"][0]["at_depth_cap"] is True


class FailingLLM(ChatLLM):
    def __init__(self):
        super().__init__(self._chat)

    async def _chat(self, messages, **kw):
        raise RuntimeError("boom")


def test_failing_subcalls_return_error_strings(tok, sandbox):
    turns = [block("print(llm_query('x'))\nprint(llm_query('y', model='nope'))"), "FINAL(fine)"]
    gen = scripted_generate(tok, ReplayScript({"Q": turns}))
    agent = RLMAgent(EngineLLM(gen, tok), sandbox, AgentConfig(), sub_llm=FailingLLM())
    res = run(agent.run("Q", "c"))
    out = res.root.turns[0].code_results[0].stdout.splitlines()
    assert out[0] == "Error: llm_query failed: RuntimeError: boom"
    assert out[1].startswith("Error: llm_query failed: ValueError: unknown model 'nope'")
    assert (res.root.status, res.root.final_answer) == ("finished", "fine")


class FlakySandbox:
    """Delegates to a real sandbox; context "NO-REPL" cannot get a REPL, "DEAD" gets one that dies."""

    def __init__(self, real):
        self.real, self.config = real, real.config

    async def acreate(self, context=None, setup_vars=None, handler=None):
        if context == "NO-REPL":
            raise OSError("no slots")
        repl = await self.real.acreate(context=context, handler=handler)
        if context == "DEAD":

            async def dead(code, timeout_s=None):
                return ExecResult(error="REPL process died; restart failed", killed=True, restarted=False)

            repl.aexecute = dead
        return repl


def test_sandbox_and_engine_failures_fail_only_their_trajectory(tok, sandbox):
    turns = [block("x = 1"), "FINAL(ok)"]
    gen = scripted_generate(tok, ReplayScript({"Q": turns, "Q-engine": turns}))

    async def gen_or_fail(ids, params):
        if "Q-engine" in tok.decode(ids):
            raise RuntimeError("engine exploded")
        return await gen(ids, params)

    agent = RLMAgent(EngineLLM(gen_or_fail, tok), FlakySandbox(sandbox), AgentConfig())

    async def many():
        return await asyncio.gather(
            agent.run("Q", "NO-REPL"),
            agent.run("Q", "DEAD"),
            agent.run("Q-engine", "c"),
            agent.run("Q", "fine"),
        )

    no_repl, dead, engine, ok = run(many())
    assert no_repl.root.status == "error" and "could not create a REPL" in no_repl.root.error
    assert dead.root.status == "error" and "restart failed" in dead.root.error
    assert engine.root.status == "error" and "engine exploded" in engine.root.error
    assert (ok.root.status, ok.root.final_answer) == ("finished", "ok")


def test_real_native_engine_turns_are_exact(tok, sandbox):
    """The tiny model's answers are garbage, but its turns run through the engine, the sandbox and the
    template, and the recorded log-probs are the model's own on the exact recorded sequence."""
    from transformers import AutoModelForCausalLM

    from workers.models.tiny import ensure_tiny_model
    from workers.rollout.native import EngineConfig, NativeEngine

    path = ensure_tiny_model("nano")
    engine = NativeEngine.from_pretrained(path, tokenizer=tok, config=EngineConfig(max_num_seqs=8, seed=0))
    rec, calls = recorder(engine.generate)
    cfg = AgentConfig(max_iterations=2, max_new_tokens=12, temperature=1.0)
    agent = RLMAgent(EngineLLM(rec, tok, max_model_len=engine.max_model_len), sandbox, cfg)

    async def many():
        return await asyncio.gather(*(agent.run(f"question {i}?", "some context", seed=i) for i in range(4)))

    results = run(many())
    engine.shutdown()
    trajs = [t for r in results for t in r.trajectories]
    assert all(t.status in ("finished", "max_iterations", "budget") for t in trajs), [t.error for t in trajs]
    two_turn = [r.root for r in results if len(r.root.turns) == 2]
    for r in results:
        check_token_exact(r.root, calls, tok)
    assert sum(len(o.token_ids) for _, o in calls) == engine.stats["generated_tokens"]
    assert two_turn  # (with 12 random tokens a FINAL on turn 1 is all but impossible)
    traj = two_turn[0]
    ids, mask, lps = traj.token_sequence()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    m = torch.tensor(mask[1:], dtype=torch.bool)
    assert int(m.sum()) > 12  # both turns' tokens, the second conditioned on the observation
    assert float((ref[m] - torch.tensor(lps[1:])[m]).abs().max()) < 1e-4


# ---------------------------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def tree(tok, sandbox):
    gen = scripted_generate(tok, ReplayScript(TREE_SCRIPT, sub=sub_reply))
    agent = RLMAgent(EngineLLM(gen, tok), sandbox, AgentConfig())
    return run(agent.run("Q-root", "abcdefghij", uid="uid-7", traj_id="t")).trajectories


def test_trajectories_to_dataproto_layout(tree, tok):
    pad = tok.pad_token_id
    P, R = 1600, 600
    roots_only = trajectories_to_dataproto(tree, max_prompt_length=P, max_response_length=R, pad_token_id=pad)
    assert len(roots_only) == 1
    data = trajectories_to_dataproto(
        tree,
        max_prompt_length=P,
        max_response_length=R,
        pad_token_id=pad,
        train_children=True,
        extra={"data_source": ["src"] * 3},
    )
    b, nt = data.batch, data.non_tensor_batch
    assert (
        b["prompts"].shape == (3, P) and b["responses"].shape == (3, R) and b["input_ids"].shape == (3, P + R)
    )
    assert list(nt["uid"]) == ["uid-7"] * 3 and list(nt["depth"]) == [0, 1, 1]
    assert list(nt["parent_id"]) == ["", "t", "t"] and list(nt["root_id"]) == ["t"] * 3
    assert (
        list(nt["answer"]) == ["['ABCD', '6']", "ABCD", "6"]
        and list(nt["root_answer"]) == ["['ABCD', '6']"] * 3
    )
    assert list(nt["status"]) == ["finished"] * 3 and list(nt["data_source"]) == ["src"] * 3
    assert list(nt["row_id"]) == ["t", "t/0", "t/1"] and list(nt["advantage_source"]) == ["t"] * 3
    for i, traj in enumerate(tree):
        ids, mask, lps = traj.token_sequence()
        n_p = len(traj.turns[0].prompt_token_ids)
        n_r = len(ids) - n_p
        assert b["prompts"][i, P - n_p :].tolist() == ids[:n_p]  # left-padded
        assert (b["prompts"][i, : P - n_p] == pad).all()
        assert b["responses"][i, :n_r].tolist() == ids[n_p:] and (b["responses"][i, n_r:] == pad).all()
        assert b["response_mask"][i, :n_r].tolist() == [float(m) for m in mask[n_p:]]
        assert b["response_mask"][i, n_r:].sum() == 0
        assert b["rollout_log_probs"][i, :n_r].tolist() == [float(x) for x in lps[n_p:]]
        assert b["attention_mask"][i].sum() == len(ids)
        pos = b["position_ids"][i, P - n_p : P + n_r]
        assert pos.tolist() == list(range(len(ids)))
        assert b["response_mask"].dtype == torch.float32 and b["rollout_log_probs"].dtype == torch.float32
        assert (b["rollout_log_probs"][i][b["response_mask"][i] > 0] == LP).all()
        # observations are in the response but not trained
        assert 0 < b["response_mask"][i, :n_r].sum() < n_r or len(traj.turns) == 1
    rec = json.loads(nt["trajectory"][0])
    assert rec["id"] == "t" and "response_token_ids" not in rec["turns"][0]


def test_truncation_and_child_advantages(tree, tok):
    pad = tok.pad_token_id
    ids, mask, _ = tree[0].token_sequence()
    n_p = len(tree[0].turns[0].prompt_token_ids)
    cut = trajectories_to_dataproto(tree[:1], max_prompt_length=n_p, max_response_length=20, pad_token_id=pad)
    assert cut.non_tensor_batch["truncated"][0] == "response"
    assert cut.batch["responses"][0].tolist() == ids[n_p : n_p + 20]
    assert cut.batch["response_mask"][0].tolist() == [float(m) for m in mask[n_p : n_p + 20]]
    masked = trajectories_to_dataproto(
        tree[:1], max_prompt_length=n_p, max_response_length=20, pad_token_id=pad, mask_truncated=True
    )
    assert masked.batch["response_mask"].sum() == 0
    short_prompt = trajectories_to_dataproto(
        tree[:1], max_prompt_length=10, max_response_length=2000, pad_token_id=pad
    )
    assert short_prompt.non_tensor_batch["truncated"][0] == "prompt"
    assert (
        short_prompt.batch["response_mask"].sum() == 0
        and short_prompt.batch["prompts"][0].tolist() == ids[n_p - 10 : n_p]
    )

    data = trajectories_to_dataproto(
        tree, max_prompt_length=1600, max_response_length=600, pad_token_id=pad, train_children=True
    )
    assert list(data.non_tensor_batch["advantage_source"]) == ["t", "t", "t"]  # children: out of the group
    mask = data.batch["response_mask"]
    data.batch["token_level_rewards"] = torch.zeros_like(mask)
    data.batch["token_level_rewards"][:, 0] = torch.tensor([0.75, 5.0, -3.0])  # the children's own scores
    adv, _ = run_estimator_on_sources(data, "rloo")  # a group of one: RLOO's advantage is the score itself
    assert torch.equal(adv[1:], 0.75 * mask[1:])
    assert torch.equal(adv[0], 0.75 * mask[0])


# ---------------------------------------------------------------------------------------------- inference


def test_inference_api_with_jsonl_log(tok, tmp_path):
    log = tmp_path / "rlm.jsonl"
    gen = scripted_generate(tok, ReplayScript(TREE_SCRIPT, sub=sub_reply))
    with RLM(engine=gen, tokenizer=tok, max_depth=1, max_iterations=5, log_path=log) as rlm:
        res = rlm.completion("Q-root", context="abcdefghij", seed=3)
        again = rlm.completion("Q-root", context="abcdefghij")
    assert (res.answer, res.status) == ("['ABCD', '6']", "finished") and again.answer == res.answer
    tree = res.trajectory_tree
    assert tree["id"] == res.root.id and [c["answer"] for c in tree["children"]] == ["ABCD", "6"]
    assert all(c["depth"] == 1 and c["children"] == [] for c in tree["children"])
    logged = load_jsonl(log)
    assert [t.id for t in logged[:3]] == [t.id for t in res.trajectories] and len(logged) == 6
    assert logged[0].final_answer == res.answer and logged[0].turns[0].response_token_ids == []


def test_inference_api_over_native_engine(tok):
    from workers.models.tiny import ensure_tiny_model
    from workers.rollout.native import EngineConfig, NativeEngine

    engine = NativeEngine.from_pretrained(
        ensure_tiny_model("nano"), tokenizer=tok, config=EngineConfig(seed=0)
    )
    # two turns at most: no extra turn asking for a final answer
    agent = AgentConfig(max_new_tokens=8, temperature=0.0, final_answer_on_exhaustion=False)
    with RLM(engine=engine, max_iterations=2, agent_config=agent) as rlm:
        first = rlm.completion("What is in the context?", context="some text")
        second = rlm.completion("What is in the context?", context="some text")
    engine.shutdown()
    assert first.status in ("finished", "max_iterations") and 1 <= len(first.root.turns) <= 2
    # greedy: the same weights and prompt give the same tokens
    assert [t.response_token_ids for t in first.root.turns] == [
        t.response_token_ids for t in second.root.turns
    ]
    assert all(len(t.response_token_ids) == len(t.response_logprobs) > 0 for t in first.root.turns)


class _ChatHandler(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        msgs = body["messages"]
        if msgs[0]["role"] == "system":  # an agent turn
            k = sum(m["role"] == "assistant" for m in msgs)
            text = [block("v = llm_query('hi')\nprint(v)"), "FINAL_VAR(v)"][min(k, 1)]
        else:
            text = "HTTP-SUB:" + msgs[-1]["content"]
        data = json.dumps({"choices": [{"message": {"content": text}}], "usage": {"completion_tokens": 3}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def test_inference_over_openai_compatible_http(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with RLM(
            backend="openai",
            backend_kwargs={"model_name": "tiny-chat", "base_url": url},
            max_iterations=3,
            log_path=tmp_path / "h.jsonl",
        ) as rlm:
            res = rlm.completion("What does the sub-LM say?", context="xyz")
    finally:
        server.shutdown()
    assert (res.answer, res.status) == ("HTTP-SUB:hi", "finished")
    paths = {p for p, _ in _ChatHandler.requests}
    assert paths == {"/v1/chat/completions"}
    assert all(b["model"] == "tiny-chat" for _, b in _ChatHandler.requests)
    assert res.root.turns[0].response_token_ids == [] and res.root.metadata["subcalls"][0]["tokens"] == 3
    assert len(load_jsonl(tmp_path / "h.jsonl")) == 1


def test_agent_config_validation():
    with pytest.raises(ValueError):
        AgentConfig(max_iterations=0)
    with pytest.raises(ValueError):
        AgentConfig(max_depth=-1)
    assert math.isclose(AgentConfig().temperature, 1.0)
    assert np.array_equal(np.array(AgentConfig(languages=["repl", "python"]).languages), ["repl", "python"])
