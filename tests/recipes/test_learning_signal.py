"""``reward/zero_variance_groups`` and the once-only console warning when no group has a learning signal
(recipes/trainer/metrics.py, recipes/trainer/steps.py:LearningSignalWatch); the recipe path is
tests/recipes/test_reliability.py::test_a_run_without_learning_signal_says_so_once_with_cause_and_fix."""

import numpy as np
import torch

from recipes.trainer.metrics import zero_variance_groups
from recipes.trainer.steps import LearningSignalWatch


def test_zero_variance_groups_counts_groups_whose_samples_all_scored_the_same():
    uids = np.array(["a", "a", "b", "b", "c", "c", "d"])  # d: a group of one, which says nothing
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    assert zero_variance_groups(uids, scores) == 2 / 3
    assert zero_variance_groups(np.array(["a", "b"]), torch.tensor([0.0, 1.0])) is None  # rollout.n=1


class _Console:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)


def test_watch_speaks_once_after_three_flat_steps_in_a_row_and_names_saturation():
    console, watch = _Console(), LearningSignalWatch()
    flat = {"reward/zero_variance_groups": 1.0, "critic/score/mean": 1.0, "train/accuracy": 1.0}
    for step, metrics in enumerate([flat, flat, {"reward/zero_variance_groups": 0.5}, flat, flat], start=1):
        watch.check(metrics, step, console)
    assert console.lines == []  # the run of flat steps was broken at step 3
    for step in (6, 7, 8):
        watch.check(flat, step, console)
    assert len(console.lines) == 1 and console.lines[0].startswith("WARNING steps 4-6: every prompt group's")
    assert "the task is saturated" in console.lines[0]
