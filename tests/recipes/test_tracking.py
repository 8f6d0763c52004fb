"""The per-step console line carries what issue 5 asks for: reward, accuracy, length, KL, time, tokens/s."""

from recipes.trainer.tracking import console_line


def test_console_line_has_every_required_field():
    metrics = {
        "critic/score/mean": 0.625,
        "train/accuracy": 0.5,
        "val/accuracy": 0.74,
        "response_length/mean": 33.25,
        "actor/kl_loss": 0.0123,
        "timing_s/step": 2.0,
        "perf/total_num_tokens": 8000,
    }
    line = console_line(metrics, step=3, total=40, recipe="grpo")
    assert line == (
        "[grpo] step 3/40 | reward 0.625 | acc 0.5 | val_acc 0.74 | resp_len 33.2 | kl 0.0123 | 2.0s | 4000 tok/s"
    )


def test_console_line_falls_back_to_the_update_kl_without_a_reference():
    line = console_line({"actor/ppo_kl": 0.002}, step=1, total=2, recipe="quickstart")
    assert "ppo_kl 2.00e-03" in line and " kl " not in line


def test_reward_errors_are_counted_over_every_row():
    import numpy as np
    import torch

    from dataproto import DataProto
    from recipes.trainer.metrics import compute_data_metrics

    batch = DataProto.from_dict(
        {
            "attention_mask": torch.ones(4, 6, dtype=torch.int64),
            "response_mask": torch.ones(4, 3),
            "token_level_scores": torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 1.0], [0, 0, 0]]),
        },
        {"reward_error": np.array(["", "row 1: ValueError", "", "row 3: KeyError"], dtype=object)},
    )
    metrics = compute_data_metrics(batch)
    assert metrics["reward/errors"] == 2.0 and metrics["train/accuracy"] == 0.5
