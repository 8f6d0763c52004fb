"""The cost of training an agent through the OpenAI-compatible endpoint instead of as an in-process ``AgentLoop``.

The same agent twice: the word-count tool agent written against the ``openai`` client
(``workers/agents/examples/openai_word_count.py``, ``env.loop: openai_agent``: real HTTP to the endpoint on the
engine's event loop, the chat template rendered and tool calls parsed by the server) and the same task as an
in-process loop (``workers/agents/examples/word_count_tools.py``: the same system prompt, tool schema, observation
and sampling, calling the engine directly). Both run ``--n`` trajectories at a time limit of 8 and 64 concurrent
ones, alternately (``--repeats``), over

  scripted     a scripted policy that calls the tool, then answers (two calls per trajectory), ``--delay-ms`` of
               simulated generation per call: the endpoint's own overhead, with no model;
  tiny engine  the native engine on the tiny model (``--model``: e.g. the policy a run exported, which calls the
               tool; default the random tiny model, whose replies are garbage but whose work is real), greedy.

Reported: trajectories/s and model calls/s of each, and the endpoint's throughput relative to the in-process loop
(the issue's goal: at least 0.8x).

Run: python -m benchmarks.bench_openai_endpoint [--n 64] [--model runs/openai_agent/hf_model]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import print_table, write_json
from workers.agents.examples.word_count import sample_texts
from workers.agents.examples.word_count_tools import (
    COUNT_TOOL,
    WordCountToolConfig,
    WordCountToolEnvConfig,
    WordCountToolLoop,
)
from workers.agents.limits import gather_bounded
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentJob, LoopContext
from workers.agents.openai_agent import OpenAIAgentConfig, OpenAIAgentEnvConfig, OpenAIAgentLoop
from workers.agents.scripted import scripted_generate
from workers.agents.tool_calls import tool_parser
from workers.event_loop import LoopThread
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.rollout.native import EngineConfig, NativeEngine

PROGRAM = "workers.agents.examples.openai_word_count:agent"


def jobs(n: int) -> list[AgentJob]:
    out = []
    for k, text in enumerate(sample_texts(n, seed=1)):
        q = f"How many words: {text}"
        out.append(
            AgentJob(k, 0, q, {}, f"u{k}", f"u{k}.0", seed=k, messages=[{"role": "user", "content": q}])
        )
    return out


def scripted_policy(tok, delay_s: float) -> EngineLLM:
    call = tool_parser("hermes").format_call
    function = COUNT_TOOL["function"]
    assert isinstance(function, dict)  # the OpenAI tool schema's function: {"name": ..., ...}
    tool_name = function["name"]

    def respond(prompt: str) -> str:
        if "<tool_response>" in prompt:
            return "ANSWER: 3"
        text = prompt.rsplit("How many words: ", 1)[1].split("<|im_end|>")[0]
        return call(tool_name, {"text": text})

    return EngineLLM(scripted_generate(tok, respond, delay_s=delay_s), tok)


def measure(thread: LoopThread, loop, config, todo: list[AgentJob], concurrency: int) -> dict:
    start = time.perf_counter()
    runs = thread.run(gather_bounded(lambda job: loop.run(job, config), todo, concurrency))
    elapsed = time.perf_counter() - start
    calls = sum(len(r[0].turns) for r in runs)
    errors = sum(r[0].status == "error" for r in runs)
    return {
        "s": elapsed,
        "traj/s": len(runs) / elapsed,
        "calls/s": calls / elapsed,
        "calls": calls,
        "err": errors,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="trajectories per measurement")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--model", default=None, help="a HF directory for the tiny-engine scenario")
    args = ap.parse_args(argv)

    model = args.model or ensure_tiny_model("tiny", chat_template="qwen3")
    tok = load_tokenizer(model)
    thread = LoopThread(name="bench-openai-endpoint")
    engine = NativeEngine.from_pretrained(model, tok, EngineConfig(max_num_seqs=64, max_model_len=768))
    policies = {"scripted": scripted_policy(tok, args.delay_ms / 1000), "tiny engine": EngineLLM(engine, tok)}
    greedy: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}  # both configs' sampling fields
    in_process = (WordCountToolEnvConfig(), WordCountToolConfig(max_new_tokens=96, **greedy))
    endpoint_env = OpenAIAgentEnvConfig(agent=OpenAIAgentConfig(program=PROGRAM, max_new_tokens=96, **greedy))
    endpoint = (endpoint_env, endpoint_env.agent)
    todo = jobs(args.n)
    rows = []
    try:
        for scenario, policy in policies.items():
            loops = {
                "in-process AgentLoop": (
                    WordCountToolLoop(
                        in_process[0],
                        LoopContext(policy, None, tok),  # type: ignore[arg-type]  # the loop uses no sandbox
                    ),
                    in_process[1],
                ),
                "OpenAI endpoint": (
                    OpenAIAgentLoop(
                        endpoint[0],
                        LoopContext(policy, None, tok),  # type: ignore[arg-type]  # the loop uses no sandbox
                    ),
                    endpoint[1],
                ),
            }
            for concurrency in (8, 64):
                samples: dict[str, list[dict]] = {name: [] for name in loops}
                for loop, config in loops.values():  # warm-up: engine kernels, the endpoint's start
                    measure(thread, loop, config, todo[:8], concurrency)
                for _ in range(args.repeats):
                    for name, (loop, config) in loops.items():
                        samples[name].append(measure(thread, loop, config, todo, concurrency))
                base = None
                for name, got in samples.items():
                    best = max(got, key=lambda m: m["traj/s"])
                    base = base or best["traj/s"]
                    rows.append({
                        "scenario": scenario, "concurrency": concurrency, "path": name, **best,
                        "vs in-process": best["traj/s"] / base,
                    })  # fmt: skip
            for loop, _ in loops.values():
                loop.close()
    finally:
        engine.shutdown()
        thread.stop()
    print_table(
        rows, ["scenario", "concurrency", "path", "traj/s", "calls/s", "calls", "err", "vs in-process"]
    )
    path = write_json("bench_openai_endpoint", {"args": vars(args), "model": model, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
