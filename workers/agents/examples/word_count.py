"""A complete agent environment in one file: count the words of a text, with a ``<count>`` tool.

A model turn is a tool call ``<count>some text</count>`` (the observation is how many words that text has) or an
answer ``ANSWER: N`` (the trajectory ends). Everything else -- rows to jobs, the policy over the rollout engine,
concurrency, token-exact records, the training batch, both placements, the reference replay -- comes from the
agent layer. Use it like any environment::

    env = WordCountEnvConfig()                      # env.loop names WordCountLoop by module path
    EnvWorker(model, rollout, env)                  # the rollout role on its own pool, or in a recipe:
    Session(cfg, run, recipe, **env_role_classes(env))   # roles.generate(batch, meta) runs it
    reference_batch(rows, tokenizer, env)           # extra_info["reference_turns"] replayed for SFT
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dataproto import DataProto
from workers.agents.llm import ContextFull
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop
from workers.agents.trajectory import Trajectory
from workers.rollout.sampling import SamplingParams

__all__ = ["WordCountAgentConfig", "WordCountEnvConfig", "WordCountLoop"]

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


class WordCountLoop(AgentLoop):
    async def run(self, job: AgentJob, config: WordCountAgentConfig) -> list[Trajectory]:
        traj = Trajectory(id=job.traj_id, query=job.query, root_uid=job.uid)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job.query}]
        conv = self.ctx.policy.conversation(messages, config.max_sequence_tokens)
        calls = 0
        for k in range(config.max_turns):
            params = SamplingParams(
                max_new_tokens=config.max_new_tokens,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                seed=None if job.seed is None else job.seed + 7919 * k,
                logprobs=True,
            )
            try:
                resp = await conv.respond(params)
            except ContextFull as exc:
                traj.status, traj.error = "budget", str(exc)
                break
            traj.turns.append(resp.turn(k))
            answer = _ANSWER.search(resp.text)
            if answer:
                traj.final_answer, traj.status = answer.group(1), "finished"
                break
            call = _CALL.search(resp.text)
            calls += call is not None
            observation = (
                f"{len(call.group(1).split())} words" if call else "Use <count>text</count> or ANSWER: N."
            )
            if k == config.max_turns - 1:
                traj.status = "max_iterations"
                break
            if not conv.add_user(observation):
                traj.status, traj.error = "budget", "the next observation does not fit the token limit"
                break
        traj.metadata["count_calls"] = calls
        return [traj]

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        roots = [run[0] for run in runs]
        n = max(len(roots), 1)
        return {
            "wc/finished_frac": sum(t.status == "finished" for t in roots) / n,
            "wc/calls/mean": sum(t.metadata["count_calls"] for t in roots) / n,
        }
