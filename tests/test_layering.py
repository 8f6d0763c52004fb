"""The layering of docs/architecture.md, checked on every import statement of the package folders, lazy ones inside
functions included: arrows point one way (nothing below imports recipes/, the driver layer), controller/ knows no
model, algorithms/ knows no Ray, and rollout and environment code never imports the training package. A wrong
import fails here, not in review."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the project folders it may import (itself always): docs/architecture.md's table, bottom up
MAY_IMPORT = {
    "dataproto": set(),
    "algorithms": set(),
    "resource_pools": {"dataproto"},
    "controller": {"dataproto", "resource_pools"},
    "workers": {"dataproto", "resource_pools", "controller", "algorithms"},
    "recipes": {"dataproto", "resource_pools", "controller", "algorithms", "workers"},
    "benchmarks": {"dataproto", "resource_pools", "controller", "algorithms", "workers", "recipes"},
}
# third-party packages a folder must not import: what keeps it free of a model or of Ray
NEVER = {
    "dataproto": {"ray", "transformers"},
    "algorithms": {"ray", "transformers"},
    "controller": {"transformers", "peft", "sglang", "megatron"},
    "resource_pools": {"transformers", "peft", "sglang", "megatron"},
}


# Floors inside workers/: what serves rollouts and environments never imports the training package
# (workers.engine: FSDP, Megatron, their optimizers); the helpers both sides use live below it
# (workers.distributed, workers.models).
NOT_THE_TRAINING_PACKAGE = ("rollout", "agents", "sandbox", "rlm", "math_env", "reward", "prm", "weight_sync")


def imports(path: Path, depth: int = 1) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, the module cut to its first ``depth`` parts."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "workers":  # from workers import engine
                names = [f"workers.{alias.name}" for alias in node.names]
        out += [(node.lineno, ".".join(name.split(".")[:depth])) for name in names]
    return out


def violations(folder: str) -> list[str]:
    allowed = MAY_IMPORT[folder] | {folder}
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module in MAY_IMPORT and module not in allowed:
                found.append(f"{where} imports {module}/, a layer {folder}/ may not import")
            if module in NEVER.get(folder, ()):
                found.append(f"{where} imports {module}, which {folder}/ must not depend on")
    return found


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_no_import_runs_up_a_layer(folder):
    found = violations(folder)
    assert not found, "\n".join(found)


def test_rollout_and_environment_code_never_imports_the_training_package():
    found = []
    for package in NOT_THE_TRAINING_PACKAGE:
        for path in sorted((ROOT / "workers" / package).rglob("*.py")):
            found += [
                f"{path.relative_to(ROOT)}:{line} imports workers.engine (the training package)"
                for line, module in imports(path, depth=2)
                if module == "workers.engine"
            ]
    assert not found, "\n".join(found)


def test_a_wrong_import_is_found(tmp_path, monkeypatch):
    """The check itself: a controller module importing from workers/ and transformers is reported, line by line."""
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "bad.py").write_text(
        "import os\n\ndef f():\n    from workers.engine import FSDPEngine\n    import transformers.models\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert violations("controller") == [
        "controller/bad.py:4 imports workers/, a layer controller/ may not import",
        "controller/bad.py:5 imports transformers, which controller/ must not depend on",
    ]
