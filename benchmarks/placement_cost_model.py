"""A cost model of one RL step under a placement and a schedule, from measured per-stage rates.

The recipe's stages (``recipes/ppo.py``: gen, reward, old_log_prob, ref, values, adv, update_critic,
update_actor, update_weights) each run as a data-parallel call on the pool their role lives in. The schedule
(``async_rl.mode``, ``recipes/grpo_async.py``) says which of them overlap:

* ``sync``: one after another, so the step time is the sum of the stage times; a pool is idle while the stages
  of other pools run.
* ``one_step`` (rollout on its own pool): batch k+1 generates while batch k trains, so a step costs
  ``max(gen, training stages) + update_weights``.
* ``full`` (rollout on its own pool): every rollout device streams generate calls of ``call_sequences``
  samples into a bounded buffer; the step costs the same ``max(..) + update_weights``, but generation is
  limited by the pool's rate, with calls that each wait only for their own longest response, not the batch's.

Stage time on a pool of ``d`` devices (``resource_pools.placement_plan`` gives each role's pool and its size):

* ``gen``: a generate call of ``c`` sequences decodes until its longest response ``L(c)`` ends; a decode step
  costs ``t0 + t1 * (sequences still running)`` seconds and finished sequences leave the running batch
  (continuous batching), so the call takes ``t0 * L(c) + t1 * c * mean response length`` seconds: on average
  ``c * mean / L(c)`` sequences run per step. ``L(c)`` is the expected longest of ``c`` responses drawn from the
  workload's ``response_lengths`` (the mean when they are not given: every response equally long).
  Under ``sync`` and ``one_step`` each of the ``d`` devices makes one call of ``c = sequences / d`` and the
  step waits for the slowest, so ``L`` is the longest of all ``sequences``; under ``full`` a device makes
  ``sequences / (d * call_sequences)`` calls of ``call_sequences`` each, back to back.
* forward passes (``old_log_prob``, ``ref``, ``values``): ``tokens / (forward_tokens_per_s * d)``;
  updates (``update_actor``, ``update_critic``): ``tokens / (train_tokens_per_s * d)`` (data parallel, linear).
* ``update_weights``: a fixed in-process time when rollout and actor share a pool (the hybrid engine), else
  ``latency + bytes / bandwidth`` of the broadcast to the rollout pool.
* ``reward`` and the controller's own work (``adv`` and per-call overhead): constants.
* ``parallel_limit``: how many devices can really compute at once. Unlimited for GPUs; on CPU bundles all
  "devices" share the machine's cores, so a stage on ``d > parallel_limit`` devices is ``d / parallel_limit``
  times slower than ``d`` independent devices would be.

``fit_rates`` estimates these rates from measured steps (least squares for ``t0, t1``; medians for the rest);
``predict`` gives a plan's stage times, step time, samples/s and idle time per pool under a schedule;
``rank_plans`` orders candidate placements of a device count by predicted step time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from resource_pools.plans import PlacementPlan, placement_plan

# stage -> the role(s) whose workers do it (update_weights occupies the sender and the receivers)
STAGE_ROLES: dict[str, tuple[str, ...]] = {
    "gen": ("rollout",),
    "reward": ("reward",),
    "old_log_prob": ("actor",),
    "ref": ("ref",),
    "values": ("critic",),
    "update_critic": ("critic",),
    "update_actor": ("actor",),
    "update_weights": ("actor", "rollout"),
}
FORWARD_STAGES = ("old_log_prob", "ref", "values")
UPDATE_STAGES = ("update_actor", "update_critic")
CONTROLLER = "controller"  # adv + per-call overhead: time the step spends outside every pool
SCHEDULES = ("sync", "one_step", "full")  # async_rl.mode


@dataclass(frozen=True)
class Workload:
    """What one step processes (the same under every placement)."""

    sequences: int  # rows: prompts x rollout.n
    response_tokens: float  # generated tokens in the step
    total_tokens: float  # prompt + response tokens (what forward passes and updates process)
    weight_bytes: float  # policy weights pushed to the rollout engines
    has_ref: bool = True
    has_critic: bool = True
    response_lengths: tuple[int, ...] = ()  # sampled response lengths: their spread (the long tail), if known

    def __post_init__(self):
        if self.sequences < 1 or self.response_tokens <= 0 or self.total_tokens <= 0:
            raise ValueError(
                f"workload needs sequences >= 1 and positive token counts, got sequences={self.sequences}, "
                f"response_tokens={self.response_tokens}, total_tokens={self.total_tokens}"
            )
        if any(n < 1 for n in self.response_lengths):
            raise ValueError(f"response_lengths must be >= 1, got {min(self.response_lengths)}")

    @property
    def mean_response_length(self) -> float:
        return self.response_tokens / self.sequences

    def longest_response(self, k: float) -> float:
        """Expected longest of ``k`` responses drawn (with replacement) from ``response_lengths``, never below
        the mean; the mean without ``response_lengths``. The i-th smallest of N lengths is the longest of k
        draws with probability ``(i/N)^k - ((i-1)/N)^k``."""
        lengths = sorted(self.response_lengths)
        n = len(lengths)
        expected = sum(x * ((i / n) ** k - ((i - 1) / n) ** k) for i, x in enumerate(lengths, start=1))
        return max(expected, self.mean_response_length)

    def stages(self) -> list[str]:
        skip = set() if self.has_ref else {"ref"}
        if not self.has_critic:
            skip |= {"values", "update_critic"}
        return [s for s in STAGE_ROLES if s not in skip]


@dataclass(frozen=True)
class StageRates:
    decode_t0: float  # s per decode step, fixed part (per device)
    decode_t1: float  # s per decode step per concurrent sequence
    forward_tokens_per_s: float  # per device
    train_tokens_per_s: float  # per device, forward + backward + optimizer
    sync_local_s: float  # in-process weight stream (rollout shares the actor's pool)
    sync_bytes_per_s: float  # broadcast to a separate rollout pool
    sync_latency_s: float = 0.0
    reward_s: float = 0.0
    controller_s: float = 0.0
    parallel_limit: float = math.inf  # devices that compute at once (CPU bundles: the cores)

    def __post_init__(self):
        bad = {
            k: v
            for k, v in asdict(self).items()
            if k != "parallel_limit" and (not math.isfinite(v) or v < 0 or (k.endswith("per_s") and v == 0))
        }
        if not self.parallel_limit > 0:
            bad["parallel_limit"] = self.parallel_limit
        if bad or self.decode_t0 + self.decode_t1 <= 0:
            raise ValueError(
                f"stage rates must be finite, >= 0 (rates > 0, t0 + t1 > 0), got {bad or asdict(self)}"
            )

    def decode_tokens_per_s(self, concurrency: float) -> float:
        """Tokens/s of one device decoding ``concurrency`` sequences at once."""
        return concurrency / (self.decode_t0 + self.decode_t1 * concurrency)


@dataclass(frozen=True)
class Observation:
    """One placement's measured step: the plan it ran under, its workload and its stage seconds."""

    plan: PlacementPlan
    workload: Workload
    timings: dict[str, float]  # stage -> seconds (``timing_s/<stage>``), plus "step"


