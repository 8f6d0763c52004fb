"""The install a user has after `pip install -e .` (what `make demo` does), not CI's: every package that hyflow's
own requirements do not pull in (SGLang and its requirements, megatron-core, wandb, pytest, ...) is made
unimportable in a subprocess and in every process it starts (Ray's workers included), and there

- every public module imports, or fails with an ImportError that names what to install;
- the README's RLM inference snippet answers with the native backend;
- `python -m recipes.grpo` trains a brief run on its own Ray cluster.

How packages are hidden: a ``sitecustomize`` on PYTHONPATH (imported by every Python process at start, Ray's
workers included) wraps the import system's path finder so that it does not find the hidden packages in
site-packages. Copies vendored elsewhere stay visible, as they are in a user's install (Ray's own packages in
``ray/thirdparty_files``). Every process that loads the hider leaves a marker file, so the test can check that the
recipe's workers ran under it too.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme import readme_rlm_snippet

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ["dataproto", "resource_pools", "controller", "algorithms", "workers", "recipes", "benchmarks"]
# what an ImportError of an optional part must say: the extra or the make target that installs it
INSTALL_HINT = re.compile(r"pip install|make sglang-cpu|hyflow\[")

HIDER = '''
import os, site, sys
from importlib.machinery import PathFinder

_HIDDEN = frozenset(os.environ["HYFLOW_HIDDEN_MODULES"].split(","))
_SITE = {os.path.realpath(p) for p in site.getsitepackages()}


class _WithoutOptional(PathFinder):
    """The path finder, blind to the hidden top-level packages where pip put them (site-packages)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or path is not None or name not in _HIDDEN:
            return spec
        # a package's directory, or a module's file: hidden when it lies directly in site-packages
        top = next(iter(spec.submodule_search_locations)) if spec.submodule_search_locations else spec.origin
        return None if os.path.realpath(os.path.dirname(top)) in _SITE else spec


