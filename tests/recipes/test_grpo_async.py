"""The asynchronous GRPO recipe (``recipes/grpo_async.py``) end to end on CPU: one-step off-policy and fully
asynchronous generation on a rollout pool of its own, the staleness bound and stale groups generated again,
partial rollouts that go on with the new weights, abort-and-requeue at a weight update, and resuming with the
prompts a checkpoint had not trained on."""

import math
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from recipe_testlib import BRIEF_GRPO
from transformers import AutoModelForCausalLM, DynamicCache

from controller.worker_group import RayWorkerGroup
from dataproto import DataProto
from recipes import grpo_async
from recipes.config import ConfigError, load_config
from recipes.trainer import async_rl
from recipes.trainer.run import start_run

pytestmark = pytest.mark.e2e
ASYNC_STEP = grpo_async.async_step
COLLECT = async_rl.RolloutStream._collect
TAKE = async_rl.RolloutStream.take
CALL_RANK = RayWorkerGroup.call_rank
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _never_ready runs in a Ray worker

BRIEF = BRIEF_GRPO


def _hold_until_weights_past(worker, version: int) -> None:
    """In a rollout process: once a generation is decoding, the native engine's next step waits (outside the
    engine's lock, so the update gets in) until weights newer than ``version`` arrive, then steps on as before."""
    engine = next(w.rollout_engine for w in worker._role_workers.values() if hasattr(w, "rollout_engine"))
    step = type(engine).step

    def held():
        if engine.weight_version <= version and engine.num_running:  # mid-generation on the old weights
            deadline = time.monotonic() + 20
            while engine.weight_version <= version and time.monotonic() < deadline:
                time.sleep(0.002)
        if engine.weight_version > version or engine.num_running:
            del engine.step  # the class's step again
        return step(engine)

    engine.step = held


def hold_generation_for_each_update(monkeypatch) -> None:
    """Make a generation span every weight update but the last, whatever the machine's speed: after the trainer
    takes the batch of version v (a sync to v + 1 follows its training), the call the stream starts in its place
    pauses between two decode steps until v + 1 arrives. Without this, whether a call is still decoding when the
    update lands is a race between generation and training (a loaded CI machine saw none in 4 steps)."""

    def take(stream, version):
        batch, metrics = TAKE(stream, version)
        if version + 1 < stream.cfg.trainer.total_training_steps:
            ray.get(
                [
                    a.__ray_call__.remote(_hold_until_weights_past, version)
                    for a in stream.roles.generator.actors
                ]
            )
        return batch, metrics

    monkeypatch.setattr(async_rl.RolloutStream, "take", take)