# ----------------------------------------------------------------------------------------------------------------
# Prediction
# ----------------------------------------------------------------------------------------------------------------


def stage_devices(plan: PlacementPlan, stage: str) -> int:
    return plan.world_size(STAGE_ROLES[stage][0])


def contention(devices: int, parallel_limit: float) -> float:
    """How much slower ``devices`` sharing ``parallel_limit`` compute units are than independent ones."""
    return max(1.0, devices / parallel_limit)


def shares_pool(plan: PlacementPlan) -> bool:
    """True when the rollout engine lives in the actor's processes (weights stream in-process)."""
    return plan.pool_of("rollout") == plan.pool_of("actor")


def generate_call(work: Workload, sequences: float, longest: float) -> tuple[float, float]:
    """(decode steps, mean sequences running per step) of a generate call of ``sequences`` whose longest
    response has ``longest`` tokens (finished sequences leave the running batch)."""
    return longest, sequences * work.mean_response_length / longest


def stage_seconds(
    rates: StageRates, plan: PlacementPlan, work: Workload, stage: str, call_sequences: float | None = None
) -> float:
    """Seconds of ``stage`` in one step. ``gen`` with ``call_sequences``: the streamed generation of a batch,
    in calls of that many sequences (``full``); without: one call per device, the step waiting for all."""
    if stage not in STAGE_ROLES:
        raise KeyError(f"no cost model for stage {stage!r}; known: {list(STAGE_ROLES)}")
    d = stage_devices(plan, stage)
    slow = contention(d, rates.parallel_limit)
    if stage == "gen":
        if call_sequences is None:  # each device one call of its share; the slowest holds the step
            calls, c, longest = 1.0, work.sequences / d, work.longest_response(work.sequences)
        else:
            calls, c = work.sequences / (d * call_sequences), call_sequences
            longest = work.longest_response(call_sequences)
        steps, running = generate_call(work, c, longest)
        return calls * steps * (rates.decode_t0 + rates.decode_t1 * running) * slow
    if stage in FORWARD_STAGES:
        return work.total_tokens / (rates.forward_tokens_per_s * d) * slow
    if stage in UPDATE_STAGES:
        return work.total_tokens / (rates.train_tokens_per_s * d) * slow
    if stage == "update_weights":
        if shares_pool(plan):
            return rates.sync_local_s
        return rates.sync_latency_s + work.weight_bytes / rates.sync_bytes_per_s
    return rates.reward_s  # "reward"


