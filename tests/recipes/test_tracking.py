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
