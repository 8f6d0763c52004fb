"""Skips that cannot stay silent in CI: ``skip_or_fail(reason)`` skips a test whose optional component is missing
here (with the reason saying how to get it), except in CI (``CI=true``, ``1`` or ``yes``), where .ci/run installs every such
component (SGLang, Slurm, bubblewrap, Chromium, megatron-core, the ray CLI) and runs as root: there the test fails.
Only CUDA-only tests may skip in CI."""

import os

import pytest


def in_ci() -> bool:
    """CI as CI services set it: ``CI=true`` (GitHub, GitLab, ../shared/tools/fresh-check), ``CI=1``, ``CI=yes``,
    in any case; unset, empty, ``0``, ``false`` or ``no`` is a developer's machine."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes", "on")


def skip_or_fail(reason: str, *, allow_module_level: bool = False) -> None:
    if in_ci():
        pytest.fail(f"CI must run this test (.ci/run installs what it needs), but: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)
