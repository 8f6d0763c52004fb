"""Usage, cost and budgets through ``RLM()``: every model call's tokens (turns and sub-calls) summed per depth and per
model into ``RLMResult.usage`` and the root's JSONL record, checked against the token counts the engine really saw
(a recording wrapper around the scripted policy and around the real tiny native engine); token and USD budgets
that end a run with status "budget"; ``max_errors`` (turns in a row whose code raised)."""

from __future__ import annotations

import pytest
from rlm_testlib import block

from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import Trajectory, TrajectoryTurn, load_jsonl
from workers.rlm.agent import AgentConfig
from workers.rlm.inference import RLM
from workers.rlm.usage import Usage, tree_usage

pytestmark = pytest.mark.timeout(120)


def recording(gen):
    """``gen`` plus a list of (prompt tokens, generated tokens) of every call it answered: what the engine saw."""
    calls: list[tuple[int, int]] = []

    async def rec(ids, params):
        out = await gen(ids, params)
        calls.append((len(ids), len(out.token_ids)))
        return out

    return rec, calls


# The root asks the sub-LM once and starts a child; the child asks the sub-LM twice (batched) and answers.
TREE = {
    "Q-root": [
        block(
            "s = llm_query('summarise ' + context)\nr = rlm_query('child-Q', context=context[:3])\nprint(s, r)"
        ),
        "FINAL_VAR(r)",
    ],
    "child-Q": [block("xs = llm_query_batched(['one', 'two'])\nprint(xs)"), "FINAL(child done)"],
}
PRICES = {"policy": (2.0, 10.0), "helper": (0.5, 1.0)}  # USD per million prompt / completion tokens


def test_usage_per_call_depth_and_model_with_cost(tok, sandbox, tmp_path):
    policy, policy_calls = recording(scripted_generate(tok, ReplayScript(TREE)))
    helper, helper_calls = recording(scripted_generate(tok, lambda prompt: "sub answer"))
    with RLM(
        engine=EngineLLM(policy, tok, name="policy"),
        sub_engine=EngineLLM(helper, tok, name="helper"),
        sandbox=sandbox,
        max_depth=1,
        agent_config=AgentConfig(prices=PRICES, final_answer_on_exhaustion=True),
        log_path=tmp_path / "u.jsonl",
    ) as rlm:
        res = rlm.completion("Q-root", context="abcdefgh")
    assert (res.status, res.answer) == ("finished", "child done")
    root, child = res.trajectories
    u = res.usage
    # the engine's own counts: every call, prompt and generated tokens
    assert u.total.calls == len(policy_calls) + len(helper_calls) == 2 + 2 + 3
    assert u.total.prompt_tokens == sum(p for p, _ in policy_calls + helper_calls)
    assert u.total.completion_tokens == sum(c for _, c in policy_calls + helper_calls)
    # ... equal the sums of the per-call records: each turn's usage and each sub-call's usage
    turns = [t.usage for t in (root.turns + child.turns)]
    subs = [c["usage"] for t in (root, child) for c in t.metadata["subcalls"] if "usage" in c]
    assert len(turns) == 4 and len(subs) == 3
    assert u.total.prompt_tokens == sum(x["prompt_tokens"] for x in turns + subs)
    assert u.total.completion_tokens == sum(x["completion_tokens"] for x in turns + subs)
    assert sorted((x["prompt_tokens"], x["completion_tokens"]) for x in turns) == sorted(policy_calls)
    assert sorted((x["prompt_tokens"], x["completion_tokens"]) for x in subs) == sorted(helper_calls)
    # the rlm_query that started a child made no call of its own: the child's turns carry its usage
    rlm_call = next(c for c in root.metadata["subcalls"] if c["kind"] == "rlm_query")
    assert rlm_call["child_id"] == child.id and "usage" not in rlm_call
    # by depth: root turns at 0; the root's llm_query and the child's turns at 1; the child's llm_query at 2
    assert sorted(u.by_depth) == [0, 1, 2]
    assert (u.by_depth[0].calls, u.by_depth[1].calls, u.by_depth[2].calls) == (2, 1 + 2, 2)
    assert u.by_depth[0].prompt_tokens == sum(t.usage["prompt_tokens"] for t in root.turns)
    assert u.by_depth[2].completion_tokens == sum(c for _, c in helper_calls[1:])
    # by model, and the cost from the price table
    assert {m: t.calls for m, t in u.by_model.items()} == {"policy": 4, "helper": 3}

    def cost(calls, price):
        return sum(p * price[0] + c * price[1] for p, c in calls) / 1e6

    expected = cost(policy_calls, PRICES["policy"]) + cost(helper_calls, PRICES["helper"])
    assert u.cost_usd == pytest.approx(expected) and u.cost_usd > 0
    assert u.by_model["helper"].cost_usd == pytest.approx(cost(helper_calls, PRICES["helper"]))
    # the JSONL root carries the same usage
    logged = load_jsonl(tmp_path / "u.jsonl")[0]
    assert logged.metadata["usage"] == u.to_dict() and Usage.from_dict(logged.metadata["usage"]) == u


def test_usage_matches_the_real_tiny_engine(tok, sandbox):
    from workers.models.tiny import ensure_tiny_model
    from workers.rollout.native import EngineConfig, NativeEngine

    engine = NativeEngine.from_pretrained(
        ensure_tiny_model("nano"), tokenizer=tok, config=EngineConfig(seed=0)
    )
    try:
        gen, calls = recording(engine.generate)
        agent = AgentConfig(max_new_tokens=8, final_answer_on_exhaustion=True)
        with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=2, agent_config=agent) as rlm:
            res = rlm.completion("What is in the context?", context="some text")
    finally:
        engine.shutdown()
    assert len(calls) == len(res.root.turns) >= 1
    assert [(t.usage["prompt_tokens"], t.usage["completion_tokens"]) for t in res.root.turns] == calls
    assert res.usage.total.prompt_tokens == sum(p for p, _ in calls)
    assert res.usage.total.completion_tokens == sum(c for _, c in calls) > 0
    assert res.usage.cost_usd is None  # no price table


