"""Test-session fixtures: one Ray session for the whole pytest run (docs/architecture.md, Conventions)."""

import os
import subprocess

import pytest

from tests.skips import skip_or_fail

# Logical CPUs given to the local Ray session. The CI machine has 2 physical cores; tests that place
# 4 single-CPU bundles (4-process parity tests) need more logical slots than that, and Ray treats
# num_cpus as a scheduling count, not a hard allocation. This is the test session's explicit choice to
# oversubscribe the cores; a recipe that starts Ray itself asks for it with trainer.cpu_oversubscribe=true.
RAY_TEST_CPUS = 8


# The slowest units of work, slowest first (seconds of `pytest --durations=0` on a 2-core AMD EPYC, 2026-11-28):
# sglang 522, cluster_launch 283, hybrid_rl 211, grpo_async 193, recipes_e2e 175, resume 121, rlm_recipe 104,
# reliability 96. Under xdist they start first, so none of them starts last and leaves the other worker idle;
# every other module follows in collection order. Reorder when `make test`'s durations summary says so.
SLOWEST_FIRST = (
    "sglang",
    "tests/recipes/test_cluster_launch.py",
    "tests/recipes/test_hybrid_rl.py",
    "tests/recipes/test_grpo_async.py",
    "tests/recipes/test_recipes_e2e.py",
    "tests/recipes/test_resume.py",
    "tests/recipes/test_rlm_recipe.py",
    "tests/recipes/test_reliability.py",
    "tests/benchmarks/test_bench_vs_trl.py",
    "tests/benchmarks/test_bench_placement_async.py",
    "tests/workers/engine/test_megatron_roles.py",
    "tests/workers/engine/test_megatron.py",
    "tests/install/test_minimal_install.py",
)


def _unit(item) -> str:
    """The xdist unit of work a test belongs to: its module, or "sglang" for a test marked ``sglang``."""
    return "sglang" if item.get_closest_marker("sglang") else item.nodeid.split("::")[0]


def pytest_itemcollected(item):
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``) each test module is one unit of work, so its
    module-scoped fixtures (a model, a worker group, an SGLang engine) are set up once, on one worker. The tests
    marked ``sglang`` form one unit: tests/recipes/test_sglang_recipes.py asserts that no SGLang process outlives its
    test, which an engine of another module running beside it would break. (Marked here, during collection: xdist
    reads the marks in its own pytest_collection_modifyitems, which runs before ours.)"""
    if getattr(item.config.option, "loadgroup", False):  # what an xdist worker is told of `--dist loadgroup`
        item.add_marker(pytest.mark.xdist_group(_unit(item)))


def pytest_collection_modifyitems(config, items):
    """Under xdist's loadgroup the units go out in the order of their first test: slowest first."""
    if not getattr(config.option, "loadgroup", False):
        return
    if stale := [name for name in SLOWEST_FIRST[1:] if not (config.rootpath / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names no such test module: {stale}")

    def rank(item) -> int:
        unit = _unit(item)
        return SLOWEST_FIRST.index(unit) if unit in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: collection order within a rank


# optional: an xdist hook, and pytest must still run where xdist is not installed
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist names a test's group by appending ``@<group>`` to its id; where it cannot (pytest >= 9.1 with xdist 3.8),
    every test would be scheduled alone and the SGLang tests run side by side. Stop instead of running that."""
    if node.config.getoption("dist") == "loadgroup" and ids and "@" not in ids[0]:
        raise pytest.UsageError(
            f"--dist loadgroup: pytest-xdist did not group {ids[0]} (pytest {pytest.__version__}); "
            "install the dev extra's pytest (setup.py) or run without -n"
        )


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
