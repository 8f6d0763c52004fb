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


def module_imports(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Project module -> the project modules its top-level statements import, ``if TYPE_CHECKING:`` blocks included
    (what a reader and the type checker see); ``from package import submodule`` counts as the submodule."""
    modules = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        statements, found = list(ast.parse(path.read_text(encoding="utf-8")).body), set()
        while statements:
            node = statements.pop()
            if isinstance(node, (ast.If, ast.Try)):
                statements += node.body + getattr(node, "orelse", [])
            elif isinstance(node, ast.Import):
                found |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(owner(sub) if sub in modules else owner(node.module))
        graph[name] = {m for m in found if m and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_two_modules_import_each_other():
    """Not even for type annotations: a cycle is two modules that must change together (split the shared part out,
    or write what one needs of the other as a Protocol, as ``workers/sandbox/repl.py`` does)."""
    cycles = import_cycles(module_imports(tuple(MAY_IMPORT)))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_an_import_cycle_is_found(tmp_path, monkeypatch):
    """The check itself: a cycle through a TYPE_CHECKING import and a package's submodule is reported."""
    (tmp_path / "recipes" / "pkg").mkdir(parents=True)
    (tmp_path / "recipes" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "recipes" / "a.py").write_text("from recipes.pkg import b\n")
    (tmp_path / "recipes" / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recipes.a import X\n"
    )
    (tmp_path / "recipes" / "c.py").write_text("import recipes.a\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert import_cycles(module_imports(("recipes",))) == [["recipes.a", "recipes.pkg.b"]]


def test_mypy_checks_every_package():
    """`make typecheck` reads `[tool.mypy] packages`: a package left out of it is not type checked at all."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    assert sorted(config["packages"]) == sorted(MAY_IMPORT)
