"""RLM environment throughput: many concurrent trajectories on one asyncio loop, real sandboxes.

Scenarios (each: N root trajectories started at once on one event loop, one REPL per trajectory in one
``ReplSandbox``, everything the env worker does per rollout except the DataProto packing, which is
timed separately):

  scripted flat        3 turns per root: inspect the context, ``llm_query_batched`` over 4 chunks,
                       ``FINAL_VAR`` line; the policy is a scripted ``GenerateFn`` (no model), so this
                       is the environment's own overhead (template tokenisation, parsing, sandbox
                       round trips, sub-call plumbing)
  scripted recursive   2 turns per root + ``rlm_query_batched`` starting 2 child agents (own REPLs) per
                       root, 1 turn each
  scripted +50ms/turn  the flat script with 50 ms of simulated generation latency per request: shows
                       how much of the latency concurrent trajectories overlap
  tiny engine          the real native engine (tiny Qwen2, ~1M params) generating every turn and
                       sub-call: at most 3 turns of 32 new tokens; answers are garbage, the work is real

and each scripted scenario also with concurrency 1 (roots one after another) for comparison.
Reported: trajectories/s (roots), turns/s (model turns of roots and children), sub-calls/s, generated
tokens/s (engine), and the time to pack the trajectories into a DataProto.

Run: python -m benchmarks.bench_rlm_env [--n 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from benchmarks.common import print_table, write_json
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.limits import gather_bounded
from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rollout.native import EngineConfig, NativeEngine
from workers.sandbox import ReplSandbox, SandboxConfig

F = "```"


def flat_script(queries: list[str]) -> ReplayScript:
    turns = [
        "Let me look at the context.\n" + f"{F}repl\nprint(len(context), context[:80])\n{F}",
        f"{F}repl\nchunks = [context[i:i + 500] for i in range(0, len(context), 500)][:4]\n"
        f"notes = llm_query_batched(['Summarise: ' + c for c in chunks])\nprint(notes)\n{F}",
        "I have what I need.\nFINAL_VAR(notes)",
    ]
    return ReplayScript({q: turns for q in queries}, sub=lambda p: "a short summary")


def recursive_script(queries: list[str]) -> ReplayScript:
    turns = [
        f"{F}repl\nhalf = len(context) // 2\n"
        f"parts = rlm_query_batched(['count a', 'count b'], [context[:half], context[half:]])\nprint(parts)\n{F}",
        "FINAL_VAR(parts)",
    ]
    script = {q: turns for q in queries}
    script["count a"] = [f"{F}repl\nFINAL(context.count('a'))\n{F}"]
    script["count b"] = [f"{F}repl\nFINAL(context.count('b'))\n{F}"]
    return ReplayScript(script)


async def run_roots(agent: RLMAgent, queries: list[str], context: str, concurrency: int):
    def one(job: tuple[int, str]):
        return agent.run(job[1], context, uid=f"u{job[0]}", seed=job[0])

    return await gather_bounded(one, list(enumerate(queries)), concurrency)


def measure(name: str, agent: RLMAgent, n: int, concurrency: int, context: str, pad: int) -> dict:
    queries = [f"Question number {i}: what does the context say?" for i in range(n)]
    t0 = time.perf_counter()
    results = asyncio.run(run_roots(agent, queries, context, concurrency))
    wall = time.perf_counter() - t0
    trajs = [t for r in results for t in r.trajectories]
    turns = sum(len(t.turns) for t in trajs)
    subcalls = sum(len(t.metadata.get("subcalls", [])) for t in trajs)
    tokens = sum(len(turn.response_token_ids) for t in trajs for turn in t.turns)
    tokens += sum(c.get("tokens", 0) for t in trajs for c in t.metadata.get("subcalls", []))
    t1 = time.perf_counter()
    data = trajectories_to_dataproto(
        trajs, max_prompt_length=2048, max_response_length=2048, pad_token_id=pad, train_children=True
    )
    pack = time.perf_counter() - t1
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.root.status] = statuses.get(r.root.status, 0) + 1
    return {
        "scenario": name,
        "roots": n,
        "concurrency": concurrency,
        "trajectories": len(trajs),
        "turns": turns,
        "subcalls": subcalls,
        "wall_s": wall,
        "traj_per_s": n / wall,
        "turns_per_s": turns / wall,
        "subcalls_per_s": subcalls / wall,
        "gen_tokens_per_s": tokens / wall,
        "pack_s": pack,
        "rows": len(data),
        "statuses": statuses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="root trajectories per scenario")
    ap.add_argument("--quick", action="store_true", help="skip the tiny-engine scenario")
    ap.add_argument("--engine-size", default="tiny", help="tiny model preset for the engine scenario")
    args = ap.parse_args()
    path = ensure_tiny_model(args.engine_size)
    tok = load_tokenizer(path)
    pad = tok.pad_token_id
    context = "alpha beta gamma delta " * 100  # 2,300 characters
    rows = []
    with ReplSandbox(SandboxConfig(timeout_s=30, max_repls=4 * args.n)) as sb:
        queries = [f"Question number {i}: what does the context say?" for i in range(args.n)]
        scenarios = [
            ("scripted flat", scripted_generate(tok, flat_script(queries))),
            ("scripted recursive", scripted_generate(tok, recursive_script(queries))),
            ("scripted +50ms/turn", scripted_generate(tok, flat_script(queries), delay_s=0.05)),
        ]
        for name, gen in scenarios:
            agent = RLMAgent(EngineLLM(gen, tok), sb, AgentConfig(max_iterations=4, max_depth=1))
            measure(name, agent, min(4, args.n), 4, context, pad)  # warm-up
            for conc in (1, args.n):
                rows.append(measure(name, agent, args.n, conc, context, pad))
                print(f"  {name} x{conc}: {rows[-1]['wall_s']:.2f}s", flush=True)
        if not args.quick:
            torch.manual_seed(0)
            engine = NativeEngine.from_pretrained(
                path, tokenizer=tok, config=EngineConfig(max_num_seqs=args.n, max_model_len=2048, seed=0)
            )
            cfg = AgentConfig(max_iterations=3, max_new_tokens=32, sub_max_new_tokens=32, max_depth=1)
            agent = RLMAgent(EngineLLM(engine, tok), sb, cfg)
            measure("tiny engine", agent, 2, 2, context, pad)  # warm-up
            rows.append(measure(f"tiny engine ({args.engine_size})", agent, args.n, args.n, context, pad))
            rows[-1]["engine_decode_steps"] = engine.stats["decode_steps"]
            engine.shutdown()
        isolation = sb.mode

    columns = [
        "scenario",
        "concurrency",
        "trajectories",
        "turns",
        "subcalls",
        "wall_s",
        "traj_per_s",
        "turns_per_s",
        "subcalls_per_s",
        "gen_tokens_per_s",
        "pack_s",
    ]
    print(f"\nRLM env throughput, {args.n} roots per scenario, sandbox isolation: {isolation}")
    print_table(rows, columns)
    path = write_json("bench_rlm_env", {"roots": args.n, "isolation": isolation, "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
