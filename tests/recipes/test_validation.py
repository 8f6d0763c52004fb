"""Validation in the session: which steps validate (``Session.should_validate``), and the one generate -> score
loop under both validators (greedy accuracy, pass@k) with the environment's metrics as ``val-<name>``."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dataproto import DataProto
from recipes.config import load_config
from recipes.trainer.session import Session
from recipes.trainer.validation import PassAtK, greedy_accuracy


@pytest.mark.parametrize(
    "before, freq, total, steps",
    [
        (True, 4, 10, [0, 4, 8, 10]),  # before training, every 4 steps and at the last
        (False, 4, 10, [4, 8, 10]),
        (True, 5, 5, [0, 5]),
        (True, -1, 10, [0]),  # test_freq <= 0: never during training
        (False, 0, 3, []),
    ],
)
def test_should_validate_before_training_every_test_freq_steps_and_at_the_last(before, freq, total, steps):
    cfg = load_config("grpo", [f"trainer.val_before_train={before}", f"trainer.test_freq={freq}"])
    session = SimpleNamespace(cfg=cfg, total=total)  # all that should_validate reads
    assert [s for s in range(total + 1) if Session.should_validate(session, s)] == steps


class FakeRoles:
    """``generate`` answers each prompt ``n`` times, alternately right (score 1) and wrong, and reports an env
    metric besides the engine's counters; ``reward`` scores the ``right`` column."""

    def __init__(self):
        self.metas = []
        self.reward = SimpleNamespace(compute_rm_score=self._score)

    def generate(self, prompts: DataProto, meta: dict) -> DataProto:
        self.metas.append(dict(meta))
        n, rows = meta["n"], len(prompts)
        uids = np.repeat(prompts.non_tensor_batch["uid"], n)
        right = np.array([(i % n) < (1 if u == "a" else 0) for i, u in enumerate(uids)], dtype=object)
        return DataProto.from_dict(
            {"response_mask": torch.ones(rows * n, 3)},
            {"uid": uids, "data_source": np.array(["src"] * rows * n, dtype=object), "right": right},
            meta_info={
                "rollout/generated_tokens": 9,
                "timing_s/gen": 0.5,
                "metrics": {"env/turns/mean": float(len(self.metas))},
            },
        )

    def _score(self, out: DataProto) -> DataProto:
        scores = torch.zeros(len(out), 3)
        scores[:, -1] = torch.tensor([float(r) for r in out.non_tensor_batch["right"]])
        return DataProto.from_dict({"token_level_scores": scores})


def _batches():
    uid = lambda *u: {"uid": np.array(u, dtype=object)}  # noqa: E731
    return [DataProto.from_dict(non_tensors=uid("a", "b")), DataProto.from_dict(non_tensors=uid("c"))]


def test_greedy_accuracy_scores_every_sample_and_reports_the_env_metrics():
    roles, cfg = FakeRoles(), load_config("grpo", ["rollout.val_temperature=0"])
    m = greedy_accuracy(roles, _batches(), cfg)
    assert m["val/accuracy"] == pytest.approx(1 / 3) and m["val/num_samples"] == 3
    assert m["val-core/src/acc"] == pytest.approx(1 / 3)
    assert m["val-env/turns/mean"] == pytest.approx(1.5)  # averaged over the two batches
    assert not [
        k for k in m if k.startswith(("val-rollout/", "val-timing_s/"))
    ]  # the engine's, not the env's
    assert all(meta["n"] == 1 and not meta["do_sample"] and meta["validate"] for meta in roles.metas)


def test_pass_at_k_samples_max_k_per_problem():
    roles, cfg = FakeRoles(), load_config("grpo")
    m = PassAtK(ks=[1, 2], temperature=0.7)(roles, _batches(), cfg)
    assert [meta["n"] for meta in roles.metas] == [2, 2] and roles.metas[0]["temperature"] == 0.7
    assert m["val/num_problems"] == 3 and m["val/accuracy"] == pytest.approx(1 / 6)
    assert m["val/pass@1"] == pytest.approx(1 / 6)  # problem a: 1 of 2 samples right
    assert m["val/pass@2"] == pytest.approx(1 / 3)
    assert m["val-env/turns/mean"] == pytest.approx(1.5)