LOOP = {"Q": [block("print(llm_query('more'))")]}  # never answers


def test_total_token_budget_stops_the_run(tok, sandbox):
    gen = scripted_generate(tok, ReplayScript(LOOP, sub=lambda p: "s"))
    agent = AgentConfig(max_total_tokens=1500)
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=50, agent_config=agent) as rlm:
        res = rlm.completion("Q", context="c")
    assert res.status == "budget" and "total-token budget of 1500 prompt+completion tokens" in res.root.error
    assert res.usage.total_tokens >= 1500 and 1 < len(res.root.turns) < 50
    # the turn before the stop still had room: the budget is checked before each call
    before = res.usage.total_tokens - sum(
        x["prompt_tokens"] + x["completion_tokens"] for x in _last_turn(res)
    )
    assert before < 1500
    # a sub-call after the budget was spent is refused (the code sees why); the next turn is not taken
    refused = [c for c in res.root.metadata["subcalls"] if "error" in c]
    assert refused and "total-token budget" in refused[-1]["error"] and refused[-1]["turn"] == last_index(res)
    # the observations told the model what was left
    assert "prompt+completion tokens" in res.root.turns[1].prompt_text


def last_index(res):
    return res.root.turns[-1].index


def _last_turn(res):
    last = res.root.turns[-1]
    return [last.usage] + [
        c["usage"] for c in res.root.metadata["subcalls"] if c["turn"] == last.index and "usage" in c
    ]


def test_cost_budget_stops_the_run_and_needs_prices(tok, sandbox):
    gen = scripted_generate(tok, ReplayScript(LOOP, sub=lambda p: "s"))
    prices = {"engine": (1000.0, 1000.0)}  # $0.001 per token: a few turns spend a cent
    agent = AgentConfig(prices=prices, max_cost_usd=2.0)
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=50, agent_config=agent) as rlm:
        res = rlm.completion("Q", context="c")
    assert res.status == "budget" and "cost budget of $2 per root is spent" in res.root.error
    assert res.usage.cost_usd >= 2.0 and res.usage.cost_usd == pytest.approx(res.usage.total_tokens / 1000)
    assert 1 < len(res.root.turns) < 50
    with pytest.raises(ValueError, match="max_cost_usd needs prices"):
        AgentConfig(max_cost_usd=1.0)


def test_a_model_missing_from_the_price_table_is_named(tok, sandbox):
    gen = scripted_generate(tok, ReplayScript({"Q": [block("print(llm_query('x'))"), "FINAL(ok)"]}))
    sub = EngineLLM(scripted_generate(tok, lambda p: "s"), tok, name="cheap-sub")
    agent = AgentConfig(prices={"engine": (1.0, 1.0)})
    with RLM(engine=gen, sub_engine=sub, tokenizer=tok, sandbox=sandbox, agent_config=agent) as rlm:
        res = rlm.completion("Q", context="c")
    out = res.root.turns[0].code_results[0].stdout
    assert "prices has no entry for model 'cheap-sub'" in out  # the sub-call failed, the run went on
    assert res.status == "finished" and res.usage.by_model["cheap-sub"].cost_usd is None
    assert res.usage.cost_usd is None  # one unpriced call: the total cost is unknown
    agent = AgentConfig(prices={"*": (1.0, 1.0)})
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, agent_config=agent) as rlm:
        priced = rlm.completion("Q", context="c")
    assert priced.usage.cost_usd == pytest.approx(priced.usage.total_tokens / 1e6)


def test_max_errors_ends_the_trajectory(tok, sandbox):
    failing = {"Q": [block("print('trying')\n1 / 0")]}
    gen = scripted_generate(tok, ReplayScript(failing))
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=10, max_errors=3) as rlm:
        res = rlm.completion("Q", context="c")
    assert res.status == "error" and len(res.root.turns) == 3
    assert res.root.error.startswith(
        "max_errors: the code raised in 3 turns in a row"
    ) and "ZeroDivision" in (res.root.error)
    # a turn whose code ran cleanly resets the count (rlms counts consecutive errors)
    alternating = {"Q": [block("1 / 0"), block("1 / 0"), block("print('fine')")] * 3 + ["FINAL(done)"]}
    gen = scripted_generate(tok, ReplayScript(alternating))
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_iterations=12, max_errors=3) as rlm:
        res = rlm.completion("Q", context="c")
    assert (res.status, res.answer, len(res.root.turns)) == ("finished", "done", 10)


def test_compaction_summary_calls_count_at_the_trajectory_depth():
    """A persistent session's summary calls (``metadata["compactions"]``) are model calls too: the budget charges
    them, so the sums include them (hand-built records in the session's format)."""
    turn = TrajectoryTurn(index=0, usage={"prompt_tokens": 100, "completion_tokens": 10, "model": "m"})
    root = Trajectory(id="r", query="q", turns=[turn])
    root.metadata["compactions"] = [
        {"usage": {"prompt_tokens": 50, "completion_tokens": 5, "model": "m"}},
        {"usage": {}},  # a truncation fallback made no call
    ]
    u = tree_usage([root], {"m": (1.0, 2.0)})
    assert (u.total.calls, u.total.prompt_tokens, u.total.completion_tokens) == (2, 150, 15)
    assert u.by_depth[0].calls == 2 and u.cost_usd == pytest.approx((150 * 1.0 + 15 * 2.0) / 1e6)
