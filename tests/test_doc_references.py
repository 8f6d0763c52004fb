"""Every test the documentation cites exists: ``path.py::test_name`` in README.md, BENCHMARKS.md and docs/*.md,
and a bare ``::test_name`` continuing the last path cited before it in the same file, names a function (or a
class) defined in that file; a cited path of the repository's own folders (``tests/x/test_y.py``,
``workers/plugins.py``) is a file; a test named alone (`` `test_name` ``, its file in the prose around it) is
defined in some file under tests/ (or is one's module name). A claim that cites a renamed or deleted test fails here instead of pointing
nowhere."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path ending in .py, maybe followed by ::name; or ::name alone (continuing the last path); [params] ignored
REFERENCE = re.compile(r"(?P<path>[\w./-]+\.py)(?:::(?P<name>\w+))?|::(?P<bare>[A-Za-z_]\w*)")
# a test named alone in backticks, [params] ignored
LONE_TEST = re.compile(r"`(?P<name>test_\w+)(?:\[[^\]`]*\])?`")
# the repository's own top-level folders: a cited path under one of them must exist (others are examples such
# as path/to/my_env.py)
OWN_FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


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
                elif last.split("/")[0] in OWN_FOLDERS and "/" in last:
                    yield number, last, None  # the file alone: it must exist
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
        (3, "tests/c.py", None),  # the file alone: checked to exist
        (3, "tests/c.py", "test_four"),
    ]


def test_a_cited_file_or_lone_test_name_that_does_not_exist_is_reported(tmp_path):
    """The two holes a deliberate break found: a test file cited without ::name, and a test named alone with its
    file only in the prose, were accepted whether or not they existed."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "see `tests/recipes/test_no_such_file.py`; `test_no_such_test_anywhere` "
        "(`tests/test_doc_references.py`), and `test_every_cited_test_exists[README.md]`"
    )
    with pytest.raises(AssertionError) as err:
        test_every_cited_test_exists(doc)
    assert "tests/recipes/test_no_such_file.py is not a file" in str(err.value)
    assert "test_no_such_test_anywhere is defined in no file under tests/" in str(err.value)
    assert "test_every_cited_test_exists is" not in str(err.value)


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
        elif name is not None and name not in names:
            missing.append(f"{where}: {path} defines no {name}")
    defined = all_test_names()
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for m in LONE_TEST.finditer(line):
            if m.group("name") not in defined and not m.group("name").endswith("_"):
                missing.append(f"{doc.name}:{number}: {m.group('name')} is defined in no file under tests/")
    assert not missing, "\n".join(missing)


def all_test_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names |= defined_names(path) | {path.stem}  # a test module named alone counts too
    return names