sys.meta_path[:] = [_WithoutOptional if f is PathFinder else f for f in sys.meta_path]
open(os.path.join(os.environ["HYFLOW_HIDER_MARKS"], str(os.getpid())), "w").close()
'''


def _name(requirement: str) -> str:
    return re.split(r"[ ;<>=!\[~(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _core_distributions() -> set[str]:
    """hyflow and everything its requirements pull in (extras only where a requirement asks for them)."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [("hyflow", frozenset())]
    while todo:
        dist, extras = todo.pop()
        if (dist, extras) in seen:
            continue
        seen.add((dist, extras))
        try:
            requirements = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        for r in requirements:
            spec, _, marker = r.partition(";")
            wanted = set(re.findall(r"extra\s*==\s*['\"]([^'\"]+)", marker))
            if wanted and not wanted & extras:
                continue
            asked = {e.strip() for group in re.findall(r"\[([^\]]+)\]", spec) for e in group.split(",")}
            todo.append((_name(spec), frozenset(asked)))
    return {dist for dist, _ in seen}


def hidden_modules() -> list[str]:
    """Top-level modules that only packages outside hyflow's requirements provide (torch counts as core: the
    Makefile installs it first, from its own wheel)."""
    core = _core_distributions() | {"torch"}
    hidden = []
    for module, dists in md.packages_distributions().items():
        names = {d.lower().replace("_", "-") for d in dists}
        if module.isidentifier() and not names & core:
            hidden.append(module)
    return sorted(hidden)


@pytest.fixture(scope="module")
def minimal(tmp_path_factory):
    """``run(argv, cwd, timeout)``: a subprocess in the minimal install; and the marker directory."""
    root = tmp_path_factory.mktemp("minimal_install")
    (root / "hider").mkdir()
    (root / "hider" / "sitecustomize.py").write_text(HIDER)
    marks = root / "marks"
    marks.mkdir()
    hidden = hidden_modules()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTEST"))}
    env |= {
        "PYTHONPATH": os.pathsep.join([str(root / "hider"), str(ROOT)]),
        "HYFLOW_HIDDEN_MODULES": ",".join(hidden),
        "HYFLOW_HIDER_MARKS": str(marks),
        "TOKENIZERS_PARALLELISM": "false",
    }

    def run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    return run, marks, hidden


def test_the_hidden_packages_are_the_optional_ones_and_stay_hidden(minimal, tmp_path):
    run, _, hidden = minimal
    # what CI installs beyond a user's `pip install -e .` (checked where it is installed here)
    for optional in ("sglang", "megatron", "pytest", "wandb"):
        if optional in md.packages_distributions():
            assert optional in hidden, optional
    # psutil is a user's too since LoRA: peft requires accelerate, which requires psutil
    for core in ("torch", "transformers", "ray", "numpy", "omegaconf", "openai", "peft", "psutil"):
        assert core not in hidden, core
    probe = (
        "import importlib.util as u\n"
        f"hidden = {[m for m in ('sglang', 'megatron') if m in hidden]!r}\n"
        "assert all(u.find_spec(m) is None for m in hidden), hidden\n"
        "import peft, psutil  # LoRA's library, and psutil with it\n"
    )
    r = run([sys.executable, "-c", probe], tmp_path, 120)
    assert r.returncode == 0, r.stderr[-3000:]


WALK = """
import json, sys
from pathlib import Path

# Ray puts its vendored packages on sys.path when it is imported; that entry is taken out again, so that a
# module of ours that needs one of them fails here instead of passing only because some module imported before
# it had imported ray. (psutil, vendored there too, is also a user's own since LoRA: peft -> accelerate.)
import ray

sys.path[:] = [p for p in sys.path if not p.endswith("thirdparty_files")]
for m in [m for m in sys.modules if m == "psutil" or m.startswith("psutil.")]:
    del sys.modules[m]

names = []  # found on disk, not by importing packages to walk them
for top in sys.argv[1].split(","):
    for path in sorted(Path(top).rglob("*.py")):
        if all((d / "__init__.py").is_file() for d in path.parents[: len(path.parts) - 1]):
            parts = path.with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
out = {}
for name in names:  # a hidden package fails every import of it, whichever module tried first
    try:
        __import__(name)
        out[name] = None
    except BaseException as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_public_module_imports_or_names_what_to_install(minimal, tmp_path):
    run, _, _ = minimal
    r = run([sys.executable, "-c", WALK, ",".join(PUBLIC)], ROOT, 300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) > 100 and "workers.rlm.inference" in results and "recipes.grpo" in results
    failed = {m: err for m, err in results.items() if err is not None}
    unnamed = {m: err for m, err in failed.items() if not (err.startswith(("ImportError", "ModuleNotFound"))
                                                          and INSTALL_HINT.search(err))}  # fmt: skip
    assert not unnamed, f"modules that fail in a minimal install without saying what to install: {unnamed}"
    # the core of every recipe and of the RLM API imports as it is
    for module in ("recipes.grpo", "recipes.ppo", "recipes.grpo_async", "recipes.rlm", "workers.rlm.inference",
                   "workers.agents.clients", "workers.rollout.sglang.rollout"):  # fmt: skip
        assert results[module] is None, (module, results[module])


def test_readme_rlm_snippet_answers_in_a_minimal_install(minimal, tmp_path):
    """README's RLM inference block, as written, from a directory holding ``runs/rlm`` (its held-out data and an
    exported model: the untrained tiny model stands in for the recipe's export)."""
    from recipes.tasks import make_dataset
    from workers.models.tiny import ensure_tiny_model

    run, _, _ = minimal
    make_dataset("sniah", tmp_path / "runs" / "rlm" / "data", n_train=1, n_val=1, lengths="2000")
    shutil.copytree(ensure_tiny_model("nano"), tmp_path / "runs" / "rlm" / "hf_model")
    code = readme_rlm_snippet() + "\nprint('STATUS', res.status, len(res.root.turns))\n"
    r = run([sys.executable, "-c", code], tmp_path, 300)
    assert r.returncode == 0, r.stderr[-3000:]
    status = re.search(r"STATUS (\w+) (\d+)", r.stdout)
    assert status and status[1] in ("finished", "max_iterations", "budget") and 1 <= int(status[2]) <= 3, (
        r.stdout
    )
    assert (tmp_path / "outputs" / "rlm.jsonl").is_file()


def test_grpo_recipe_trains_in_a_minimal_install(minimal, tmp_path):
    run, marks, _ = minimal
    before = set(os.listdir(marks))
    argv = [sys.executable, "-m", "recipes.grpo", "model.tiny_size=nano", "sft.enable=false", "task.n_train=8", "task.n_val=2",
            "data.train_batch_size=2", "data.val_max_samples=2", "data.max_prompt_length=32",
            "data.max_response_length=8", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=1", "trainer.logger=[console]", "trainer.progress_bar=false",
            "trainer.plot=false", f"trainer.default_local_dir={tmp_path / 'run'}"]  # fmt: skip
    r = run(argv, ROOT, 300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "[grpo] step 1/1" in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    # the driver and the recipe's Ray workers (the actor-rollout process at least) all ran without the packages
    assert len(set(os.listdir(marks)) - before) >= 2
