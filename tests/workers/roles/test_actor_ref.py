"""ActorWorker and RefWorker through real worker groups: 2 gloo ranks (FSDP2) with the reference colocated in the
same processes, a 1-rank actor for the parity check, and a standalone 1-rank reference. Numbers are compared with
a plain Hugging Face forward in this process and between the data-parallel layouts."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError, create_colocated_worker_cls
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import OptimConfig
from workers.roles import ActorWorker, RefWorker

P, R = 6, 5  # prompt / response length of the test batches
ATOL = 1e-5

ACTOR_METRICS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/grad_norm",
    "actor/lr",
    "actor/skipped_steps",
}


def actor_config(**micro) -> ActorConfig:
    # 2 prompts x n=2 = 4 rows per optimizer step; 8-row batches give 2 mini-batches, x 2 epochs = 4 steps.
    return ActorConfig(
        ppo_mini_batch_size=2,
        ppo_epochs=2,
        clip_ratio=0.2,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        optim=OptimConfig(lr=5e-3, grad_clip=1.0, warmup_steps=10),
        **micro,
    )


ROLLOUT = RolloutConfig(
    n=2, temperature=1.0, log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=24
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("roles_actor") / "nano", size="nano", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from workers.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def groups(ray_session, model_dir):
    model = ModelConfig(path=model_dir)
    pools = [
        ResourcePool([2], name="roles_actor_ref2"),
        ResourcePool([1], name="roles_actor1"),
        ResourcePool([1], name="roles_ref1"),
    ]
    fused = create_colocated_worker_cls(
        {
            # dp=2 trains with a token budget per micro-batch, dp=1 with 3 rows: the results must not care.
            "actor": RayClassWithInitArgs(
                ActorWorker, model, actor_config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25), ROLLOUT
            ),
            "ref": RayClassWithInitArgs(RefWorker, model, ROLLOUT),
        }
    )
    actor1 = RayClassWithInitArgs(
        ActorWorker, model, actor_config(use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=3), ROLLOUT
    )
    specs = [(pools[0], fused, "actor_ref"), (pools[1], actor1, "actor_dp1")]
    specs.append((pools[2], RayClassWithInitArgs(RefWorker, model, ROLLOUT), "ref_dp1"))
    with ThreadPoolExecutor(3) as ex:  # the groups' processes start at the same time
        colocated, actor1, ref1 = ex.map(lambda s: RayWorkerGroup(s[0], s[1], name_prefix=s[2]), specs)
    roles = colocated.spawn({"actor", "ref"})
    # every group's init_model at once (the colocated reference's runs after its actor's, same processes)
    inits = [
        wg.init_model.with_options(blocking=False)() for wg in (roles["actor"], roles["ref"], actor1, ref1)
    ]
    [f.get() for f in inits]
    yield {"actor2": roles["actor"], "ref2": roles["ref"], "actor1": actor1, "ref1": ref1}
    for wg in (colocated, actor1, ref1):
        wg.shutdown()
    for pool in pools:
        pool.remove()


# ----------------------------------------------------------------------------------------------- helpers


def make_batch(tokenizer, n: int = 8, seed: int = 0) -> DataProto:
    """Left-padded prompts, right-padded responses of random lengths (BATCH_LAYOUT.md), a multi-turn hole."""
    g = torch.Generator().manual_seed(seed)
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    prompts = torch.full((n, P), pad, dtype=torch.long)
    responses = torch.full((n, R), pad, dtype=torch.long)
    p_mask = torch.zeros(n, P, dtype=torch.long)
    r_mask = torch.zeros(n, R, dtype=torch.long)
    for i in range(n):
        pl = int(torch.randint(2, P + 1, (1,), generator=g))
        rl = int(torch.randint(2, R + 1, (1,), generator=g))
        prompts[i, P - pl :] = torch.randint(4, vocab, (pl,), generator=g)
        responses[i, :rl] = torch.randint(4, vocab, (rl,), generator=g)
        p_mask[i, P - pl :] = 1
        r_mask[i, :rl] = 1
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    response_mask = r_mask.float()
    response_mask[0, 1] = 0.0  # an environment-observation token: in the context, not trained on
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
        }
    )


def with_tensors(data: DataProto, **tensors) -> DataProto:
    return DataProto.from_dict({**data.batch, **tensors}, meta_info=dict(data.meta_info))


def signed_advantages(data: DataProto) -> torch.Tensor:
    """+1 on even rows, -1 on odd rows (each rank's chunk holds both)."""
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(data))])
    return sign[:, None] * data.batch["response_mask"]


