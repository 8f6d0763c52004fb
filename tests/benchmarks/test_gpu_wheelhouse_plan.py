"""The GPU check's setup plan, checked without the GPU or the wheelhouse: every module-level third-party import of
hyflow's packages is either in the GPU image (the packages ``benchmarks/gpu_check.sh --rehearse`` installs as the
image's) or carried in ``.gpu_wheels`` (what ``--wheelhouse`` fetches). The first rehearsal failed on exactly this
(``workers/agents/clients.py`` imported ``openai`` at module level, and the image has none); the full check of the
versions is ``bash benchmarks/gpu_check.sh --rehearse`` (a 4 GB venv, not for CI)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dataproto", "resource_pools", "controller", "algorithms", "workers", "recipes", "benchmarks")
# import name -> distribution name, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "megatron": "megatron-core", "google": "protobuf", "attr": "attrs"}
# imported at module level only by files that the GPU check never imports: CPU shims, TRL baselines, and the
# OpenAI-compatible endpoint (workers/agents/gateway.py; loaded by name only for env.loop=openai_agent or recipes.serve)
NOT_ON_THE_GPU_PATH = {"hyflow_cpu_shim", "trl", "paths", "fastapi", "starlette"}


def planned_distributions() -> set[str]:
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    image = re.search(r"IMAGE_PKGS=\((.*?)\)", script, re.S)
    fetched = re.findall(r"^\s*fetch (.+?) \|\|", script, re.M)
    assert image and fetched, "gpu_check.sh no longer lists IMAGE_PKGS and its fetch line"
    names = image.group(1).split() + " ".join(fetched).split() + re.findall(r"^RAY=(\S+)", script, re.M)
    return {re.split(r"[=<>!\[]", n)[0].lower().replace("_", "-") for n in names}


def module_level_imports(path: Path) -> set[str]:
    """Top-level names imported at module level (imports inside functions run only when used)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_module_level_import_is_in_the_image_or_the_wheelhouse():
    planned = planned_distributions()
    assert {"torch", "transformers", "ray", "omegaconf", "megatron-core"} <= planned
    missing = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name in module_level_imports(path):
                if name in sys.stdlib_module_names or name in PACKAGES or name in NOT_ON_THE_GPU_PATH:
                    continue
                if DISTRIBUTION.get(name, name).lower().replace("_", "-") not in planned:
                    missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported at module level but neither in the GPU image nor in .gpu_wheels: {missing}"


def test_the_plan_catches_a_module_level_import_it_does_not_carry(tmp_path):
    """The check itself: the import that broke the first rehearsal is flagged."""
    bad = tmp_path / "clients.py"
    bad.write_text("import openai\n\ndef lazy():\n    import anthropic\n")
    assert module_level_imports(bad) == {"openai"}
    assert "openai" not in planned_distributions()
