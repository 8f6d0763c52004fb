"""A complete agent environment in one file: count the words of a text, with a ``<count>`` tool.

A model turn is a tool call ``<count>some text</count>`` (the observation is how many words that text has) or an
answer ``ANSWER: N`` (the trajectory ends). Everything else -- the turn loop, rows to jobs, the policy over the
rollout engine, concurrency, token-exact records, the training batch, both placements, the reference replay --
comes from the agent layer. Train on it from the command line (``env.loop`` in the YAML names ``WordCountLoop``,
whose ``config_class`` holds the keys of the ``env`` section)::

    python -m workers.agents.examples.word_count                  # write_dataset: runs/word_count/data/*.parquet
    python -m recipes.rlm --config recipes/rlm_word_count.yaml

or use it like any environment::

    env = WordCountEnvConfig()                      # env.loop names WordCountLoop by module path
    env_roles(model, rollout, env)                  # a pool's roles (rollout, env), or in a recipe:
    Session(cfg, run, recipe, **env_generator(cfg, run, env))   # roles.generate(batch, meta) runs it
    reference_batch(rows, tokenizer, env)           # extra_info["reference_turns"] replayed for SFT
"""

from __future__ import annotations

import os
import random
import re
import sys
from dataclasses import dataclass, field

from dataproto import DataProto
from workers.agents.llm import EngineLLM, ModelResponse
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop
from workers.agents.trajectory import Trajectory, TrajectoryTurn
from workers.agents.turns import Episode, Step, run_turns
from workers.rollout.sampling import SamplingParams

__all__ = ["WordCountAgentConfig", "WordCountEnvConfig", "WordCountEpisode", "WordCountLoop", "write_dataset"]

SYSTEM_PROMPT = (
    "Count the words of the text you are given. <count>text</count> counts them; answer ANSWER: N."
)
_CALL = re.compile(r"<count>(.*?)</count>", re.S)
_ANSWER = re.compile(r"ANSWER:\s*(\d+)")


@dataclass
class WordCountAgentConfig:
    max_turns: int = 3
    max_new_tokens: int = 64  # per model turn
    max_sequence_tokens: int | None = None  # the whole trajectory (the env worker caps it at P + R)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class WordCountEnvConfig(AgentEnvConfig):
    loop: str = "workers.agents.examples.word_count:WordCountLoop"
    agent: WordCountAgentConfig = field(default_factory=WordCountAgentConfig)


class WordCountEpisode(Episode):
    """The environment side of one trajectory: the model's turns, and what the tool answers to each."""

    def __init__(self, policy: EngineLLM, job: AgentJob, config: WordCountAgentConfig):
        self.job, self.config, self.max_turns, self.calls = job, config, config.max_turns, 0
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job.query}]
        self.conv = policy.conversation(messages, config.max_sequence_tokens)

    async def respond(self, k: int) -> ModelResponse:
        c, seed = self.config, self.job.seed
        params = SamplingParams(
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            seed=None if seed is None else seed + 7919 * k,
            logprobs=True,  # the engine's log-probs become the trajectory's rollout log-probs
        )
        return await self.conv.respond(params)

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        answer = _ANSWER.search(response.text)
        if answer:
            return Step(answer=answer.group(1))
        call = _CALL.search(response.text)
        if call is None:
            return Step(observation="Use <count>text</count> or ANSWER: N.")
        self.calls += 1
        return Step(observation=f"{len(call.group(1).split())} words")


class WordCountLoop(AgentLoop):
    """One trajectory per job: the shared turn loop (``run_turns``) with this file's episode."""

    config_class = WordCountEnvConfig  # the env section of a recipe config that names this loop

    async def run(self, job: AgentJob, config: WordCountAgentConfig) -> list[Trajectory]:
        traj = Trajectory(id=job.traj_id, query=job.query, root_uid=job.uid)
        episode = WordCountEpisode(self.ctx.policy, job, config)
        await run_turns(traj, episode)
        traj.metadata["count_calls"] = episode.calls
        return [traj]

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        roots = [run[0] for run in runs]
        n = max(len(roots), 1)
        return {
            "wc/finished_frac": sum(t.status == "finished" for t in roots) / n,
            "wc/calls/mean": sum(t.metadata["count_calls"] for t in roots) / n,
        }


# -- the example's data ------------------------------------------------------------------------------------------

WORDS = ("red", "green", "blue", "cat", "dog", "sun", "tree", "river", "stone", "cloud", "apple", "bird")


def _row(text: str, split: str, index: int) -> dict:
    question, n = f"How many words: {text}", len(text.split())
    return {
        "data_source": "word_count",  # scored by reward.default_scorer: exact_match (the answer against "n")
        "prompt": [{"role": "user", "content": question}],
        "ability": "counting",
        "reward_model": {"ground_truth": str(n), "style": "rule"},
        "extra_info": {  # the warm start replays reference_turns through WordCountLoop
            "split": split,
            "index": index,
            "question": question,
            "reference_turns": [f"<count>{text}</count>", f"ANSWER: {n}"],
        },
    }


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts of 1-6 words, in a fixed order for the seed."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}  # an ordered set of distinct texts
    while len(texts) < n:
        texts[" ".join(rng.choices(WORDS, k=rng.randint(1, 6)))] = None
    return list(texts)


def write_dataset(out_dir: str, n_train: int = 256, n_val: int = 32, seed: int = 0) -> dict[str, str]:
    """``out_dir/{train,val}.parquet`` (verl's columns): distinct texts of 1-6 words, validation ones first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ordered = sample_texts(n_val + n_train, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, chunk in (("val", ordered[:n_val]), ("train", ordered[n_val:])):
        paths[split] = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist([_row(t, split, i) for i, t in enumerate(chunk)]), paths[split])
    return paths


if __name__ == "__main__":
    print(write_dataset(sys.argv[1] if len(sys.argv) > 1 else "runs/word_count/data"))
