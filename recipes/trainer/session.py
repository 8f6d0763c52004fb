"""A training session: what every RL recipe sets up around its step, so the script holds only the algorithm.

    def rl_step(s: Session, batch, metrics, timings) -> DataProto:
        ...                               # the algorithm: generate, reward, log-probs, advantages, updates
        return batch

    s = Session(cfg, run, "grpo")         # data, pools + WorkerGroups, KL controller, resume, tracker
    return s.train(rl_step)               # the loop below; returns s.result()

``train(step)`` is this loop, for a recipe that wants to write it itself::

    with s:                               # weights -> rollout, validation before training; on exit:
        for batch in s.steps():           #   export, plot, shut the workers down
            metrics, timings = {}, {}
            with timer("step", timings):
                batch = step(s, batch, metrics, timings)
            s.end_step(batch, metrics, timings)   # metrics, validation / checkpoint when due, logging
    return s.result()

Validation is the session's: ``should_validate(step)`` says when (before training with
``trainer.val_before_train``, every ``trainer.test_freq`` steps and at the last step), the recipe's
``validator`` (``recipes/trainer/validation.py``; greedy accuracy by default) says how, and every result is
kept in ``result()["val_history"]``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from algorithms import get_kl_controller
from controller.errors import WorkerGroupError
from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer import checkpoint as ckpt
from recipes.trainer.checkpoint import hold_interrupts
from recipes.trainer.data import prompt_batches, total_steps, train_loader, val_batches
from recipes.trainer.metrics import compute_data_metrics, compute_throughput, timer, timing_metrics
from recipes.trainer.recovery import Fault, FaultLog
from recipes.trainer.roles import build_roles, metrics_of
from recipes.trainer.run import Run
from recipes.trainer.steps import LearningSignalWatch, check_reward_errors, due, resume, save_checkpoint
from recipes.trainer.tracking import Tracker
from recipes.trainer.validation import Validator, greedy_accuracy, print_accuracy_change

logger = logging.getLogger("recipes")

# one step of a recipe's algorithm: (session, prompt batch, metrics, timings) -> the batch with what it computed
Step = Callable[["Session", DataProto, dict, dict], DataProto]


class Session:
    def __init__(
        self,
        cfg: RecipeConfig,
        run: Run,
        recipe: str,
        *,
        critic: bool = False,
        validator: Validator = greedy_accuracy,
        fixed_prompt_width: bool = False,
        outcome_only: bool = True,
        **role_options,
    ):
        """``role_options``: ``build_roles``' options (``extra_roles``, ``generator``, ``async_rollout``);
        ``fixed_prompt_width``: prompt batches ``data.max_prompt_length`` wide; ``outcome_only``: the outcome
        reward is the recipe's only learning signal, so flat rewards in every group are worth a warning
        (``LearningSignalWatch``)."""
        self.cfg, self.run, self.recipe, self.validator = cfg, run, recipe, validator
        self.val_history: list[tuple[int, dict[str, float]]] = []  # (step, validation metrics)
        self.last_batch: DataProto | None = None
        # the data position a checkpoint saves, when the recipe's batch source keeps its own (async_rl)
        self.data_state: Callable[[], dict] | None = None
        self.loader = train_loader(cfg, run, pad_to_max_length=fixed_prompt_width)
        self._loader_start = self.loader.state_dict()  # where a restart without a checkpoint begins again
        self.val_data = val_batches(cfg, run)
        self.total = total_steps(cfg, self.loader)
        self._role_options = {"critic": critic, **role_options}
        self.faults = FaultLog(cfg.trainer.max_restarts)
        self._recovering = False
        # perf_counter() at each step's start: the time a fault lost
        self._step_started: dict[int, float] = {}
        self._start_workers(cfg.trainer.resume_mode)
        # where a restart goes on from: the checkpoint this session resumed from or saved last (a run directory
        # may hold an older run's checkpoints, which a restart must not pick up), else the start
        self._restart_from = (
            (self.state.resumed_from, f"the checkpoint of step {self.state.step}")
            if self.state.resumed_from
            else ("disable", "the start (no checkpoint yet)")
        )
        try:
            self.tracker = Tracker(cfg, run.dir, self.total, self.state.step, recipe)
            if self.state.resumed_from:
                self.tracker.write(
                    f"[{recipe}] resumed at step {self.state.step} from {self.state.resumed_from}"
                )
        except BaseException:
            self.roles.shutdown()
            raise
        self.hf_model: str | None = None
        self.plot: str | None = None
        self.signal_watch = LearningSignalWatch() if outcome_only else None

    # -- life cycle ---------------------------------------------------------------------------------------------

    def _start_workers(self, resume_mode: str) -> None:
        """Pools, worker groups, KL controller and trainer state (from the checkpoint ``resume_mode`` names)."""
        self.roles = build_roles(self.cfg, self.run, **self._role_options)
        self.roles.faults = self  # a rollout pool's dead rank is replaced in place when allow() says so
        try:
            self.kl_ctrl = get_kl_controller(self.cfg.algorithm.kl_ctrl)
            self.state = resume(self.run, self.roles, self.loader, self.kl_ctrl, self.cfg, resume_mode)
        except BaseException:
            self.roles.shutdown()
            raise

    def _begin(self) -> None:
        # the rollout engine starts from the actor's (possibly resumed) weights: policy version = step
        self.roles.sync_weights(version=self.state.step)
        if self.state.step == 0 and self.should_validate(0) and not self.val_history:
            self.tracker.log(self.validate(), step=0)

    def __enter__(self) -> Session:
        try:
            self.survive(self._begin)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.train_started = time.perf_counter()  # trainer.max_train_time_s counts from here
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.cfg.trainer.export_hf:
                self.hf_model = self.roles.actor.export_hf(str(self.run.dir / "hf_model"))[0]
            if exc_type is KeyboardInterrupt:
                self.tracker.write(
                    f"interrupted during step {self.state.step}; checkpoints in {self.run.checkpoint_dir} "
                    "(resume with trainer.resume_mode=auto)"
                )
        finally:
            self.plot = self.tracker.close()
            self.roles.shutdown()

    def train(self, step: Step) -> dict:
        """Train: ``step(self, batch, metrics, timings)`` on every remaining prompt batch (timed as ``step``),
        each followed by ``end_step``; returns ``result()``."""

        def loop() -> None:
            for batch in self.steps():
                metrics: dict[str, float] = {}
                timings: dict[str, float] = {}
                with timer("step", timings):
                    batch = step(self, batch, metrics, timings)
                self.end_step(batch, metrics, timings)

        with self:
            self.survive(loop)
        return self.result()

    # -- worker faults ------------------------------------------------------------------------------------------

    def survive(self, loop: Callable[[], None]) -> None:
        """Run ``loop`` (the recipe's steps, from ``self.state.step`` on); when a worker dies or hangs in it, rebuild
        the workers from the latest checkpoint (`recover`) and run ``loop`` again, at most
        ``trainer.max_restarts`` times in the run. An error a worker raised ends the run as it is."""
        while True:
            try:
                loop()
                return
            except WorkerGroupError as err:
                if self.faults.can_recover(err):
                    self.recover(err)
                elif err.is_fault and self.faults.max_restarts > 0:
                    raise self.faults.exhausted(err, self.state.step) from err
                else:
                    raise

    def allow(self, err: WorkerGroupError) -> bool:
        """`recipes.trainer.roles.FaultPolicy`: whether a rollout pool's fault may be mended in place (a fault
        left to spend); says so on the console."""
        if self._recovering or not self.faults.can_recover(err):  # a fault during a recovery ends the run
            return False
        n, limit = len(self.faults.faults) + 1, self.faults.max_restarts
        self.tracker.write(
            f"[{self.recipe}] FAULT at step {self.state.step}: {err.summary()} -- fault {n} of {limit}: the rollout "
            "pool's workers are replaced and given the current weights, and the call runs again"
        )
        self.faults.faults.append(Fault(self.state.step, err.summary()))
        return True

    def replaced(self, err: WorkerGroupError, seconds: float, roles: list[str]) -> None:
        """`recipes.trainer.roles.FaultPolicy`: the replacement `allow` announced is done."""
        fault = self.faults.faults[-1]
        fault.replaced, fault.seconds_lost = roles, seconds
        version = self.roles.weight_sync.version
        self.tracker.write(
            f"[{self.recipe}] replaced {', '.join(roles)} in {seconds:.1f}s, with the trainer's current weights; "
            f"step {self.state.step} goes on"
            + (f" at policy version {version}" if version is not None else "")
        )

    def recover(self, err: WorkerGroupError) -> None:
        """Every worker group shut down and built again, the checkpoint this session saved last or resumed from
        loaded (neither: the start) and its weights synced; the steps after it are forgotten by
        the tracker, to be computed again. Says so on the console, before and after; ``fault/*`` metrics."""
        failed, t0, limit = self.state.step, time.perf_counter(), self.faults.max_restarts
        mode, origin = self._restart_from
        n = len(self.faults.faults) + 1
        self.tracker.write(
            f"[{self.recipe}] FAULT at step {failed}: {err.summary()} -- fault {n} of {limit}, a restart: every "
            f"worker group is rebuilt and training goes on from {origin}"
        )
        fault = Fault(failed, err.summary())
        self.faults.faults.append(fault)
        self.roles.shutdown()
        for partial in ckpt.remove_partial(self.run.checkpoint_dir):
            self.tracker.write(f"[{self.recipe}] removed {partial}: a save the fault cut short")
        self.loader.load_state_dict(self._loader_start)
        self._recovering = True
        try:
            self._start_workers(mode)
            self.roles.sync_weights(version=self.state.step)
        except Exception as again:
            raise self.faults.exhausted(again, failed, during_recovery=True) from again
        finally:
            self._recovering = False
        restored = fault.restored_step = self.state.step
        fault.seconds_lost = time.perf_counter() - self._step_started.get(restored + 1, t0)
        self.tracker.rewind(restored)
        self.val_history = [(s, m) for s, m in self.val_history if s <= restored]
        again = f"step {failed}" if failed == restored + 1 else f"steps {restored + 1}-{failed}"
        self.tracker.write(
            f"[{self.recipe}] recovered in {time.perf_counter() - t0:.1f}s at step {restored}: {again} "
            f"computed again ({fault.seconds_lost:.1f}s lost)"
        )

    def steps(self) -> Iterator[DataProto]:
        """The prompt batch of each remaining step (``self.state.step`` is the step being run)."""
        batches = prompt_batches(self.loader)
        for _ in self.step_numbers():
            yield next(batches)

    def step_numbers(self) -> Iterator[int]:
        """Each remaining step's number, also ``self.state.step``: for a recipe whose batches come from
        elsewhere (``recipes/trainer/async_rl.py``)."""
        while self.state.step < self.total:
            self.state.step += 1
            self._step_started[self.state.step] = time.perf_counter()
            yield self.state.step

    # -- validation ---------------------------------------------------------------------------------------------

    def should_validate(self, step: int) -> bool:
        """Step 0 (before training) when ``trainer.val_before_train``; then every ``trainer.test_freq`` steps and
        at the last step, never during training when ``test_freq <= 0``."""
        t = self.cfg.trainer
        return t.val_before_train if step == 0 else due(step, t.test_freq, self.total)

    def validate(self) -> dict[str, float]:
        """The validator's metrics on the held-out batches at the current step, kept in ``val_history``."""
        metrics = self.validator(self.roles, self.val_data, self.cfg)
        self.val_history.append((self.state.step, metrics))
        return metrics

    # -- end of a step ------------------------------------------------------------------------------------------

    def end_step(self, batch: DataProto, metrics: dict, timings: dict) -> dict:
        """The worker metrics the batch carries (rollout / env counters, reward, ...), data / throughput
        metrics, reward-error and skipped-update warnings (RunAborted past their limits), validation and
        checkpoint when due, logging."""
        step, t = self.state.step, self.cfg.trainer
        if t.max_train_time_s is not None and time.perf_counter() - self.train_started >= t.max_train_time_s:
            self.total = step  # out of time: this step is the last (validation, checkpoint, export)
        self.last_batch = batch
        metrics |= metrics_of(batch)
        metrics |= compute_data_metrics(batch)
        metrics |= compute_throughput(batch, timings.get("step", 0.0), self.roles.n_devices)
        metrics |= self.faults.metrics()
        check_reward_errors(batch, step, self.cfg.reward.max_error_frac, self.tracker)
        self.state.check_skipped(metrics, self.tracker, t.max_consecutive_skipped_updates)
        if self.signal_watch is not None:
            self.signal_watch.check(metrics, step, self.tracker)
        if self.should_validate(step):
            with timer("testing", timings):
                metrics |= self.validate()
        with hold_interrupts():  # a Ctrl-C lands after this step's checkpoint and log line are both written
            if due(step, t.save_freq, self.total):
                with timer("save_checkpoint", timings):
                    data_state = self.data_state() if self.data_state is not None else None
                    path = save_checkpoint(
                        self.run, self.roles, self.state, self.loader, self.kl_ctrl, self.cfg, data_state
                    )
                    self._restart_from = (path, f"the checkpoint of step {step}")
            metrics |= timing_metrics(timings)
            self.tracker.log(metrics, step)
        return metrics

    def result(self) -> dict:
        history = self.tracker.history
        return {
            "run_dir": str(self.run.dir),
            "step": self.state.step,
            "history": history,
            "final": history[-1] if history else {},
            "val_history": self.val_history,
            "last_batch": self.last_batch,
            "plot": self.plot,
            "hf_model": self.hf_model,
            "tensorboard": str(self.tracker.tensorboard_dir),
            "metrics_file": str(self.tracker.metrics_path),
        }


def print_summary(result: dict, t0: float) -> float:
    """The end of a recipe's command: where the exported model, the curves, the metrics and the TensorBoard logs
    of ``result`` (``Session.result()``) are, and the wall time since ``t0`` (``time.perf_counter()``), returned."""
    wall = time.perf_counter() - t0
    lines = {
        "exported model": result["hf_model"],
        "curves": result["plot"],
        "metrics": result["metrics_file"],
        "TensorBoard": f"tensorboard --logdir {result['tensorboard']}"
        if os.path.isdir(result["tensorboard"])
        else None,
        "wall time": f"{wall:.0f}s",
    }
    for what, where in lines.items():
        if where:
            print(f"{what + ':':<16} {where}")
    return wall


def report_result(result: dict, t0: float, what: str, run_dir: Path) -> dict:
    """The end of a recipe's command that validates: ``what`` before and after RL, then ``print_summary``, and
    the same as data in ``<run_dir>/result.json`` (held-out score before and after, wall time, steps), which the
    README's figures are checked against through a committed copy (``benchmarks/results/``,
    ``tests/test_readme_figures.py``). Returns ``val_before``, ``val_after`` and ``wall_s`` (unrounded)."""
    print()
    before, after = print_accuracy_change(result["val_history"], what)
    wall = print_summary(result, t0)
    saved = {"val_before": before, "val_after": after, "wall_s": round(wall, 1), "steps": result["step"]}
    (Path(run_dir) / "result.json").write_text(json.dumps(saved, indent=2) + "\n")
    return {"val_before": before, "val_after": after, "wall_s": wall}
