"""The turn loop every agent environment runs: the model answers, the environment acts, the observation goes back.

``await run_turns(traj, episode)`` drives one trajectory to its end::

    episode.start()                               (e.g. create the trajectory's REPL)
    for turn k < episode.max_turns:
        response = episode.respond(k)             the model's turn (raise BudgetSpent when a limit forbids it)
        record it as traj.turns[k]                (the engine's exact tokens; start_s / gen_s / exec_s timings)
        step = episode.step(k, response, turn)    the environment acts: an answer ends the trajectory
        episode.conv.add_user(step.observation)   (or add_messages(step.messages)); no room left -> "budget"
    the last turn gave no answer and episode.final_request(observation) is a message:
        one more model turn (recorded like the others, timings["forced_final"] = 1.0) answers it;
        episode.final_answer(...) makes its answer
    episode.close()                               always, even after an error

and sets ``traj.status``: ``finished`` (an answer), ``max_iterations`` (the last turn gave none; a
``final_answer`` then came from the extra turn that asked for it, if the episode asks), ``budget`` (a
``BudgetSpent`` -- ``ContextFull`` is one -- or no room for the observation), ``error`` (``EnvFailure``: the
environment cannot go on, e.g. no REPL; or any other exception: a bug or an engine failure ends this trajectory,
never the batch; a ``PolicyFailure`` -- the policy's own doing, e.g. RLM's ``max_errors`` -- also sets
``traj.metadata["policy_error"]``, so training tells it from an environment failure, `workers.agents.batch`).
``traj.timings`` gains ``gen_s``, ``exec_s`` (time in ``step``) and ``total_s``.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from typing import Any

from workers.agents.limits import BudgetSpent
from workers.agents.llm import ModelResponse
from workers.agents.trajectory import Trajectory, TrajectoryTurn

__all__ = ["EnvFailure", "Episode", "PolicyFailure", "Step", "run_turns"]


class EnvFailure(Exception):
    """The environment cannot go on for this trajectory: it ends with status "error" and this message."""


class PolicyFailure(EnvFailure):
    """The policy's own behaviour ends the trajectory with status "error" (e.g. its code raised in too many
    turns in a row): unlike an environment failure, its tokens are the policy's to answer for in training."""


@dataclass
class Step:
    """What the environment made of a turn: an ``answer`` ends the trajectory, else ``observation`` follows (a
    user message) -- or ``messages``, when given (e.g. ``tool`` results, ``workers.agents.tool_use``)."""

    observation: str = ""
    answer: str | None = None
    messages: list[dict] | None = None


class Episode:
    """One trajectory's environment side; ``run_turns`` calls it. ``conv`` (the model's conversation,
    ``EngineLLM.conversation(...)``) must be set by ``start`` at the latest."""

    max_turns: int = 1
    conv: Any = None
    no_room = "the next observation does not fit under the trajectory's token limit"

    async def start(self) -> None:
        """Before the first turn; an exception here ends the trajectory with "error"."""

    async def respond(self, k: int) -> ModelResponse:
        """The model's turn ``k`` (typically ``await self.conv.respond(sampling)``)."""
        raise NotImplementedError

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        """Act on the model's turn (``turn`` is its record: add what the environment ran to it)."""
        raise NotImplementedError

    def final_request(self, observation: str) -> str | None:
        """When the last turn gave no answer: the user message (it holds ``observation``, the last turn's) that
        asks the model for a final answer in one more turn; None (the default): ask nothing."""
        return None

    async def final_answer(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> str | None:
        """The answer in the reply to ``final_request`` (turn ``k``; ``turn`` is its record)."""
        raise NotImplementedError

    async def close(self) -> None:
        """After the last turn, also after an error (e.g. close the REPL); must not raise."""


async def run_turns(traj: Trajectory, episode: Episode, origin: float | None = None) -> None:
    """Run ``episode`` on ``traj`` to its end (module docstring); never raises but for cancellation.
    ``origin``: the ``perf_counter`` time that turns' ``start_s`` count from (default: now)."""
    t0 = time.perf_counter()
    origin = t0 if origin is None else origin
    timings = {"gen_s": 0.0, "exec_s": 0.0}
    try:
        await episode.start()
        for k in range(episode.max_turns):
            try:
                response, turn = await _model_turn(traj, episode, k, origin, timings)
            except BudgetSpent as exc:
                traj.status, traj.error = "budget", str(exc)
                break
            te = time.perf_counter()
            step = await episode.step(k, response, turn)
            turn.timings["exec_s"] = exec_s = time.perf_counter() - te
            timings["exec_s"] += exec_s
            if step.answer is not None:
                traj.final_answer, traj.status = step.answer, "finished"
                break
            if k == episode.max_turns - 1:
                traj.status = "max_iterations"
                await _ask_final_answer(traj, episode, k + 1, step.observation, origin, timings)
                break
            added = (
                episode.conv.add_messages(step.messages)
                if step.messages
                else episode.conv.add_user(step.observation)
            )
            if not added:
                traj.status, traj.error = "budget", episode.no_room
                break
    except EnvFailure as exc:
        traj.status, traj.error = "error", str(exc)
        if isinstance(exc, PolicyFailure):
            traj.metadata["policy_error"] = True
    except asyncio.CancelledError:
        traj.status, traj.error = "error", "cancelled"
        raise
    except Exception as exc:  # a bug or an engine failure: this trajectory fails, not the run
        traj.status, traj.error = "error", traceback.format_exception_only(type(exc), exc)[-1].strip()
    finally:
        if traj.status == "running":
            traj.status, traj.error = "error", traj.error or "the agent loop ended without a status"
        await episode.close()
        timings["total_s"] = time.perf_counter() - t0
        traj.timings.update(timings)


async def _model_turn(
    traj: Trajectory, episode: Episode, k: int, origin: float, timings: dict[str, float]
) -> tuple[ModelResponse, TrajectoryTurn]:
    """The model's turn ``k``, recorded on ``traj`` (``BudgetSpent`` from ``respond`` passes through)."""
    tg = time.perf_counter()
    response = await episode.respond(k)
    gen_s = time.perf_counter() - tg
    timings["gen_s"] += gen_s
    turn = response.turn(k)
    turn.timings = {"start_s": tg - origin, "gen_s": gen_s}
    if response.finish_reason == "length":
        turn.timings["truncated"] = 1.0
    traj.turns.append(turn)
    return response, turn


async def _ask_final_answer(
    traj: Trajectory, episode: Episode, k: int, observation: str, origin: float, timings: dict[str, float]
) -> None:
    """The turns are spent without an answer: ask once more, if the episode wants to (status stays
    ``max_iterations``; a limit that forbids the extra turn is noted in ``traj.error``)."""
    request = episode.final_request(observation)
    if request is None:
        return
    if not episode.conv.add_user(request):
        traj.error = f"no extra turn for a final answer: {episode.no_room}"
        return
    try:
        response, turn = await _model_turn(traj, episode, k, origin, timings)
    except BudgetSpent as exc:
        traj.error = f"no extra turn for a final answer: {exc}"
        return
    turn.timings["forced_final"] = 1.0
    te = time.perf_counter()
    traj.final_answer = await episode.final_answer(k, response, turn)
    turn.timings["exec_s"] = exec_s = time.perf_counter() - te
    timings["exec_s"] += exec_s
