"""The placement benchmark run end to end on CPU bundles (k=1 step, nano model): its JSON, table fields, PNG and
the cost model's predictions. The test runs two of the three placements (colocated and split_critic) to stay
short; disaggregated runs in the recipe end-to-end tests and in the recorded benchmark. The split_critic
placement's config checks are in tests/recipes/test_split_critic_config.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import bench_placement


def test_bench_rejects_a_bad_split_before_running():
    with pytest.raises(SystemExit, match="rollout_per_node=2"):
        bench_placement.main(["--devices", "2", "--rollout-devices", "2", "--out", "/tmp/unused"])


TINY = [
    "model.tiny_size=nano",
    "task.n_train=16",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
]


@pytest.mark.e2e
def test_bench_placement_runs_every_placement(ray_session, tmp_path):
    flags = [
        "--devices",
        "2",
        "--steps",
        "1",
        "--placements",
        "colocated,split_critic",
        "--out",
        str(tmp_path),
    ]
    report = bench_placement.main([*flags, *TINY])
    names = ["colocated(2)", "split_critic(critic=1,actor=1)"]
    saved = json.loads(Path(report["json"]).read_text())
    assert list(saved["placements"]) == names and saved["functional_run"] is True
    pools = {names[0]: {"global_pool"}, names[1]: {"actor_pool", "critic_pool"}}
    for name in names:
        entry = saved["placements"][name]
        m = entry["measured"]
        assert m["steps_averaged"] == 1 and m["memory_peak_gib"] is None  # CPU bundles: no device memory
        for stage in ("gen", "update_actor", "update_critic", "update_weights", "values", "ref"):
            assert m["timing_s"][stage] > 0, (name, stage)
        assert m["step_s"] >= sum(m["timing_s"].values()) * 0.999  # the stages run one after another
        assert set(m["idle_s"]) == pools[name] and all(0 <= v <= m["step_s"] for v in m["idle_s"].values())
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / 2)
        for key in ("predicted", "predicted_leave_one_out"):
            step = entry[key]["step_s"]
            assert math.isfinite(step) and step > 0, (name, key)
    # split_critic: the critic pool idles at least while the actor pool generates and updates
    split = saved["placements"][names[1]]["measured"]
    assert split["idle_s"]["critic_pool"] >= split["timing_s"]["gen"] + split["timing_s"]["update_actor"]
    assert saved["parallel_limit"] == os.cpu_count()  # CPU bundles share the cores (cost model contention)
    rates = saved["rates"]
    assert all(math.isfinite(v) and v >= 0 for v in rates.values())  # parallel_limit: the 2 cores here
    ranking = saved["best"]["ranking"]  # every feasible 2-device placement, ranked by the fitted model
    assert {r["placement"] for r in ranking} == {*names, "disaggregated(rollout=1,train=1)"}
    assert [r["step_s"] for r in ranking] == sorted(r["step_s"] for r in ranking)
    assert Path(saved["png"]).is_file() and Path(saved["png"]).stat().st_size > 10_000
    assert [row["placement"] for row in saved["table"]] == names
