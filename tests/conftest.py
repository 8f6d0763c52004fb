"""Test-session fixtures: one Ray session for the whole pytest run (DESIGN.md conventions)."""

import os

import pytest

# Logical CPUs given to the local Ray session. The CI machine has 2 physical cores; tests that place
# 4 single-CPU bundles (4-process parity tests) need more logical slots than that, and Ray treats
# num_cpus as a scheduling count, not a hard allocation.
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
