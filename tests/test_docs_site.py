"""The documentation site (`make docs`: mkdocs.yml, docs/, docs/hooks/root_pages.py) builds in strict mode with every
page of its navigation, the home page is the README itself with its `docs/*.md` paths turned into links, the API
reference is generated from the code's docstrings, and headless Chromium renders the pages' text."""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.browser import chromium, chromium_args
from tests.skips import skip_or_fail

ROOT = Path(__file__).resolve().parents[1]


def nav_pages(entries) -> list[str]:
    out = []
    for entry in entries:
        for value in entry.values():
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def page(site: Path, name: str) -> str:
    path = site / "index.html" if name == "index.md" else site / name.removesuffix(".md") / "index.html"
    return path.read_text(encoding="utf-8")


def test_every_page_in_the_navigation_is_built(site):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = nav_pages(config["nav"])
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert on_disk <= set(pages), f"docs/ pages missing from mkdocs.yml's nav: {sorted(on_disk - set(pages))}"
    for name in pages:
        assert "<h1" in page(site, name), name


def test_home_is_the_readme_with_links_to_the_guides(site):
    home = page(site, "index.md")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in home and readme.split("\n")[2][:40] in html.unescape(home)
    assert re.search(r'<a href="recipes/"><code>docs/recipes.md</code></a>', home)
    assert re.search(r'<a href="benchmarks/"><code>BENCHMARKS.md</code></a>', home)


def test_api_reference_comes_from_the_docstrings(site):
    api = page(site, "api.md")
    for anchor in (
        "workers.rlm.inference.RLM.completion",
        "workers.rlm.agent.AgentConfig",
        "dataproto.proto.DataProto.concat",
        "controller.worker_group.RayWorkerGroup",
        "resource_pools.pool.ResourcePool",
        "workers.rollout.base.RolloutEngine",
        "workers.agents.loop.AgentLoop",
    ):
        assert f'id="{anchor}"' in api, anchor
    from workers.rlm.inference import RLM

    text = html.unescape(re.sub(r"<[^>]+>", "", api))
    assert RLM.__doc__.strip().split("\n")[0] in text  # "A Recursive Language Model for inference. ..."


def test_config_reference_shows_types_and_placeholders_as_written(site):
    """docs/config.md's table cells as the site shows them: a type with a pipe has no backslash before it
    (``bool | None``; a backslash-escaped pipe inside a code span shows the backslash), and a placeholder in a
    description (``<python>``, ``<dir>``) is text, not an HTML tag that vanishes."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", page(site, "config.md")))
    assert "bool | None" in text and "\\|" not in text
    assert "<python>code</python>" in text and "<dir>/env_rank<r>.jsonl" in text


def test_paths_in_code_blocks_stay_text():
    spec = importlib.util.spec_from_file_location("root_pages", ROOT / "docs" / "hooks" / "root_pages.py")
    if importlib.util.find_spec("mkdocs") is None:
        skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    files = SimpleNamespace(
        documentation_pages=lambda: [SimpleNamespace(src_uri=p) for p in ("rlm.md", "index.md")]
    )
    text = "see `docs/rlm.md` and `docs/missing.md`\n```\n`docs/rlm.md`\n```\n"
    out = hooks.on_page_markdown(text, SimpleNamespace(file=SimpleNamespace(src_uri="index.md")), {}, files)
    assert out == "see [`docs/rlm.md`](rlm.md) and `docs/missing.md`\n```\n`docs/rlm.md`\n```\n"
    nested = hooks.on_page_markdown(
        "`docs/rlm.md`", SimpleNamespace(file=SimpleNamespace(src_uri="a/b.md")), {}, files
    )
    assert nested == "[`docs/rlm.md`](../rlm.md)"


def test_headless_chromium_renders_the_quickstart_config_api_and_concepts(site, tmp_path):
    if chromium() is None:
        skip_or_fail("headless Chromium is not installed (apt-get install chromium)")
    for name, expected in (
        ("index.md", ["make demo", "validation accuracy", "Recursive Language Models"]),  # the quickstart
        ("config.md", ["ppo_mini_batch_size", "trainer.placement"]),  # the generated config reference
        ("api.md", ["completion", "DataProto"]),
        ("concepts.md", ["DP_COMPUTE_PROTO", "ResourcePool"]),
    ):
        target = site / "index.html" if name == "index.md" else site / name.removesuffix(".md") / "index.html"
        dom = subprocess.run(
            [*chromium_args(tmp_path), "--dump-dom", target.as_uri()],
            capture_output=True,
            text=True,
            timeout=90,
            check=True,
        ).stdout
        text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
        for phrase in expected:
            assert phrase in text, (name, phrase)
