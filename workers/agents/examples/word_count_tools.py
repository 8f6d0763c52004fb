"""The word-count environment (``word_count.py``) with its tool called in the model's own format, in one file.

The tool is declared once as an OpenAI function schema (``COUNT_TOOL``); the tokenizer's chat template renders it
into the prompt; the model calls it the way its family calls tools (``tool_format``: ``hermes`` for Qwen/Hermes
models, ``<tool_call>{"name": "count_words", "arguments": {"text": ...}}</tool_call>``; ``llama3_json``; or a
parser of yours); each call is answered by a ``tool`` message that the same template renders. A malformed call,
an unknown tool or wrong arguments are answered with an error the model reads (``ToolUse``); a turn without a call
is the answer ``ANSWER: N``. Train on it from the command line like the tag version::

    python -m workers.agents.examples.word_count_tools            # runs/word_count_tools/data/*.parquet
    python -m recipes.rlm --config recipes/rlm_word_count.yaml model.tiny_chat_template=qwen3 \\
        env.loop=workers.agents.examples.word_count_tools:WordCountToolLoop data.max_prompt_length=512 \\
        data.train_files=[runs/word_count_tools/data/train.parquet] data.val_files=[runs/word_count_tools/data/val.parquet]

(the prompt holds the tool's schema as the template renders it: ~300 tiny-model tokens).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace

from workers.agents.examples.word_count import sample_texts
from workers.agents.llm import EngineLLM, ModelResponse
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop
from workers.agents.tool_calls import ToolCall, tool_parser
from workers.agents.tool_use import ToolUse
from workers.agents.trajectory import Trajectory, TrajectoryTurn
from workers.agents.turns import Episode, Step, run_turns
from workers.rollout.sampling import SamplingParams

__all__ = [
    "COUNT_TOOL",
    "WordCountToolConfig",
    "WordCountToolEnvConfig",
    "WordCountToolLoop",
    "write_dataset",
]

COUNT_TOOL = {
    "type": "function",
    "function": {
        "name": "count_words",
        "description": "Count the words of a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
SYSTEM_PROMPT = "Count the words of the text you are given with the count_words tool; answer ANSWER: N."
_ANSWER = re.compile(r"ANSWER:\s*(\d+)")


@dataclass
class WordCountToolConfig:
    tool_format: str = "hermes"  # the model family's tool-call parser (workers/agents/tool_calls.py)
    max_turns: int = 3
    max_new_tokens: int = 96  # per model turn (a call is ~60 tiny-model tokens)
    max_sequence_tokens: int | None = None  # the whole trajectory (the env worker caps it at P + R)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class WordCountToolEnvConfig(AgentEnvConfig):
    loop: str = "workers.agents.examples.word_count_tools:WordCountToolLoop"
    agent: WordCountToolConfig = field(default_factory=WordCountToolConfig)


class WordCountToolEpisode(Episode):
    def __init__(self, policy: EngineLLM, job: AgentJob, config: WordCountToolConfig):
        self.job, self.config, self.max_turns = job, config, config.max_turns
        self.tools = ToolUse([COUNT_TOOL], config.tool_format)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job.query}]
        self.conv = policy.conversation(messages, config.max_sequence_tokens, tools=self.tools.schemas)

    async def respond(self, k: int) -> ModelResponse:
        c, seed = self.config, self.job.seed
        params = SamplingParams(
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            seed=None if seed is None else seed + 7919 * k,
            stop=self.tools.stop,  # a turn may end at the format's closing tag
            logprobs=True,
        )
        return await self.conv.respond(params)

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        parsed = self.tools.parse(response.text)  # prose, well-formed calls, malformed attempts
        if not parsed.calls and not parsed.malformed:
            answer = _ANSWER.search(parsed.content)
            if answer:
                return Step(answer=answer.group(1))
            return Step(observation="Call count_words or answer ANSWER: N.")

        async def count(call: ToolCall) -> str:  # a valid call (the schema was checked)
            return f"{len(call.arguments['text'].split())} words"

        return Step(messages=await self.tools.answer(parsed, count))  # one tool message per attempted call


class WordCountToolLoop(AgentLoop):
    config_class = WordCountToolEnvConfig

    async def run(self, job: AgentJob, config: WordCountToolConfig) -> list[Trajectory]:
        traj = Trajectory(id=job.traj_id, query=job.query, root_uid=job.uid)
        episode = WordCountToolEpisode(self.ctx.policy, job, config)
        await run_turns(traj, episode)
        traj.metadata["tool_use"] = vars(episode.tools.stats)
        return [traj]

    def reference_config(self, config: WordCountToolConfig, max_turns: int) -> WordCountToolConfig:
        return replace(config, max_turns=max(max_turns, 1), max_new_tokens=1024)  # never cut a demonstration


def write_dataset(
    out_dir: str, n_train: int = 256, n_val: int = 32, seed: int = 0, tool_format: str = "hermes"
) -> dict[str, str]:
    """``out_dir/{train,val}.parquet`` (verl's columns), the demonstrations calling the tool in ``tool_format``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser, ordered, paths = tool_parser(tool_format), sample_texts(n_val + n_train, seed), {}
    os.makedirs(out_dir, exist_ok=True)
    for split, chunk in (("val", ordered[:n_val]), ("train", ordered[n_val:])):
        rows = []
        for i, text in enumerate(chunk):
            question, n = f"How many words: {text}", len(text.split())
            turns = [parser.format_call("count_words", {"text": text}), f"ANSWER: {n}"]
            rows.append({
                "data_source": "word_count",  # scored by reward.default_scorer: exact_match
                "prompt": [{"role": "user", "content": question}],
                "ability": "counting",
                "reward_model": {"ground_truth": str(n), "style": "rule"},
                "extra_info": {"split": split, "index": i, "question": question, "reference_turns": turns},
            })  # fmt: skip
        paths[split] = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


if __name__ == "__main__":
    print(write_dataset(sys.argv[1] if len(sys.argv) > 1 else "runs/word_count_tools/data"))