def rl_batch(groups, tokenizer, seed: int, actor: str = "actor2") -> DataProto:
    """A batch ready for update_actor: on-policy old log-probs, reference log-probs, signed advantages."""
    data = make_batch(tokenizer, seed=seed)
    old = groups[actor].compute_log_prob(data).batch["old_log_probs"]
    ref = groups["ref2"].compute_ref_log_prob(data).batch["ref_log_prob"]
    return with_tensors(data, old_log_probs=old, ref_log_prob=ref, advantages=signed_advantages(data))


@torch.no_grad()
def hf_log_probs(
    model_dir: str, data: DataProto, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the responses from a plain padded HF forward (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    return _hf_forward(model, data, temperature)


@torch.no_grad()
def _hf_forward(model, data: DataProto, temperature: float = 1.0):
    b = data.batch
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits.float()
    logits = logits[:, P - 1 : P + R - 1] / temperature  # positions that predict the response tokens
    logp = torch.log_softmax(logits, dim=-1)
    token_lp = logp.gather(-1, b["responses"][..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    valid = b["attention_mask"][:, P:].float()
    return token_lp * valid, entropy * valid


def row_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(1) / mask.sum(1)


def reset(*wgs) -> None:
    """Rebuild the engines from the model directory (fresh weights, optimizer and step counters)."""
    for wg in wgs:
        wg.init_model()


def assert_metrics_close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=atol), (k, a[k], b[k])


# ----------------------------------------------------------------------------------------------- tests


def test_compute_log_prob_matches_hf_forward(groups, model_dir, tokenizer):
    reset(groups["actor2"], groups["actor1"])
    data = make_batch(tokenizer, seed=1)
    data.meta_info["temperature"] = 0.7
    out = groups["actor2"].compute_log_prob(data)
    ref_lp, ref_ent = hf_log_probs(model_dir, data, temperature=0.7)
    assert out.batch["old_log_probs"].shape == (8, R) and out.batch["entropys"].shape == (8, R)
    assert out.meta_info["temperature"] == 0.7
    torch.testing.assert_close(out.batch["old_log_probs"], ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.batch["entropys"], ref_ent, atol=ATOL, rtol=0)
    # padding is exactly zero; the rows really differ from each other (not a constant)
    assert (out.batch["old_log_probs"][data.batch["attention_mask"][:, P:] == 0] == 0).all()
    # the colocated reference (same weights before any update) and the standalone one agree
    for ref in ("ref2", "ref1"):
        ref_out = groups[ref].compute_ref_log_prob(data)
        torch.testing.assert_close(ref_out.batch["ref_log_prob"], ref_lp, atol=ATOL, rtol=0)
    # temperature defaults to rollout.temperature (1.0) without meta_info
    plain = groups["actor1"].compute_log_prob(make_batch(tokenizer, seed=1))
    torch.testing.assert_close(
        plain.batch["old_log_probs"], hf_log_probs(model_dir, data)[0], atol=ATOL, rtol=0
    )


def test_ref_is_colocated_and_frozen_while_actor_learns(groups, tokenizer):
    actor, ref = groups["actor2"], groups["ref2"]
    reset(actor)
    a_info, r_info = actor.worker_info(), ref.worker_info()
    assert [i["pid"] for i in a_info] == [i["pid"] for i in r_info] and len({i["pid"] for i in a_info}) == 2
    assert [i["dp_size"] for i in a_info] == [2, 2] and all(i["use_fsdp"] for i in a_info + r_info)

    data = rl_batch(groups, tokenizer, seed=2)
    ref_before = ref.compute_ref_log_prob(data).batch["ref_log_prob"]
    torch.testing.assert_close(ref_before, data.batch["old_log_probs"], atol=1e-6, rtol=0)

    metrics = actor.update_actor(data).meta_info["metrics"]
    assert set(metrics) == ACTOR_METRICS
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/grad_norm"] > 0
    assert metrics["actor/lr"] == pytest.approx(5e-3 * 4 / 10)  # 4th step of a 10-step linear warm-up
    assert 0 <= metrics["actor/pg_clipfrac"] <= 1 and metrics["actor/entropy"] > 0

    after = actor.compute_log_prob(data).batch["old_log_probs"]
    mask = data.batch["response_mask"]
    delta = row_means(after, mask) - row_means(data.batch["old_log_probs"], mask)
    assert (delta[0::2] > 0).all(), delta  # positive advantage: more likely
    assert (delta[1::2] < 0).all(), delta  # negative advantage: less likely
    ref_after = ref.compute_ref_log_prob(data).batch["ref_log_prob"]
    assert torch.equal(ref_after, ref_before)


def test_dp2_update_equals_dp1_update(groups, tokenizer):
    reset(groups["actor2"], groups["actor1"])
    data = rl_batch(groups, tokenizer, seed=3, actor="actor1")
    m2 = groups["actor2"].update_actor(data).meta_info["metrics"]
    # Global mini-batch k is the k-th block of each rank's contiguous chunk: rows {0,1,4,5} then {2,3,6,7}.
    # The 1-rank actor sees those mini-batches when the rows come in that order.
    m1 = groups["actor1"].update_actor(data.select_idxs([0, 1, 4, 5, 2, 3, 6, 7])).meta_info["metrics"]
    assert_metrics_close(m2, m1)
    probe = make_batch(tokenizer, seed=4)
    lp2 = groups["actor2"].compute_log_prob(probe).batch["old_log_probs"]
    lp1 = groups["actor1"].compute_log_prob(probe).batch["old_log_probs"]
    torch.testing.assert_close(lp2, lp1, atol=ATOL, rtol=0)
    assert not torch.allclose(
        lp2, groups["ref1"].compute_ref_log_prob(probe).batch["ref_log_prob"], atol=1e-3
    )


def test_non_finite_loss_skips_steps_and_counts_them(groups, tokenizer):
    actor = groups["actor1"]
    reset(actor)
    data = rl_batch(groups, tokenizer, seed=5, actor="actor1")
    probe = make_batch(tokenizer, seed=4)
    before = actor.compute_log_prob(probe).batch["old_log_probs"]
    adv = data.batch["advantages"].clone()
    adv[:, 0] = float("nan")  # a trained token of every row: every optimizer step is poisoned
    m = actor.update_actor(with_tensors(data, advantages=adv)).meta_info["metrics"]
    assert m["actor/skipped_steps"] == 4 and math.isnan(m["actor/grad_norm"])
    assert torch.equal(actor.compute_log_prob(probe).batch["old_log_probs"], before)
    assert actor.worker_info()[0]["global_step"] == 0
    # the next clean update trains again and the counter stays
    m = actor.update_actor(data).meta_info["metrics"]
    assert m["actor/skipped_steps"] == 4 and math.isfinite(m["actor/grad_norm"])


def test_sft_step_is_token_mean_nll(groups, tokenizer):
    actor = groups["actor2"]
    reset(actor)
    data = make_batch(tokenizer, seed=6)
    lp = actor.compute_log_prob(data).batch["old_log_probs"]
    mask = data.batch["response_mask"]
    expected = float(-(lp * mask).sum() / mask.sum())
    first = actor.sft_step(data).meta_info["metrics"]
    assert set(first) == {"sft/loss", "sft/grad_norm", "sft/lr", "sft/skipped_steps"}
    assert first["sft/loss"] == pytest.approx(expected, abs=ATOL)
    assert first["sft/grad_norm"] > 0
    second = actor.sft_step(data).meta_info["metrics"]
    assert second["sft/loss"] < first["sft/loss"]


def test_checkpoint_resume_repeats_the_same_updates(groups, tokenizer, tmp_path):
    actor = groups["actor2"]
    reset(actor)
    batches = [rl_batch(groups, tokenizer, seed=10 + i) for i in range(3)]
    actor.update_actor(batches[0])
    paths = actor.save_checkpoint(str(tmp_path / "ckpt"), 1, extra={"data_pos": 7})
    assert paths == [str(tmp_path / "ckpt" / "step_1")] * 2
    first = [actor.update_actor(b).meta_info["metrics"] for b in batches[1:]]
    probe = make_batch(tokenizer, seed=4)
    lp_first = actor.compute_log_prob(probe).batch["old_log_probs"]

    assert actor.load_checkpoint(paths[0]) == [{"data_pos": 7}] * 2
    assert [i["global_step"] for i in actor.worker_info()] == [4, 4]
    again = [actor.update_actor(b).meta_info["metrics"] for b in batches[1:]]
    for a, b in zip(first, again):
        assert_metrics_close(a, b, atol=1e-6)
    assert first[0]["actor/lr"] != first[1]["actor/lr"]  # the warm-up schedule was restored, not restarted
    torch.testing.assert_close(
        actor.compute_log_prob(probe).batch["old_log_probs"], lp_first, atol=1e-6, rtol=0
    )


def test_export_hf_loads_with_transformers(groups, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = groups["actor2"]
    reset(actor)
    actor.update_actor(rl_batch(groups, tokenizer, seed=20))  # export trained weights, not the initial ones
    out = actor.export_hf(str(tmp_path / "hf"))
    assert out == [str(tmp_path / "hf")] * 2
    model = AutoModelForCausalLM.from_pretrained(out[0], dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(out[0])
    assert tok.get_vocab() == tokenizer.get_vocab() and tok.pad_token_id == tokenizer.pad_token_id
    probe = make_batch(tokenizer, seed=4)
    hf_lp, _ = _hf_forward(model, probe)
    torch.testing.assert_close(actor.compute_log_prob(probe).batch["old_log_probs"], hf_lp, atol=ATOL, rtol=0)
    assert not torch.allclose(
        hf_lp, groups["ref1"].compute_ref_log_prob(probe).batch["ref_log_prob"], atol=1e-3
    )


def test_errors_name_role_rank_and_key(groups, tokenizer):
    data = make_batch(tokenizer, seed=7)
    with pytest.raises(WorkerGroupError, match=r"ActorWorker rank 0/1: update_actor needs batch key\(s\) "):
        groups["actor1"].update_actor(with_tensors(data, old_log_probs=torch.zeros(8, R)))
    with pytest.raises(WorkerGroupError, match=r"RefWorker rank \d/2: compute_ref_log_prob .*'responses'"):
        groups["ref2"].compute_ref_log_prob(DataProto.from_dict({"input_ids": data.batch["input_ids"]}))
    with pytest.raises(WorkerGroupError, match="not a multiple of 2"):  # 6 rows, 4 per step over 2 ranks
        groups["actor2"].update_actor(rl_batch(groups, tokenizer, seed=8).select_idxs(list(range(6))))


# ------------------------------------------------------- strictly on-policy update without old log-probs


@pytest.fixture(scope="module")
def on_policy_actor(ray_session, model_dir):
    """dp=2, one epoch of one mini-batch per 8-row batch (4 prompts x n=2): a strictly on-policy update."""
    pool = ResourcePool([2], name="roles_actor_on_policy")
    config = actor_config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25)
    config.ppo_mini_batch_size, config.ppo_epochs, config.use_kl_loss = 4, 1, False
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(ActorWorker, ModelConfig(path=model_dir), config, ROLLOUT),
        name_prefix="onpol",
    )
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.remove()


def test_on_policy_update_without_old_log_probs_equals_recomputing_them(on_policy_actor, tokenizer):
    """algorithm.old_log_prob=auto: the update's own forward gives the old log-probs; the update, its metrics
    and the returned old_log_probs equal those of the path with a compute_log_prob pass first."""
    actor = on_policy_actor
    data, probe = make_batch(tokenizer, seed=30), make_batch(tokenizer, seed=31)
    adv = signed_advantages(data)
    reset(actor)
    old = actor.compute_log_prob(data).batch["old_log_probs"]
    recomputed = actor.update_actor(with_tensors(data, old_log_probs=old, advantages=adv))
    after_recomputed = actor.compute_log_prob(probe).batch["old_log_probs"]
    assert "old_log_probs" not in recomputed.batch  # given: nothing to return

    reset(actor)
    own = actor.update_actor(with_tensors(data, advantages=adv))
    torch.testing.assert_close(own.batch["old_log_probs"], old, atol=1e-6, rtol=0)  # rows in input order
    padding = 1 - data.batch["attention_mask"][:, P:]
    assert float((own.batch["old_log_probs"] * padding).abs().sum()) == 0.0  # zeros on padding, as computed
    assert_metrics_close(own.meta_info["metrics"], recomputed.meta_info["metrics"], atol=1e-6)
    assert own.meta_info["metrics"]["actor/ppo_kl"] == 0.0  # ratio exactly 1
    moved = actor.compute_log_prob(probe).batch["old_log_probs"]
    torch.testing.assert_close(moved, after_recomputed, atol=1e-6, rtol=0)
    reset(actor)
    assert not torch.allclose(
        moved, actor.compute_log_prob(probe).batch["old_log_probs"], atol=1e-4
    )  # it learnt


def test_update_without_old_log_probs_must_be_strictly_on_policy(on_policy_actor, tokenizer):
    data = make_batch(tokenizer, n=16, seed=32)  # 16 rows: two mini-batches of 8
    with pytest.raises(
        WorkerGroupError, match=r"ActorWorker rank \d/2: update_actor: the batch has no old_log_p"
    ):
        on_policy_actor.update_actor(with_tensors(data, advantages=signed_advantages(data)))
