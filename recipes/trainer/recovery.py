"""Surviving a worker that dies or hangs: the run's record of its faults and the limits on them.

A rank of a rollout pool apart from the trainer's (``trainer.placement=disaggregated``: rollout engines, the env
workers and PRM beside them) holds nothing a checkpoint holds: ``Roles`` replaces that pool's group in place,
syncs the current weights into it at the current version and runs the failed call again (the whole batch, with
the same seeds: the same samples), so the step goes on. Anywhere else a worker process that is killed, runs out
of memory or hangs past its call timeout takes its collective groups with it (the trainer ranks' FSDP group, the
weight-sync group between trainer and rollout ranks), so the survivors cannot go on with a stand-in. ``Session.survive`` therefore rebuilds every worker group and restores
the most recent checkpoint, exactly as a run restarted by hand with ``trainer.resume_mode=auto`` would (the
resume tests check that this reaches the same metrics bit for bit), and goes on; the steps since that
checkpoint are computed again. ``trainer.max_restarts`` bounds the faults of a run, each one counted whether it
was mended in place, by a restart, or not at all (a replacement cut short by another fault); ``trainer.save_freq``
bounds what a restart loses. An error a worker *raised* is not a fault: a fresh worker would raise it again, so it ends the
run as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.errors import WorkerGroupError
from recipes.trainer.run import RunAborted


class RestartsExhausted(RunAborted):
    """More faults than ``trainer.max_restarts``, or a fault while recovering from one: every fault, in order."""


@dataclass
class Fault:
    step: int  # the step that was running
    what: str  # who failed where and why, one line
    restored_step: int | None = None  # a restart: the checkpoint's step training went on from (0: the start)
    seconds_lost: float = 0.0  # from the start of the first step computed again to the end of the recovery
    replaced: list[str] | None = None  # a replacement: the rollout pool's roles replaced (the step went on)


@dataclass
class FaultLog:
    max_restarts: int
    faults: list[Fault] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        return sum(f.restored_step is not None for f in self.faults)

    @property
    def replacements(self) -> int:
        return sum(f.replaced is not None for f in self.faults)

    def can_recover(self, err: BaseException) -> bool:
        """A worker died or hung and the run has not yet had ``max_restarts`` faults."""
        return isinstance(err, WorkerGroupError) and err.is_fault and len(self.faults) < self.max_restarts

    def exhausted(self, err: BaseException, step: int, during_recovery: bool = False) -> RestartsExhausted:
        """The error that ends the run: every fault so far, ``err`` last."""
        what = err.summary() if isinstance(err, WorkerGroupError) else f"{type(err).__name__}: {err}"
        self.faults.append(Fault(step, ("while recovering: " if during_recovery else "") + what))
        why = (
            "a worker failed again during the recovery"
            if during_recovery
            else f"more than trainer.max_restarts={self.max_restarts} worker faults"
        )
        lines = [f"  {i}. step {f.step}: {f.what}" for i, f in enumerate(self.faults, 1)]
        return RestartsExhausted(f"{why}; the faults in order:\n" + "\n".join(lines))

    def metrics(self) -> dict[str, float]:
        """``fault/*`` (cumulative over the run): restarts, rollout-pool replacements, steps computed again, wall
        time lost to them; none before the first fault."""
        restarts = [f for f in self.faults if f.restored_step is not None]
        replaced = [f for f in self.faults if f.replaced is not None]
        if not restarts and not replaced:
            return {}
        return {
            "fault/restarts": float(len(restarts)),
            "fault/replacements": float(len(replaced)),
            "fault/steps_lost": float(
                sum(f.step - f.restored_step for f in restarts if f.restored_step is not None)
            ),
            "fault/seconds_lost": float(sum(f.seconds_lost for f in restarts + replaced)),
        }
