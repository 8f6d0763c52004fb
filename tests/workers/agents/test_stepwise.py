"""Step-wise rows (one per model turn, its exact token prefix as the prompt) against one masked row per
trajectory: the same policy gradient on a two-turn toy trajectory through the tiny model (exactly where the
loss aggregation makes the two equal, in direction where it does not), per-turn length limits that fit a
trajectory one row must cut, and the advantage of a trajectory on every one of its turns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from algorithms import compute_policy_loss_vanilla
from recipes.trainer.sources import fill_rows, is_source, run_estimator_on_sources
from workers.agents.batch import trajectories_to_dataproto
from workers.agents.trajectory import Trajectory, TrajectoryTurn
from workers.engine.packing import padded_response_log_probs
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_tiny_model("nano"))


@pytest.fixture(scope="module")
def model():
    # float64 (its RMSNorm still computes in float32): "exactly equal" holds to ~1e-8 of gradients ~0.3
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model("nano"), dtype=torch.float64)


def toy_trajectory(tok, uid: str = "u", traj_id: str = "u.0") -> Trajectory:
    """Two turns: prompt, the model's code, the REPL's observation, the model's answer (status finished)."""

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    t0 = TrajectoryTurn(0, prompt_token_ids=ids("Question: what is 12 + 30? Use the tool."))
    t0.response_token_ids = ids("x = 12 + 30\nprint(x)")
    t1 = TrajectoryTurn(1, prompt_token_ids=ids("\nObservation: 42\n"))
    t1.response_token_ids = ids("The tool printed 42.\nFINAL(42)")
    for t in (t0, t1):
        t.response_logprobs = [-0.5] * len(t.response_token_ids)
    return Trajectory(traj_id, "q", root_uid=uid, turns=[t0, t1], final_answer="42", status="finished")


def with_reward(data, score: float = 1.0):
    """The rule reward on every row's last response token (as the reward worker scores an answer)."""
    lengths = data.batch["attention_mask"][:, -data.batch["responses"].shape[1] :].sum(-1)
    rewards = torch.zeros_like(data.batch["response_mask"])
    rewards[torch.arange(len(data)), (lengths - 1).clamp(min=0)] = score
    data.batch["token_level_rewards"] = rewards
    return data


def policy_gradient(model, data, loss_agg_mode: str) -> torch.Tensor:
    """d(PPO clipped loss)/d(parameters) on-policy (old log-probs = the current ones), advantages from the
    recipe's advantage path (RLOO on the source rows: a group of one, so the advantage is the reward)."""
    advantages, _ = run_estimator_on_sources(data, "rloo")
    b = data.batch
    model.zero_grad()
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    log_probs = padded_response_log_probs(logits, b["responses"])
    loss, *_ = compute_policy_loss_vanilla(
        log_probs.detach(), log_probs, advantages, b["response_mask"], loss_agg_mode=loss_agg_mode
    )
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_both_modes_give_the_same_policy_gradient(model, tok):
    traj = toy_trajectory(tok)
    pad = tok.pad_token_id
    whole = with_reward(
        trajectories_to_dataproto([traj], max_prompt_length=64, max_response_length=64, pad_token_id=pad)
    )
    steps = with_reward(
        trajectories_to_dataproto(
            [traj], max_prompt_length=64, max_response_length=64, pad_token_id=pad, step_wise=True
        )
    )
    assert len(whole) == 1 and len(steps) == 2
    # the same trained tokens: turn 0's and turn 1's, never the observation
    assert whole.batch["response_mask"].sum() == steps.batch["response_mask"].sum()
    assert list(steps.non_tensor_batch["turn"]) == [0, 1] and list(is_source(steps)) == [False, True]

    def cos(a, b):
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    g = {
        m: (policy_gradient(model, whole, m), policy_gradient(model, steps, m))
        for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
    }
    # token-mean: the sum over the same tokens divided by the same token count -- exactly equal (each turn's
    # tokens see the same prefix at the same positions in both layouts)
    gw, gs = g["token-mean"]
    assert gw.norm() > 0 and torch.allclose(gw, gs, rtol=1e-5, atol=1e-7)
    # seq-mean-token-sum(-norm): the same token sum divided by 1 row vs 2 rows (times the same R) -- exactly
    # half, the same direction
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        gw, gs = g[mode]
        assert torch.allclose(gw, 2 * gs, rtol=1e-5, atol=1e-7) and cos(gw, gs) > 1 - 1e-9
    # seq-mean-token-mean: each row's token mean, so step-wise weighs each turn's tokens by 1/(its length)
    # while one row weighs all by 1/(both lengths) -- equal only for turns of equal length (here 13 and 17
    # tokens): not equal, the same direction (cosine 0.99 here)
    gw, gs = g["seq-mean-token-mean"]
    assert not torch.allclose(gw, gs, rtol=1e-3) and cos(gw, gs) > 0.9