def pool_busy(plan: PlacementPlan, timings: dict[str, float]) -> dict[str, float]:
    """Seconds each pool's workers were busy: the stages of the roles it holds."""
    busy = dict.fromkeys(plan.pool_spec, 0.0)
    for stage, roles in STAGE_ROLES.items():
        if stage not in timings:
            continue
        for pool in {plan.pool_of(r) for r in roles}:
            busy[pool] += timings[stage]
    return busy


def idle_seconds(plan: PlacementPlan, timings: dict[str, float], step_s: float) -> dict[str, float]:
    """Per pool: step time minus the time its workers were busy (never below 0)."""
    return {pool: max(step_s - b, 0.0) for pool, b in pool_busy(plan, timings).items()}


@dataclass(frozen=True)
class Prediction:
    plan: PlacementPlan
    timings: dict[str, float]
    step_s: float
    idle_s: dict[str, float]
    schedule: str  # SCHEDULES
    samples_per_s: float  # generated sequences trained on per second
    trainer_wait_s: float  # per step, the trainer waiting for its batch to be generated

    def as_dict(self) -> dict:
        return {
            "placement": describe(self.plan),
            "schedule": self.schedule,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "trainer_wait_s": self.trainer_wait_s,
            "trainer_idle_frac": self.trainer_wait_s / self.step_s,
            "rollout_idle_frac": max(self.step_s - self.timings["gen"], 0.0) / self.step_s,
            "timing_s": dict(self.timings),
            "idle_s": dict(self.idle_s),
        }


def predict(
    rates: StageRates,
    plan: PlacementPlan,
    work: Workload,
    schedule: str = "sync",
    call_sequences: float | None = None,
) -> Prediction:
    """Stage times, step time and idle time per pool of ``plan`` under ``schedule`` (``SCHEDULES``);
    ``call_sequences``: samples per generate call of ``full`` (``async_rl.groups_per_call * rollout.n``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    if schedule != "sync" and shares_pool(plan):
        raise ValueError(
            f"schedule {schedule!r} overlaps generation with training: it needs the rollout on a pool of its "
            f"own, not {describe(plan)}"
        )
    if (schedule == "full") != (call_sequences is not None):
        raise ValueError("call_sequences is the generate-call size of schedule 'full' (and only of it)")
    timings = {s: stage_seconds(rates, plan, work, s, call_sequences) for s in work.stages()}
    timings[CONTROLLER] = rates.controller_s
    train = sum(v for k, v in timings.items() if k not in ("gen", "update_weights"))
    if schedule == "sync":
        step, wait = sum(timings.values()), timings["gen"]
    else:  # generation of the next batch overlaps this one's training; the weight swap stops both
        step = max(timings["gen"], train) + timings.get("update_weights", 0.0)
        wait = max(timings["gen"] - train, 0.0)
    return Prediction(
        plan, timings, step, idle_seconds(plan, timings, step), schedule, work.sequences / step, wait
    )


def describe(plan: PlacementPlan) -> str:
    """``colocated(4)``, ``disaggregated(rollout=1,train=3)``, ``split_critic(critic=1,actor=3)``."""
    sizes = {pool.removesuffix("_pool"): sum(n) for pool, n in plan.pool_spec.items()}
    if plan.name == "colocated":
        return f"colocated({sizes['global']})"
    apart = "rollout" if plan.name == "disaggregated" else "critic"
    rest = [k for k in sizes if k != apart][0]
    return f"{plan.name}({apart}={sizes[apart]},{rest}={sizes[rest]})"


def candidate_plans(devices: int, critic: bool = True) -> list[PlacementPlan]:
    """Every placement of ``devices`` devices on one node: colocated, each rollout split, each critic split."""
    plans = [placement_plan("colocated", devices)]
    plans += [placement_plan("disaggregated", devices, rollout_per_node=r) for r in range(1, devices)]
    if critic:
        plans += [placement_plan("split_critic", devices, critic_per_node=c) for c in range(1, devices)]
    return plans


def rank_plans(
    rates: StageRates,
    work: Workload,
    plans: Iterable[PlacementPlan],
    feasible: Callable[[PlacementPlan], bool] | None = None,
) -> list[Prediction]:
    """Predictions for the feasible plans, fastest first."""
    out = [predict(rates, p, work) for p in plans if feasible is None or feasible(p)]
    return sorted(out, key=lambda p: p.step_s)


# ----------------------------------------------------------------------------------------------------------------
# Fitting the rates to measured steps
# ----------------------------------------------------------------------------------------------------------------


def _median(values: Sequence[float], what: str) -> float:
    if not values:
        raise ValueError(f"cannot fit {what}: no observation measured it")
    return float(statistics.median(values))


def fit_decode(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = t0 + t1 * c`` over (concurrency c, seconds per decode step y), with t0, t1 >= 0."""
    if not points:
        raise ValueError("cannot fit the decode rate: no observation measured gen")
    cs = [c for c, _ in points]
    ys = [y for _, y in points]
    if len(set(cs)) < 2:  # one concurrency: the per-step cost is all we know
        return max(statistics.fmean(ys), 1e-12), 0.0
    cm, ym = statistics.fmean(cs), statistics.fmean(ys)
    t1 = sum((c - cm) * (y - ym) for c, y in points) / sum((c - cm) ** 2 for c in cs)
    t0 = ym - t1 * cm
    if t1 < 0:  # slower at lower concurrency: no per-sequence cost visible
        return max(ym, 1e-12), 0.0
    if t0 < 0:  # through the origin
        return 0.0, max(sum(c * y for c, y in points) / sum(c * c for c in cs), 1e-12)
    return t0, t1


