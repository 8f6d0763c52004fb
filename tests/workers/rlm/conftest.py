"""Fixtures of the RLM tests: the nano tiny model's tokenizer (scripted policies speak its ids) and a real REPL
sandbox per test module. A module that needs other sandbox limits defines its own ``sandbox``."""

from __future__ import annotations

import pytest

from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.sandbox import ReplSandbox, SandboxConfig


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(ensure_tiny_model("nano"))


@pytest.fixture(scope="module")
def sandbox():
    with ReplSandbox(SandboxConfig(timeout_s=5, max_output_chars=2000)) as sb:
        yield sb
