"""Test-session fixtures: one Ray session for the whole pytest run (DESIGN.md conventions)."""

import os
import subprocess

import pytest

from tests.skips import skip_or_fail

# Logical CPUs given to the local Ray session. The CI machine has 2 physical cores; tests that place
# 4 single-CPU bundles (4-process parity tests) need more logical slots than that, and Ray treats
# num_cpus as a scheduling count, not a hard allocation. This is the test session's explicit choice to
# oversubscribe the cores; a recipe that starts Ray itself asks for it with trainer.cpu_oversubscribe=true.
RAY_TEST_CPUS = 8


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(
            num_cpus=RAY_TEST_CPUS,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def needs():
    """``needs(reason)``: skip for a missing optional component (SGLang, Slurm), with the reason saying how to get
    it -- except in CI (``CI=true``), whose .ci/run installs every such component: there the test fails."""

    def missing(reason: str):
        skip_or_fail(reason)

    return missing


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a directory on a real tmpfs of ``size`` (e.g. "4m"), a disk that fills up. Needs
    root for mount(2); skips with the reason where it cannot be mounted."""
    mounts = []

    def mount(size: str):
        mnt = tmp_path / f"disk{len(mounts)}"
        mnt.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
        )
        if r.returncode:
            skip_or_fail(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