def run(tmp_path, *overrides, record=None, monkeypatch=None, before_step=None):
    """The recipe on ``BRIEF`` + ``overrides``. ``record``: a list that gets every batch the real step trains on,
    step by step; ``before_step(session)``: called before each step (both need ``monkeypatch``)."""
    cfg = load_config("grpo_async", [*BRIEF, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"])
    if record is not None or before_step is not None:

        def recording(s, source, metrics, timings):
            if before_step is not None:
                before_step(s)
            batch = ASYNC_STEP(s, source, metrics, timings)
            if record is not None:
                record.append(batch)
            return batch

        monkeypatch.setattr(grpo_async, "async_step", recording)
    return grpo_async.train(cfg, start_run(cfg, "grpo_async", start_ray=False))


def steps_of(result) -> list[dict]:
    return [r for r in result["history"] if r["step"] >= 1]


def uids(batch: DataProto) -> list[str]:
    return [str(u) for u in batch.non_tensor_batch["uid"]]


def token_versions(batch: DataProto, row: int) -> list[int]:
    """The policy versions that sampled row ``row``'s response tokens, in order."""
    mask = batch.batch["response_mask"][row] > 0
    return batch.batch["rollout_versions"][row][mask].tolist()


def digit_reward(tmp_path) -> str:
    """``custom_reward_function.path=...`` of the digit reward: the random policy earns a little of it (a few
    digits in a response), so GRPO's advantages are not all zero."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGIT_REWARD)
    return f"custom_reward_function.path={reward_file}"


@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_async_modes_train_within_the_staleness_bound(ray_session, tmp_path, mode):
    result = run(tmp_path, f"async_rl.mode={mode}", "async_rl.max_staleness=1")
    rows = steps_of(result)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        bad = {k: v for k, v in r.items() if not math.isfinite(v)}
        assert not bad
        assert 0 <= r["async/staleness_max"] <= 1  # async_rl.max_staleness
        assert 0 <= r["async/trainer_idle_frac"] <= 1 and 0 <= r["async/rollout_idle_frac"] <= 1
        assert r["perf/samples_per_s"] > 0 and r["weight_sync/receivers"] == 1
        assert {"off_policy/is_weight_mean", "off_policy/behaviour_kl", "actor/pg_loss"} <= set(r)
    # the first batch was generated by the initial weights (version 0) for the untrained trainer: lag 0; later
    # batches were generated while the previous one trained, so some lag one version
    assert rows[0]["async/staleness_max"] == 0
    assert max(r["async/staleness_max"] for r in rows[1:]) == 1
    # the last batch: every token's version is the trainer's (3 updates) or one behind
    last = result["last_batch"]
    versions = last.batch["rollout_versions"][last.batch["response_mask"] > 0]
    assert set(versions.unique().tolist()) <= {2, 3}


def test_max_staleness_zero_keeps_generation_from_running_ahead(ray_session, tmp_path):
    """max_staleness=0 in full mode: a group may be started only when it will be trained on by the weights that
    generate it, so generation never runs ahead of the trainer and nothing generated is wasted."""
    result = run(tmp_path, "async_rl.mode=full", "async_rl.max_staleness=0", "async_rl.buffer_batches=2")
    rows = steps_of(result)
    assert all(r["async/staleness_max"] == 0 for r in rows)
    assert sum(r["async/dropped_stale_groups"] for r in rows) == 0
    last = result["last_batch"]
    versions = last.batch["rollout_versions"][last.batch["response_mask"] > 0]
    assert set(versions.tolist()) == {3}  # all of it from the trainer's own weights


@ray.remote(num_cpus=0)
def _never_ready():
    time.sleep(3600)


def test_a_group_older_than_max_staleness_is_dropped_and_its_prompt_generated_again(
    ray_session, tmp_path, monkeypatch
):
    """Two rollout ranks, and rank 0 a straggler: the stream sees its second group (started on version 0 or 1,
    as fast as rank 0's first call came back) only at the first step whose trainer is two versions past the
    group's oldest token, after rank 1's groups have filled the batches in between. It is then more than
    max_staleness=1 versions behind: dropped, and its prompt generated again with newer weights and trained on,
    once; every group trained is within the bound. (With one rollout rank, or ranks of equal speed, the stream
    starts a group only when it will be trained within the bound (``_fresh_enough``): groups go stale only when
    later ones overtake them.)"""
    late: list = []  # rank 0's calls: (future, prompt uids)
    held: list = []  # the straggler's future, its result's refs, and the ref the stream waits on meanwhile

    def straggling(group, rank, method, *args, **kwargs):
        future = CALL_RANK(group, rank, method, *args, **kwargs)
        if method == "generate_sequences" and rank == 0:
            late.append((future, uids(args[0])))
            if len(late) == 2:  # until released, the stream waits on a ref that is never ready
                held.append((future, future.refs, _never_ready.remote()))
                future.refs = [held[0][2]]
        return future

    released: list = []  # (step, the held group's oldest token version)

    def release(s):  # the straggler's result arrives once it is too stale (step k trains with version k - 1)
        if held and not released:
            future, refs, _ = held[0]
            oldest = async_rl.group_versions(ray.get(refs[0]))[0]
            if s.state.step - 1 - oldest > 1:  # async_rl.max_staleness=1
                future.refs = refs
                released.append((s.state.step, oldest))

    monkeypatch.setattr(RayWorkerGroup, "call_rank", straggling)
    trained: list[DataProto] = []
    try:
        result = run(
            tmp_path,
            "async_rl.mode=full",
            "async_rl.max_staleness=1",
            "async_rl.groups_per_call=1",
            "trainer.n_gpus_per_node=3",
            "trainer.rollout_gpus_per_node=2",
            "trainer.total_training_steps=6",
            record=trained,
            monkeypatch=monkeypatch,
            before_step=release,
        )
    finally:
        for _, _, never in held:
            ray.cancel(never, force=True)
    rows = steps_of(result)
    [(step, oldest)] = released
    assert step <= 5  # so its prompt, generated again, is trained on by step 6
    assert sum(r["async/dropped_stale_groups"] for r in rows[step - 1 :]) >= 1
    for version, batch in enumerate(trained):  # step k trains with version k - 1: within the bound
        assert max(version - min(token_versions(batch, i)) for i in range(len(batch))) <= 1
    everyone = [u for batch in trained for u in uids(batch)[::2]]  # rows a,a,b,b: one uid per group
    assert len(everyone) == len(set(everyone)) == 12  # 6 steps x 2 prompts, none twice
    _, prompts = late[1]
    for uid in set(prompts):  # its prompt was trained on, from samples generated again on newer weights
        again = [(b, i) for b in trained for i in range(len(b)) if uids(b)[i] == uid]
        assert again and all(min(token_versions(b, i)) >= oldest + 2 for b, i in again)


def test_abort_on_weight_update_requeues_the_groups_in_flight(ray_session, tmp_path, monkeypatch):
    """on_weight_update=abort: the requests an update cut off come back as whole groups, generated again and
    trained on at most once, after that update (a generation is held in flight at every update but the last);
    no trained sample mixes versions."""
    aborted: dict[str, int] = {}  # uid -> version of the weights its cut-off rows were sampled with

    def collect(stream, rank, call):  # what each finished call brought back, before the stream reads it
        out = call.future.get()  # cached: the stream's own get() returns the same result
        for i, flag in enumerate(out.batch["rollout_aborted"].tolist()):
            if flag:
                aborted[uids(out)[i]] = max(token_versions(out, i))
        return COLLECT(stream, rank, call)

    monkeypatch.setattr(async_rl.RolloutStream, "_collect", collect)
    hold_generation_for_each_update(monkeypatch)
    trained: list[DataProto] = []
    result = run(
        tmp_path,
        "async_rl.mode=full",
        "async_rl.on_weight_update=abort",
        "async_rl.max_staleness=2",
        "data.max_response_length=96",
        "trainer.total_training_steps=6",
        record=trained,
        monkeypatch=monkeypatch,
    )
    rows = steps_of(result)
    assert len(trained) == 6 and all(r["async/partial_samples"] == 0 for r in rows)
    assert sum(r["weight_sync/aborted_requests"] for r in rows) > 0
    # rows sampled with version v were cut off by the update to v + 1, at the end of step v + 1; the last
    # step's update cuts off groups no step is left to train
    cut = {uid: v for uid, v in aborted.items() if v + 1 < len(trained)}
    assert cut
    trained_again = []
    for uid, v in cut.items():
        steps = [k for k, batch in enumerate(trained) if uid in uids(batch)]  # batch k: version k
        # never twice, never before it was generated again; a group cut late may queue past the run's last
        # batch (which groups fill the last batches depends on the timing)
        assert len(steps) <= 1 and all(k >= v + 1 for k in steps), (uid, v, steps)
        trained_again += steps
    assert trained_again  # the requeued groups come back and are trained
    for batch in trained:  # a sample is one version's: aborted requests never reach the trainer
        assert not bool(batch.batch["rollout_aborted"].any())
        assert all(len(set(token_versions(batch, i))) == 1 for i in range(len(batch)))


def behaviour_log_probs(
    models: dict, prompt: list[int], response: list[int], versions: list[int]
) -> torch.Tensor:
    """The log-probs of ``response`` as an engine that swaps weights between two decode steps computes them:
    the forward of input position j (which samples the token after it) runs on the weights of that token's
    version, and attends to the keys/values earlier positions cached on the weights of their own time (the
    prompt's prefill samples response token 0). ``models``: the policy of each version."""
    seq = torch.tensor([prompt + response])
    p = len(prompt)
    weights_of = [versions[0]] * p + versions[1:]  # input position -> version of the token it samples
    cache, out, start = DynamicCache(), [], 0  # filled in place by each forward
    with torch.no_grad():
        while start < len(weights_of):
            end = start
            while end < len(weights_of) and weights_of[end] == weights_of[start]:
                end += 1
            logits = models[weights_of[start]](seq[:, start:end], cache=cache, use_cache=True).logits
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            out.append(logp.gather(-1, seq[0, start + 1 : end + 1, None])[:, 0])
            start = end
    return torch.cat(out)[p - 1 :]  # the response tokens


def test_partial_rollouts_continue_on_the_new_weights(ray_session, tmp_path, monkeypatch):
    """on_weight_update=partial (default): a long generation spans updates and goes on where it was, with the new
    weights: its tokens carry both versions, and the engine's log-probs of each token are those of the weights
    of its version attending to the cache the earlier tokens left (to float32 rounding), not those of either
    version alone. (hold_generation_for_each_update makes a generation span each update on any machine.)
    Trained on a reward the random policy earns (non-zero advantages, so every update changes the weights)."""
    trained: list[DataProto] = []

    def export(s):  # the trainer's weights before each step: the policy of version step - 1
        s.roles.actor.export_hf(str(tmp_path / f"v{s.state.step - 1}"))

    hold_generation_for_each_update(monkeypatch)
    result = run(
        tmp_path,
        "async_rl.mode=full",
        "async_rl.max_staleness=2",
        "data.max_response_length=96",
        digit_reward(tmp_path),
        record=trained,
        monkeypatch=monkeypatch,
        before_step=export,
    )
    rows = steps_of(result)
    assert all(r["critic/advantages/max"] > 0 and r["actor/grad_norm"] > 0 for r in rows)
    assert sum(r["weight_sync/aborted_requests"] for r in rows) == 0
    spanning = [  # (batch, row) of the trained samples whose tokens two or more versions sampled
        (batch, i) for batch in trained for i in range(len(batch)) if len(set(token_versions(batch, i))) > 1
    ]
    assert len(spanning) == sum(r["async/partial_samples"] for r in rows)
    assert {max(token_versions(batch, i)) for batch, i in spanning} == {1, 2, 3}  # every update spanned
    models = {
        v: AutoModelForCausalLM.from_pretrained(tmp_path / f"v{v}", torch_dtype=torch.float32).eval()
        for v in range(len(trained))
    }
    for batch, i in spanning:
        versions = token_versions(batch, i)
        assert versions == sorted(versions)  # the older weights' tokens first, then the newer ones
        p_mask = batch.batch["attention_mask"][i, : batch.batch["prompts"].shape[1]] > 0
        prompt = batch.batch["prompts"][i][p_mask].tolist()
        response = batch.batch["responses"][i][: len(versions)].tolist()
        engine = batch.batch["rollout_log_probs"][i][: len(versions)]
        # the engine's log-probs are the continued generation's (float32 between two implementations: 1e-4)
        continued = behaviour_log_probs(models, prompt, response, versions)
        assert torch.allclose(engine, continued, atol=1e-4), (engine - continued).abs().max()
        # and neither version alone gives them: the tokens after the switch differ from the old weights'
        # and, through the old weights' cache, from the new weights' by far more than numerics
        after = torch.tensor(versions) > versions[0]
        for v in (versions[0], versions[-1]):
            alone = behaviour_log_probs(models, prompt, response, [v] * len(versions))
            assert (engine - alone)[after].abs().max() > 1e-2, v


def test_resume_regenerates_the_prompts_the_checkpoint_had_not_trained_on(ray_session, tmp_path, monkeypatch):
    """Interrupted after step 2 (the checkpoint holds the loader's position and the prompts pulled but not yet
    trained on); resumed to step 5: those prompts are generated again first, and no prompt is trained twice or
    skipped."""
    common = ["async_rl.mode=full", "async_rl.buffer_batches=2", "trainer.save_freq=2"]
    first: list[DataProto] = []
    run(tmp_path, *common, "trainer.total_training_steps=2", record=first, monkeypatch=monkeypatch)
    extra = torch.load(Path(tmp_path) / "run/checkpoints/actor/step_2/engine_state.pt", weights_only=False)[
        "extra"
    ]
    pending = [str(p.non_tensor_batch["uid"][0]) for p in extra["async_pending"]]
    assert len(pending) >= 2  # the stream had run ahead of the trainer
    second: list[DataProto] = []
    result = run(tmp_path, *common, "trainer.total_training_steps=5", record=second, monkeypatch=monkeypatch)
    assert result["step"] == 5 and len(second) == 3  # steps 3, 4, 5
    # requeued first, in order (one rollout rank: calls finish in order)
    assert uids(second[0])[::2] == pending[:2]
    trained = [u for batch in first + second for u in uids(batch)[::2]]  # rows a,a,b,b: one uid per group
    assert len(trained) == len(set(trained)) == 10  # 5 steps x 2 prompts, none twice
    assert set(pending) <= set(trained)


def test_async_modes_need_a_rollout_pool_of_their_own():
    with pytest.raises(ConfigError, match="async_rl.mode=full .* needs trainer.placement=disaggregated"):
        load_config("grpo_async", ["trainer.placement=colocated", "trainer.n_gpus_per_node=1"])
    with pytest.raises(ConfigError, match="on_weight_update=abort needs rollout.name=native"):
        load_config("grpo_async", ["async_rl.on_weight_update=abort", "rollout.name=sglang"])
    cfg = load_config(
        "grpo_async", ["async_rl.mode=sync", "trainer.placement=colocated", "trainer.n_gpus_per_node=1"]
    )
    assert cfg.async_rl.mode == "sync"


DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_async_grpo_raises_an_easy_reward(ray_session, tmp_path, mode):
    """The same easy reward the synchronous GRPO test raises (share of digits), trained on samples up to one
    version stale with the truncated-IS correction: it rises as well."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGIT_REWARD)
    result = run(
        tmp_path,
        f"async_rl.mode={mode}",
        f"custom_reward_function.path={reward_file}",
        # the rise starts at steps 4-9, depending on timing (a fresh-check's one-step run rose only from step 9 and
        # ended at 0.23 after 12): room for it
        "trainer.total_training_steps=16",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "rollout.n=4",
        "data.max_response_length=16",
        "actor.optim.lr=3e-2",
        "actor.use_kl_loss=false",
        "algorithm.rollout_correction=tis",
    )
    rows = steps_of(result)
    scores = [r["critic/score/mean"] for r in rows]
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.05 and last > 0.3 and last > 10 * first, f"reward did not rise: {scores}"
    assert max(r["async/staleness_max"] for r in rows) == 1  # it did train on stale samples
    assert any(r["off_policy/is_weight_max"] != 1.0 for r in rows)  # the correction weighed them


def test_a_wall_time_budget_ends_training_like_the_last_step(ray_session, tmp_path):
    """trainer.max_train_time_s: the first step that ends past the budget is the last one: validation and a
    checkpoint are due there as at the last of trainer.total_training_steps."""
    result = run(
        tmp_path,
        "trainer.total_training_steps=500",
        "trainer.max_train_time_s=1.5",
        "trainer.test_freq=1000",
        "trainer.save_freq=1000",
    )
    last = result["step"]
    assert 1 <= last < 500
    assert [s for s, _ in result["val_history"]] == [last]
    assert (Path(result["run_dir"]) / "checkpoints/latest_step").read_text().strip() == str(last)


def test_sync_mode_generates_then_trains_with_the_same_metrics(ray_session, tmp_path):
    """async_rl.mode=sync (colocated here): every batch comes from the trainer's own weights, the trainer waits for
    all of generation and the engines wait for all of training -- the baseline the asynchronous modes are
    measured against."""
    result = run(tmp_path, "async_rl.mode=sync", "trainer.placement=colocated", "trainer.n_gpus_per_node=1")
    for r in steps_of(result):
        assert r["async/staleness_max"] == 0 and r["async/partial_samples"] == 0
        assert 0 < r["async/trainer_idle_frac"] < 1 and 0 < r["async/rollout_idle_frac"] < 1
        assert r["off_policy/log_ratio_abs_max"] < 1e-3  # same weights: only numerics between the engines
    last = result["last_batch"]
    assert set(last.batch["rollout_versions"][last.batch["response_mask"] > 0].tolist()) == {3}
