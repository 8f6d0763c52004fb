"""Every test the documentation cites exists: ``path.py::test_name`` in README.md, BENCHMARKS.md and docs/*.md,
and a bare ``::test_name`` continuing the last path cited before it in the same file, names a function (or a
class) defined in that file. A claim that cites a renamed or deleted test fails here instead of pointing nowhere."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path ending in .py, maybe followed by ::name; or ::name alone (continuing the last path); [params] ignored
REFERENCE = re.compile(r"(?P<path>[\w./-]+\.py)(?:::(?P<name>\w+))?|::(?P<bare>[A-Za-z_]\w*)")


def resolve(path: str) -> Path | None:
    """The cited file: as written from the repository root, or the one file under tests/ with that name."""
    direct = ROOT / path
    if direct.is_file():
        return direct
    matches = [p for p in (ROOT / "tests").rglob(Path(path).name) if str(p).endswith(path)]
    return matches[0] if len(matches) == 1 else None


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(tree) if isinstance(node, kinds)}


def references(doc: Path):
    """``(line number, cited path, name)`` for every citation of ``doc``, continuations resolved."""
    last: str | None = None
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for m in REFERENCE.finditer(line):
            if m.group("path"):
                last = m.group("path")
                if m.group("name"):
                    yield number, last, m.group("name")
                continue
            name = m.group("bare")
            if name.endswith("_") or (m.start() > 0 and line[m.start() - 1] not in "`( ,;"):
                continue  # a placeholder (`::test_...`) or ::name glued to a word (C++ in prose)
            yield number, last, name


def test_the_reference_pattern_reads_paths_and_continuations(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "see `tests/a/test_x.py::test_one` and (`::test_two`),\n`::test_three`; `b.py::f`\n"
        "`tests/c.py` (`::test_four`); a legend: `tests/...::test_...`"
    )
    assert list(references(doc)) == [
        (1, "tests/a/test_x.py", "test_one"),
        (1, "tests/a/test_x.py", "test_two"),
        (2, "tests/a/test_x.py", "test_three"),
        (2, "b.py", "f"),
        (3, "tests/c.py", "test_four"),
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_test_exists(doc):
    missing, seen = [], {}
    for number, path, name in references(doc):
        where = f"{doc.name}:{number}"
        if path is None:
            missing.append(f"{where}: ::{name} continues no path")
            continue
        if path not in seen:
            found = resolve(path)
            seen[path] = (found, defined_names(found) if found else set())
        found, names = seen[path]
        if found is None:
            missing.append(f"{where}: {path} is not a file (nor one file of that name under tests/)")
        elif name not in names:
            missing.append(f"{where}: {path} defines no {name}")
    assert not missing, "\n".join(missing)
