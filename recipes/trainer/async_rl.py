"""Where an asynchronous recipe's batches come from: generation that overlaps training.

    source = rollout_source(session)          # SyncRollout, or a RolloutStream for async_rl.mode one_step / full
    with source:                              # the stream's thread starts generating
        batch, metrics = source.take(version)     # rollout.n samples for each of data.train_batch_size prompts
        ...                                       # reward, log-probs, advantages, update
        metrics |= source.sync_weights(version + 1)

``version`` is the policy version the trainer holds: the number of updates its weights have had. Every token
the rollout engines sample records the version of the weights that sampled it (``rollout_versions``), so a
group's staleness at training time is ``version - (its oldest token's version)``.

* `SyncRollout` (``async_rl.mode=sync``): generate the next prompt batch when asked, then train; staleness 0.
* `RolloutStream` (``one_step`` and ``full``, disaggregated placement): a controller thread keeps every rollout
  rank generating on its own prompt groups (``RayWorkerGroup.call_rank``) and collects finished groups into a
  bounded buffer; ``take`` waits until a batch of groups is there. A group (one prompt's ``rollout.n``
  samples) enters and leaves the buffer whole, so GRPO's group statistics see every sample of a prompt.

  - ``one_step``: the buffer holds one batch and each rank generates its share of it in one call, so batch k+1
    is generated while batch k trains (one-step off-policy; its tokens come from weights k-1 or k).
  - ``full``: the buffer plus the groups in flight hold ``async_rl.buffer_batches`` batches, generated
    ``async_rl.groups_per_call`` groups per call, so long generations never hold up the trainer while the
    buffer has finished ones.
  - A weight update (``sync_weights``) reaches the rollout engines while they generate. ``on_weight_update=
    partial``: the native engine swaps the weights between two decode steps and the requests go on with the
    new ones (their later tokens record the new version; SGLang finishes the running call first).
    ``abort``: the running requests are aborted and their prompts requeued, to be generated afresh.
  - ``max_staleness``: generation runs ahead of the trainer only as far as its groups will be trained on
    within this many versions (``_fresh_enough``; groups are taken in order); a group still older when a batch
    is taken (one overtaken by later ones) is dropped and its prompt requeued
    (generated again with newer weights): nothing is lost.
  - Checkpoints: the prompts not yet trained on (queued, in flight, buffered) are saved with the data loader's
    position (``checkpoint_state``); their generated samples are not: a resumed run generates them afresh with
    the resumed weights.

Metrics of ``take`` (since the previous take): ``async/trainer_idle_s`` (waiting for the batch),
``async/staleness_mean`` / ``_max``, ``async/partial_samples`` (samples whose tokens span several versions),
``async/dropped_stale_groups``, ``async/aborted_groups``, ``async/buffer_groups`` (finished groups left),
``async/rollout_idle_frac`` (share of rank-time the rollout ranks had no generation to run).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import ray

from controller import DataProtoFuture
from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer.data import prompt_batches
from recipes.trainer.roles import Roles
from recipes.trainer.steps import rollout_meta


def group_versions(group: DataProto) -> tuple[int, int, int]:
    """(oldest, newest token version, samples whose tokens span several versions) of generated rows."""
    versions, mask = group.batch["rollout_versions"], group.batch["response_mask"] > 0
    if not bool(mask.any()):
        return 0, 0, 0
    big = versions.masked_fill(~mask, 2**62)
    small = versions.masked_fill(~mask, -1)
    row_min, row_max = big.min(dim=1).values, small.max(dim=1).values
    has = mask.any(dim=1)
    partial = int(((row_max > row_min) & has).sum())
    return int(row_min[has].min()), int(row_max[has].max()), partial


class SyncRollout:
    """``async_rl.mode=sync``: each ``take`` generates the next prompt batch with the current weights."""

    def __init__(self, cfg: RecipeConfig, roles: Roles, prompts: Iterator[DataProto]):
        self.cfg, self.roles, self._prompts = cfg, roles, prompts
        self._since = time.perf_counter()  # end of the previous take

    def __enter__(self) -> SyncRollout:
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        pass

    def take(self, version: int) -> tuple[DataProto, dict[str, float]]:
        """The next prompt batch, generated now: the trainer waits for all of it (``async/trainer_idle_s``), and
        the engines were idle from the previous take until now (``async/rollout_idle_frac``)."""
        t0 = time.perf_counter()
        batch = self.roles.generate(next(self._prompts), rollout_meta(self.cfg, version + 1))
        t1 = time.perf_counter()
        oldest, _, partial = group_versions(batch)
        lag = float(version - oldest)
        idle_frac = (t0 - self._since) / (t1 - self._since) if t1 > self._since else 0.0
        self._since = t1
        return batch, {
            "async/trainer_idle_s": t1 - t0,
            "async/rollout_idle_frac": idle_frac,
            "async/staleness_mean": lag,
            "async/staleness_max": lag,
            "async/partial_samples": float(partial),
        }

    def sync_weights(self, version: int) -> dict[str, float]:
        return self.roles.weight_sync.sync(version=version)

    def checkpoint_state(self, loader) -> dict:
        return {"data": loader.state_dict()}


@dataclass
class _Group:
    prompt: DataProto  # the prompt's row, to generate again when the group is dropped
    samples: DataProto | None = None  # its rollout.n generated rows
    oldest: int = 0
    partial: int = 0


@dataclass
class _Call:
    future: DataProtoFuture
    groups: list[_Group]


class RolloutStream:
    """Every rollout rank generating on its own prompt groups, finished groups in a bounded buffer."""

    def __init__(
        self,
        cfg: RecipeConfig,
        roles: Roles,
        prompts: Iterator[DataProto],
        requeued: list[DataProto] | None = None,
        version: int = 0,
        poll_s: float = 0.02,
    ):
        """``version``: the policy version the rollout engines and the trainer hold at the start (the step a
        resumed run starts from)."""
        a = cfg.async_rl  # type: ignore[attr-defined]
        self.cfg, self.roles, self._prompts, self.poll_s = cfg, roles, prompts, poll_s
        self.batch_groups = cfg.data.train_batch_size
        self.ranks = roles.generator.world_size
        if a.mode == "one_step":  # one batch at a time, each rank its share in one call
            self.capacity = self.batch_groups
            self.groups_per_call = math.ceil(self.batch_groups / self.ranks)
        else:
            self.capacity = a.buffer_batches * self.batch_groups
            self.groups_per_call = a.groups_per_call
        self.max_staleness = a.max_staleness
        self.abort_on_update = a.on_weight_update == "abort"
        self._rollout_version = version  # of the weights the rollout engines hold now
        self._next_take_version = version  # the trainer's version at its next take
        self._todo: deque[_Group] = deque(_Group(p) for p in requeued or [])
        self._ready: deque[_Group] = deque()
        self._inflight: dict[int, _Call] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._calls = 0
        self._counts = {"dropped_stale_groups": 0, "aborted_groups": 0}
        now = time.perf_counter()
        self._idle_from: dict[int, float | None] = {r: now for r in range(self.ranks)}
        self._idle_s = 0.0  # rank-seconds without a call, since the last take
        self._since = now
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)

    # -- life cycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> RolloutStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._inflight:  # let the running calls end before the workers are shut down
            for call in self._inflight.values():
                try:
                    call.future.get()
                except Exception:  # already failed; the stream's error (if any) was raised by take
                    pass

    # -- the trainer's side -------------------------------------------------------------------------------------

    def take(self, version: int) -> tuple[DataProto, dict[str, float]]:
        """The next ``data.train_batch_size`` groups (oldest first), each at most ``max_staleness`` versions
        behind ``version``; waits for them. Raises the stream's error if generation failed."""
        t0 = time.perf_counter()
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                self._drop_stale(version)
                if len(self._ready) >= self.batch_groups:
                    break
                self._cond.wait(timeout=1.0)
            groups = [self._ready.popleft() for _ in range(self.batch_groups)]
            self._next_take_version = version + 1
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            idle_frac = self._rollout_idle_frac()
            buffered = len(self._ready)
            self._cond.notify_all()  # room for more generation
        waited = time.perf_counter() - t0
        staleness = [version - g.oldest for g in groups]
        batch = DataProto.concat([g.samples for g in groups])  # type: ignore[misc]
        batch.meta_info = dict(groups[0].samples.meta_info)  # type: ignore[union-attr]
        return batch, {
            "async/trainer_idle_s": waited,
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/partial_samples": float(sum(g.partial for g in groups)),
            "async/buffer_groups": float(buffered),
            "async/rollout_idle_frac": idle_frac,
            **{f"async/{k}": float(v) for k, v in counts.items()},
        }

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights (policy ``version``) into the rollout engines while they generate; with
        ``on_weight_update=abort`` the requests that started on the old weights are aborted at the swap (their
        groups are requeued when their call returns)."""
        metrics = self.roles.weight_sync.sync(version=version, abort_running=self.abort_on_update)
        with self._cond:
            self._rollout_version = version
            self._cond.notify_all()  # generation may run further ahead now
        return metrics

    def checkpoint_state(self, loader) -> dict:
        """The data loader's position and the prompts pulled from it but not trained on yet, taken together
        (the stream pulls prompts concurrently)."""
        with self._cond:
            pending = [g.prompt for g in (*self._todo, *self._ready)]
            pending += [g.prompt for call in self._inflight.values() for g in call.groups]
            return {"data": loader.state_dict(), "async_pending": pending}

    # -- the stream's thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    self._submit_to_idle_ranks()
                    calls = dict(self._inflight)
                if not calls:
                    with self._cond:
                        self._cond.wait(timeout=self.poll_s)
                    continue
                refs = {call.future.refs[0]: rank for rank, call in calls.items()}
                done, _ = ray.wait(list(refs), num_returns=1, timeout=self.poll_s)
                for ref in done:
                    self._collect(refs[ref], calls[refs[ref]])
        except BaseException as err:  # the trainer's next take raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _submit_to_idle_ranks(self) -> None:
        """One call per idle rank while the buffer and the calls in flight leave room (lock held)."""
        for rank in range(self.ranks):
            if rank in self._inflight:
                continue
            groups = self._next_groups(min(self._room(), self.groups_per_call))
            if not groups:
                return
            self._calls += 1
            prompts = DataProto.concat([g.prompt for g in groups])
            prompts.meta_info = rollout_meta(self.cfg, self._calls)
            future = self.roles.generator.call_rank(rank, "generate_sequences", prompts)
            self._inflight[rank] = _Call(future, groups)
            self._mark_busy(rank)

    def _room(self) -> int:
        """How many more groups may be started now: the buffer's and the staleness bound's room less the groups
        held, finished or in flight (lock held)."""
        held = len(self._ready) + sum(len(c.groups) for c in self._inflight.values())
        return min(self.capacity, self._fresh_enough()) - held

    def _fresh_enough(self) -> int:
        """How many groups may be held (finished or in flight) so that one started now, with the rollout's
        current weights, is trained on within ``max_staleness`` versions: groups are taken in order, a batch
        per version, so the p-th held group is trained at version ``next_take + ceil(p / batch) - 1``. Without
        this bound the stream would generate groups only to drop them as stale (lock held)."""
        ahead = self.max_staleness + 1 + self._rollout_version - self._next_take_version
        return max(ahead, 0) * self.batch_groups

    def _next_groups(self, k: int) -> list[_Group]:
        while len(self._todo) < k:
            batch = next(self._prompts)
            self._todo.extend(_Group(batch.slice(i, i + 1)) for i in range(len(batch)))
        return [self._todo.popleft() for _ in range(max(k, 0))]

    def _collect(self, rank: int, call: _Call) -> None:
        out = call.future.get()  # a worker error ends the stream (raised by take)
        # a prompt's rows share its uid: rollout.n samples, or more with an env's turns / children as rows
        rows_of: dict[str, list[int]] = {}
        for i, uid in enumerate(out.non_tensor_batch["uid"]):
            rows_of.setdefault(str(uid), []).append(i)
        aborted = out.batch["rollout_aborted"]
        with self._cond:
            del self._inflight[rank]
            self._idle_from[rank] = time.perf_counter()
            again = []
            for g in call.groups:
                rows = rows_of[str(g.prompt.non_tensor_batch["uid"][0])]
                if bool(aborted[rows].any()):
                    again.append(g)
                    continue
                g.samples = out.select_idxs(rows)
                g.oldest, _, g.partial = group_versions(g.samples)
                self._ready.append(g)
            self._counts["aborted_groups"] += len(again)
            self._todo.extendleft(reversed(again))  # next in line, in their order
            self._cond.notify_all()

    def _drop_stale(self, version: int) -> None:
        """Requeue the finished groups more than ``max_staleness`` versions behind ``version`` (lock held)."""
        kept: deque[_Group] = deque()
        dropped: list[_Group] = []
        for g in self._ready:
            if version - g.oldest > self.max_staleness:
                g.samples = None
                dropped.append(g)
            else:
                kept.append(g)
        self._ready = kept
        self._counts["dropped_stale_groups"] += len(dropped)
        self._todo.extendleft(reversed(dropped))  # next in line, in their order

    def _mark_busy(self, rank: int) -> None:
        since = self._idle_from[rank]
        if since is not None:
            self._idle_s += time.perf_counter() - max(since, self._since)
        self._idle_from[rank] = None

    def _rollout_idle_frac(self) -> float:
        """Share of rank-time since the last take in which ranks had no call (lock held); restarts the clock."""
        now = time.perf_counter()
        idle = self._idle_s + sum(
            now - max(t, self._since) for t in self._idle_from.values() if t is not None
        )
        frac = idle / (self.ranks * (now - self._since)) if now > self._since else 0.0
        self._idle_s, self._since = 0.0, now
        return frac


def rollout_source(session) -> SyncRollout | RolloutStream:
    """The batch source ``async_rl.mode`` asks for, reading prompts from the session's loader (and the prompts a
    resumed checkpoint had not trained on first)."""
    cfg = session.cfg
    prompts = prompt_batches(session.loader)
    if cfg.async_rl.mode == "sync":
        return SyncRollout(cfg, session.roles, prompts)
    state = session.state
    return RolloutStream(cfg, session.roles, prompts, requeued=state.pending_prompts, version=state.step)
