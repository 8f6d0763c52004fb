"""Skips that cannot stay silent in CI: ``skip_or_fail(reason)`` skips a test whose optional component is missing
here (with the reason saying how to get it), except under ``CI=true``, where .ci/run installs every such
component (SGLang, Slurm, bubblewrap, Chromium, megatron-core, the ray CLI) and runs as root: there the test fails.
Only CUDA-only tests may skip in CI."""

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def skip_or_fail(reason: str, *, allow_module_level: bool = False) -> None:
    if in_ci():
        pytest.fail(f"CI must run this test (.ci/run installs what it needs), but: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)
