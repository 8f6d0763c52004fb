"""A complete agent environment in one file: count the words of a text, with a ``<count>`` tool.

A model turn is a tool call ``<count>some text</count>`` (the observation is how many words that text has) or an
answer ``ANSWER: N`` (the trajectory ends). Everything else -- the turn loop, rows to jobs, the policy over the
rollout engine, concurrency, token-exact records, the training batch, both placements, the reference replay --
comes from the agent layer. Use it like any environment::

    env = WordCountEnvConfig()                      # env.loop names WordCountLoop by module path
    EnvWorker(model, rollout, env)                  # the rollout role on its own pool, or in a recipe:
    Session(cfg, run, recipe, **env_role_classes(env))   # roles.generate(batch, meta) runs it
    reference_batch(rows, tokenizer, env)           # extra_info["reference_turns"] replayed for SFT
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dataproto import DataProto
from workers.agents.llm import EngineLLM, ModelResponse
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop
from workers.agents.trajectory import Trajectory, TrajectoryTurn
from workers.agents.turns import Episode, Step, run_turns
from workers.rollout.sampling import SamplingParams

__all__ = ["WordCountAgentConfig", "WordCountEnvConfig", "WordCountEpisode", "WordCountLoop"]

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
