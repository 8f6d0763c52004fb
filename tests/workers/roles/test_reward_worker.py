"""RewardWorker through a 2-rank worker group: decoded responses scored by data source, the score on the last
valid response token, per-row error isolation and the error count."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import RewardConfig
from workers.reward import register_scorer
from workers.roles import RewardWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

R = 32


class ScorerTestRewardWorker(RewardWorker):
    """Registers a scorer that raises on a marker, in the worker's process (as recipes register theirs)."""

    def __init__(self, path, reward):
        def flaky(solution_str, ground_truth, extra_info=None):
            if "boom" in solution_str:
                raise RuntimeError("scorer exploded")
            return 0.5

        register_scorer("test/flaky")(flaky)
        super().__init__(path, reward)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from workers.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("roles_reward") / "tok"
    build_tokenizer(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from workers.models import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def reward_wg(ray_session, tokenizer_dir):
    pool = ResourcePool([2], name="roles_reward2")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(ScorerTestRewardWorker, tokenizer_dir, RewardConfig()),
        name_prefix="reward",
    )
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.remove()


# (response text, data_source, ground truth, expected score, is an error)
ROWS = [
    ("Let me see. 6*7 = 42. The answer is \\boxed{42}.", "math", "42", 1.0, False),  # correct
    ("The answer is \\boxed{41}.", "math", "42", 0.0, False),  # wrong
    ("I think it is 42.", "math", "42", 0.0, False),  # no box
    ("boom \\boxed{1}", "test/flaky", "1", 0.0, True),  # the scorer raises: only this row fails
    ("fine \\boxed{1}", "test/flaky", "1", 0.5, False),
    ("\\boxed{ 3/4 }", "numeric", "0.75", 1.0, False),
    ("\\boxed{7}", "math", None, 0.0, True),  # no ground truth for this row
    ("", "math", "42", 0.0, False),  # empty response
]


def make_batch(tokenizer, rows=ROWS, prompt_len: int = 3) -> tuple[DataProto, list[int]]:
    """Responses end with <|im_end|> (a special token, skipped when decoding) and are right-padded."""
    n, pad = len(rows), tokenizer.pad_token_id
    responses = torch.full((n, R), pad, dtype=torch.long)
    attention = torch.zeros(n, prompt_len + R, dtype=torch.long)
    attention[:, :prompt_len] = 1
    lengths = []
    for i, (text, *_) in enumerate(rows):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids = ids + ([tokenizer.eos_token_id] if text else [])
        assert len(ids) <= R, (text, len(ids))
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, prompt_len : prompt_len + len(ids)] = 1
        lengths.append(len(ids))
    prompts = torch.randint(4, 100, (n, prompt_len))
    reward_model = [{"ground_truth": gt} if gt is not None else {} for _, _, gt, _, _ in rows]
    data = DataProto.from_dict(
        {
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "response_mask": attention[:, prompt_len:].float(),
        },
        non_tensors={"data_source": [r[1] for r in rows], "reward_model": reward_model},
    )
    return data, lengths


def test_scores_land_on_last_valid_token(reward_wg, tokenizer):
    data, lengths = make_batch(tokenizer)
    out = reward_wg.compute_rm_score(data)
    scores = out.batch["token_level_scores"]
    assert scores.shape == (len(ROWS), R) and scores.dtype == torch.float32
    expected = torch.tensor([r[3] for r in ROWS])
    torch.testing.assert_close(scores.sum(dim=1), expected)
    for i, length in enumerate(lengths):
        pos = max(length - 1, 0)  # the <|im_end|> token; token 0 for the empty response
        assert scores[i, pos] == expected[i]
        assert (scores[i, torch.arange(R) != pos] == 0).all()
    # decoding stopped at the valid length and dropped the special token
    assert list(out.non_tensor_batch["response_text"]) == [r[0] for r in ROWS]
    errors = list(out.non_tensor_batch["reward_error"])
    assert [bool(e) for e in errors] == [r[4] for r in ROWS]
    assert "RuntimeError: scorer exploded" in errors[3] and "test/flaky" in errors[3]
    assert "ground_truth" in errors[6]


def test_error_count_and_messages(reward_wg, tokenizer):
    data, _ = make_batch(tokenizer, rows=ROWS[:4])  # one rank gets rows 0-1, the other rows 2-3
    out = reward_wg.compute_rm_score(data)
    assert out.meta_info["metrics"] == {"reward/errors": 1.0}  # summed over the ranks: row 3 on rank 1
    data, _ = make_batch(tokenizer, rows=[ROWS[3], ROWS[6], ROWS[0], ROWS[1]])
    out = reward_wg.compute_rm_score(data)
    assert out.meta_info["metrics"] == {"reward/errors": 2.0}
    messages = out.meta_info["reward_error_messages"]
    assert len(messages) == 2 and messages[0].startswith("row 0 (test/flaky): RuntimeError: scorer exploded")
    assert messages[1].startswith("row 1 (math): reward_model has no 'ground_truth'")
    assert out.batch["token_level_scores"].sum(1).tolist() == [0.0, 0.0, 1.0, 0.0]


def test_unknown_data_source_is_a_config_error(reward_wg, tokenizer):
    data, _ = make_batch(tokenizer, rows=[("\\boxed{1}", "nobody/knows", "1", 0.0, False)] * 2)
    with pytest.raises(
        WorkerGroupError, match=r"RewardWorker rank \d/2: compute_rm_score row 0: no reward scorer"
    ):
        reward_wg.compute_rm_score(data)


def test_default_scorer_covers_unknown_sources(tokenizer_dir, tokenizer, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT"):  # a Worker made outside a group exports these; undo that
        monkeypatch.delenv(var, raising=False)
    worker = RewardWorker(tokenizer_dir, RewardConfig(default_scorer="math"))  # plain object, this process
    data, _ = make_batch(tokenizer, rows=[("\\boxed{42}", "nobody/knows", "42", 1.0, False)])
    out = worker.compute_rm_score(data)
    assert out.batch["token_level_scores"].sum().item() == 1.0
    with pytest.raises(KeyError, match="non_tensor_batch key 'data_source'"):
        worker.compute_rm_score(DataProto.from_dict(dict(data.batch)))


def test_rlm_rows_are_scored_on_their_final_answer(reward_wg, tokenizer):
    """An `answer` column (RLM trajectories, whose responses are whole transcripts) is what gets scored."""
    data, lengths = make_batch(tokenizer, rows=ROWS[:2])
    data.non_tensor_batch["data_source"] = np.array(["hyflow/sniah"] * 2, dtype=object)
    data.non_tensor_batch["reward_model"] = np.array([{"ground_truth": "1234567"}] * 2, dtype=object)
    data.non_tensor_batch["answer"] = np.array(["1234567", None], dtype=object)
    out = reward_wg.compute_rm_score(data)
    assert out.batch["token_level_scores"].sum(dim=1).tolist() == [1.0, 0.0]
    assert list(out.non_tensor_batch["response_text"]) == ["1234567", ""]
