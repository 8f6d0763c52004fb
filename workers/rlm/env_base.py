"""What the multi-turn agent environment roles share (the RLM REPL env, the math tool env): the policy LLM
over this rank's rollout engine (or a policy factory, e.g. a scripted policy in tests), one sandbox and one
event-loop thread per worker built on first use, a call's sampling settings turned into the agent's, the
agents run between the engine's memory resume and release, and ``close_env``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from controller import Dispatch, register
from workers.rlm.agent import EngineLLM, LoopThread
from workers.roles.rollout import is_sglang
from workers.sandbox import ReplSandbox

__all__ = ["AgentEnvBase", "CallerLoop"]


class CallerLoop:
    """An event loop that the calling thread drives (``run`` = ``run_until_complete``), for an engine whose replies
    are read on its own loop between calls: SGLang's adapter (its async calls must run on ``engine.loop``, where
    SGLang's reply reader lives; a loop on another thread would send requests whose replies nobody reads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def stop(self) -> None:  # the engine owns the loop
        pass


class AgentEnvBase:
    """Mixin for a worker with ``tokenizer``, ``rollout_engine`` (or a policy factory), ``rollout_config``,
    ``rank`` and ``tag``; ``env_config`` has ``sandbox`` (a SandboxConfig) and ``max_concurrent``."""

    loop_name = "agent-env"

    def _env_base_init(self, env_config, policy_factory=None) -> None:
        self.env_config = env_config
        self._policy_factory = policy_factory
        self._env_loop: LoopThread | CallerLoop | None = None
        self._sandbox: ReplSandbox | None = None
        self._policy: EngineLLM | None = None

    def _env_engine(self):
        return getattr(self, "rollout_engine", None)

    def _env_policy(self) -> EngineLLM:
        if self._policy is None:
            if self.tokenizer is None:
                raise RuntimeError(f"{self.tag}: agent rollout before init_model()")
            if self._policy_factory is not None:
                self._policy = EngineLLM(self._policy_factory(self.tokenizer), self.tokenizer)
            else:
                engine = self._env_engine()
                if engine is None:
                    raise RuntimeError(f"{self.tag}: agent rollout before init_model()")
                self._policy = EngineLLM(engine, self.tokenizer, name="policy")
        return self._policy

    def _env_sandbox(self) -> ReplSandbox:
        if self._sandbox is None:
            self._sandbox = ReplSandbox(self.env_config.sandbox)
        return self._sandbox

    def _loop(self) -> LoopThread | CallerLoop:
        if self._env_loop is None:
            engine = self._env_engine() if self._policy_factory is None else None
            if engine is not None and is_sglang(engine):
                self._env_loop = CallerLoop(engine.engine.loop)
            else:
                self._env_loop = LoopThread(name=f"{self.loop_name}-{self.rank}")
        return self._env_loop

    def _env_before_generate(self) -> None:
        """Hook: the colocated worker offloads its trainer here."""

    @staticmethod
    def _sampled(agent_cfg, settings: dict, token_limit: int):
        """``agent_cfg`` with the call's sampling (greedy when ``do_sample`` is off or the temperature is 0)
        and a whole-trajectory token limit of at most ``token_limit``."""
        cap = agent_cfg.max_sequence_tokens
        greedy = not settings["do_sample"] or settings["temperature"] <= 0
        return replace(
            agent_cfg,
            temperature=0.0 if greedy else settings["temperature"],
            top_p=1.0 if greedy else settings["top_p"],
            top_k=-1 if greedy else settings["top_k"],
            max_sequence_tokens=token_limit if cap is None else min(cap, token_limit),
        )

    def _run_agents(self, run_one: Callable[[dict], Awaitable[Any]], jobs: list[dict]) -> list:
        """``run_one(job)`` for every job, at most ``env_config.max_concurrent`` at once, on this worker's
        event loop, with the rollout engine's memory resumed meanwhile; results in job order."""
        engine = self._env_engine() if self._policy_factory is None else None
        self._env_before_generate()
        if engine is not None:
            engine.resume_memory()

        async def run_all():
            sem = asyncio.Semaphore(self.env_config.max_concurrent)

            async def bounded(job):
                async with sem:
                    return await run_one(job)

            return list(await asyncio.gather(*(bounded(j) for j in jobs)))

        try:
            return self._loop().run(run_all()) if jobs else []
        finally:
            if engine is not None and self.rollout_config.free_cache_engine:
                engine.release_memory()

    def _load_tokenizer_only(self) -> None:
        """``init_model`` with a policy factory: no engine, only the tokenizer."""
        from workers.models import load_tokenizer

        m = self.model_config
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)

    @register(Dispatch.ONE_TO_ALL)
    def close_env(self) -> None:
        """Stop this rank's sandbox (every REPL process) and event loop; they restart on the next rollout."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        if self._env_loop is not None:
            self._env_loop.stop()
            self._env_loop = None