def fit_rates(observations: Sequence[Observation], parallel_limit: float = math.inf) -> StageRates:
    """Rates that reproduce the observations' stage times (``parallel_limit``: see the module doc)."""
    if not observations:
        raise ValueError("fit_rates needs at least one observation")
    decode: list[tuple[float, float]] = []
    fwd: list[float] = []
    train: list[float] = []
    local: list[float] = []
    bw: list[float] = []
    reward: list[float] = []
    controller: list[float] = []
    for ob in observations:
        t, w, plan = ob.timings, ob.workload, ob.plan
        if "gen" in t:  # a sync step: one call per device, waiting for the longest response
            d = stage_devices(plan, "gen")
            steps, running = generate_call(w, w.sequences / d, w.longest_response(w.sequences))
            decode.append((running, t["gen"] / steps / contention(d, parallel_limit)))
        for stage in FORWARD_STAGES + UPDATE_STAGES:
            if t.get(stage, 0.0) > 0:
                d = stage_devices(plan, stage)
                rate = w.total_tokens * contention(d, parallel_limit) / (t[stage] * d)
                (fwd if stage in FORWARD_STAGES else train).append(rate)
        if t.get("update_weights", 0.0) > 0:
            if shares_pool(plan):
                local.append(t["update_weights"])
            else:
                bw.append(w.weight_bytes / t["update_weights"])
        if "reward" in t:
            reward.append(t["reward"])
        if "step" in t:
            known = sum(v for k, v in t.items() if k in STAGE_ROLES)
            controller.append(max(t["step"] - known, 0.0))
    t0, t1 = fit_decode(decode)
    # one sync kind unseen: assume the other kind's cost (said so in the benchmark's notes)
    sync_bw = _median(bw, "the weight broadcast") if bw else None
    sync_local = _median(local, "the in-process weight sync") if local else None
    w_bytes = statistics.median(o.workload.weight_bytes for o in observations)
    if sync_local is None:
        if sync_bw is None:
            raise ValueError("cannot fit the weight sync: no observation measured update_weights")
        sync_local = w_bytes / sync_bw
    elif sync_bw is None:
        sync_bw = w_bytes / max(sync_local, 1e-12)
    return StageRates(
        decode_t0=t0,
        decode_t1=t1,
        forward_tokens_per_s=_median(fwd, "the forward rate"),
        train_tokens_per_s=_median(train, "the training rate"),
        sync_local_s=sync_local,
        sync_bytes_per_s=sync_bw,
        reward_s=statistics.median(reward) if reward else 0.0,
        controller_s=statistics.median(controller) if controller else 0.0,
        parallel_limit=parallel_limit,
    )