def test_step_wise_fits_a_trajectory_one_row_must_cut(tok):
    traj = toy_trajectory(tok)
    t0, t1 = traj.turns
    n_prompt = len(t0.prompt_token_ids)
    after_prompt = len(traj.token_sequence()[0]) - n_prompt  # both turns and the observation
    turn_max = max(len(t0.response_token_ids), len(t1.response_token_ids))
    prefix_1 = n_prompt + len(t0.response_token_ids) + len(t1.prompt_token_ids)
    P, R = prefix_1, turn_max  # per-turn limits; the whole trajectory is longer than P + R allows one row
    assert after_prompt > R
    kw = dict(max_prompt_length=P, max_response_length=R, pad_token_id=tok.pad_token_id)
    one = trajectories_to_dataproto([traj], **kw)
    assert one.non_tensor_batch["truncated"][0] == "response"  # turn 1 lies beyond R: never trained
    assert one.batch["response_mask"].sum() < len(t0.response_token_ids) + len(t1.response_token_ids)
    masked = trajectories_to_dataproto([traj], mask_truncated=True, **kw)
    assert masked.batch["response_mask"].sum() == 0  # overlong filtering drops the whole trajectory
    steps = trajectories_to_dataproto([traj], step_wise=True, mask_truncated=True, **kw)
    assert list(steps.non_tensor_batch["truncated"]) == ["", ""] and steps.meta_info["dropped_turns"] == 0
    assert steps.batch["response_mask"].sum() == len(t0.response_token_ids) + len(t1.response_token_ids)
    ids, _, _ = traj.token_sequence()
    # row 1: the exact prefix the engine saw (left-padded), then turn 1's tokens and the engine's log-probs
    assert steps.batch["prompts"][1].tolist() == ids[:prefix_1]
    n1 = len(t1.response_token_ids)
    assert steps.batch["responses"][1, :n1].tolist() == t1.response_token_ids
    assert steps.batch["rollout_log_probs"][1, :n1].tolist() == [-0.5] * n1

    # a prefix over the limit drops that turn (counted); when no turn fits, one masked row stands in
    short = trajectories_to_dataproto([traj], step_wise=True, **{**kw, "max_prompt_length": prefix_1 - 1})
    assert list(short.non_tensor_batch["turn"]) == [0] and short.meta_info["dropped_turns"] == 1
    none_fit = trajectories_to_dataproto([traj], step_wise=True, **{**kw, "max_prompt_length": n_prompt - 1})
    assert len(none_fit) == 1 and none_fit.non_tensor_batch["truncated"][0] == "prompt"
    assert none_fit.batch["response_mask"].sum() == 0 and none_fit.meta_info["dropped_turns"] == 2


def test_trajectory_advantage_on_every_turn_and_filler_rows(tok):
    trajs = [toy_trajectory(tok, "g", f"g.{k}") for k in range(4)]
    trajs[1].turns = trajs[1].turns[:1]  # a one-turn sample in the same group
    data = trajectories_to_dataproto(
        trajs, max_prompt_length=64, max_response_length=64, pad_token_id=tok.pad_token_id, step_wise=True
    )
    assert list(data.non_tensor_batch["row_id"]) == [
        "g.0@0",
        "g.0@1",
        "g.1@0",
        "g.2@0",
        "g.2@1",
        "g.3@0",
        "g.3@1",
    ]
    assert list(data.non_tensor_batch["advantage_source"]) == [
        "g.0@1",
        "g.0@1",
        "g.1@0",
        "g.2@1",
        "g.2@1",
        "g.3@1",
        "g.3@1",
    ]
    with_reward(data, 0.0)
    data.batch["token_level_rewards"][1, 0] = 1.0  # sample 0 is right; every row of its is scored, as the
    data.batch["token_level_rewards"][0, 0] = 1.0  # reward worker scores the trajectory's answer on each
    filled = fill_rows(data, 4)
    assert len(filled) == 8 and filled.batch["response_mask"][7].sum() == 0
    adv, _ = run_estimator_on_sources(filled, "grpo")
    per_row = [float(adv[i][filled.batch["response_mask"][i] > 0].unique().item()) for i in range(7)]
    # GRPO over the 4 trajectories [1, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5], on every turn of each
    assert per_row == pytest.approx([1.5, 1.5, -0.5, -0.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert adv[7].abs().sum() == 0  # the filler row carries nothing
    with pytest.raises(ValueError, match="token-level"):
        run_estimator_on_sources(filled, "reinforce_plus_plus", gamma=1.0)
