"""benchmarks/gpu_check.py on the CPU: steps run in order, summary.json is whole after every step (a run cut off
at the GPU machine's limit returns what finished), a step past its limit is stopped and recorded as a timeout,
steps with too little of the deadline left are skipped with the reason, CUDA-only steps are skipped in the
rehearsal; and the first two real steps (facts, engine parity) at CPU sizes."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_summary_is_written_after_each_step_and_a_step_past_its_limit_is_stopped(tmp_path, monkeypatch):
    out = tmp_path / "out"
    py = ["-c"]  # the check runs each step as sys.executable + its arguments
    # the second step reads summary.json while it runs: the first step's entry must already be there
    reads_summary = (
        f"import json; s = json.load(open({str(out / 'summary.json')!r})); "
        "assert [e['step'] for e in s['steps']] == ['first'] and s['steps'][0]['status'] == 'ok', s"
    )
    steps = [
        gpu_check.Step("first", None, [*py, "print('one')"], limit_s=30, min_s=1),
        gpu_check.Step("second", None, [*py, reads_summary], limit_s=30, min_s=1),
        gpu_check.Step("hangs", None, [*py, "import time; time.sleep(60)"], limit_s=2, min_s=1),
        gpu_check.Step("cuda_only", None, None, limit_s=30, min_s=1),
        gpu_check.Step("too_long", None, [*py, "pass"], limit_s=30, min_s=10_000),
    ]
    monkeypatch.setattr(gpu_check, "steps", lambda: steps)
    rc = gpu_check.main(["--cpu", "--out", str(out), "--deadline-s", "120"])
    s = _summary(out)
    assert [e["step"] for e in s["steps"]] == ["first", "second", "hangs", "cuda_only", "too_long"]
    status = {e["step"]: e["status"] for e in s["steps"]}
    assert status == {
        "first": "ok",
        "second": "ok",
        "hangs": "timeout",
        "cuda_only": "skipped",
        "too_long": "skipped",
    }
    hangs = s["steps"][2]
    assert hangs["seconds"] < 20  # stopped at its 2 s limit, not after its 60 s sleep
    assert s["steps"][3]["why"] == "CUDA only"
    assert "needs 10000" in s["steps"][4]["why"]
    log = (out / "gpu_check.log").read_text()
    assert "one" in log and "===== hangs: timeout" in log
    assert rc == 1  # a timeout fails the check


def test_unknown_step_name_is_refused_with_the_list():
    with pytest.raises(SystemExit, match="unknown step.*'nope'.*'facts'"):
        gpu_check.main(["--cpu", "--only", "facts,nope"])


def test_facts_and_engine_parity_at_cpu_sizes(tmp_path):
    """The check's first two steps as the rehearsal runs them: the versions and a CPU matmul rate, then the
    FSDP2 engine (one gloo rank) against Hugging Face, fp32 and bf16, passing its own tolerances."""
    out = tmp_path / "out"
    rc = gpu_check.main(["--cpu", "--out", str(out), "--only", "facts,engine_parity", "--deadline-s", "300"])
    s = _summary(out)
    assert [e["status"] for e in s["steps"]] == ["ok", "ok"], (out / "gpu_check.log").read_text()[-3000:]
    facts, parity = (e["result"] for e in s["steps"])
    assert facts["versions"]["torch"] and facts["fp32_matmul_TFLOPs"] > 0
    rows = {r["precision"]: r for r in parity["rows"]}
    assert rows["fp32"]["lp_max_abs"] < 1e-4 and rows["fp32"]["update_rel_dist"] < 0.01
    assert rows["bf16"]["lp_mean_abs"] > rows["fp32"]["lp_mean_abs"]  # bf16 really ran in bf16
    assert all(r["pass"] for r in parity["rows"])
    assert rc == 0


def test_the_suite_runs_without_pytest_xdist():
    """A machine with pytest but without pytest-xdist (the GPU check's rehearsal lacked it) loads tests/conftest.py,
    whose xdist hook must then be optional. Before, pytest stopped with an INTERNALERROR (unknown hook) and ran no
    test."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/test_skips.py",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "passed" in run.stdout, run.stdout + run.stderr
