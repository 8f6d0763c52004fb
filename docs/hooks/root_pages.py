"""MkDocs hook: the repository's own README.md, BENCHMARKS.md and DEVELOPERS.md become the site's home,
benchmarks and developers pages (one text, not a copy kept in docs/), and a path such as `docs/rlm.md` or
`BENCHMARKS.md` written in backticks becomes a link to its page."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "DEVELOPERS.md": "developers.md"}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    for source, page in ROOT_PAGES.items():
        text = (root / source).read_text(encoding="utf-8")
        # README shows docs/images/x.png from the repository root; the page lives inside docs/
        text = text.replace("](docs/", "](")
        files.append(File.generated(config, page, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    """`docs/<page>.md` and the root pages' names, in backticks outside code blocks, link to their pages."""
    pages = {f.src_uri for f in files.documentation_pages()}
    targets = {f"docs/{p}": p for p in pages} | {src: dst for src, dst in ROOT_PAGES.items() if dst in pages}
    here = page.file.src_uri.count("/")

    def link(match: re.Match) -> str:
        name = match.group(1)
        if name not in targets:
            return match.group(0)
        return f"[`{name}`]({'../' * here}{targets[name]})"

    def outside_fences(text: str) -> str:
        return re.sub(r"`([\w./-]+\.md)`", link, text)

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out += [outside_fences(markdown[last : fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join([*out, outside_fences(markdown[last:])])
