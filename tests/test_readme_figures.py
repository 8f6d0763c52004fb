"""README's quickstart result is the last full run's, not a figure typed in once: the block that shows what
`make demo` prints must equal benchmarks/results/quickstart.json (written from the run's own
``runs/quickstart/result.json``), and name that file's commit. A change to the numerics that changes the result
shows up in review as a changed JSON, README and commit, instead of in a user's terminal."""

import json
import re
from pathlib import Path

from tests.readme import README

RESULT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "quickstart.json"


def test_readme_quickstart_figures_are_the_recorded_run():
    recorded = json.loads(RESULT.read_text())
    result = recorded["result"]
    text = README.read_text(encoding="utf-8")
    shown = re.search(
        r"validation accuracy (\d\.\d\d) -> (\d\.\d\d)\s+\(greedy, (\d+) held-out problems", text
    )
    wall = re.search(r"^wall time:\s+(\d+)s", text, re.MULTILINE)
    assert shown and wall, "README.md: the quickstart's printed result block is missing"
    assert (float(shown[1]), float(shown[2])) == (
        round(result["val_before"], 2),
        round(result["val_after"], 2),
    )
    assert int(shown[3]) == recorded["val_samples"]
    assert int(wall[1]) == round(result["wall_s"])
    assert re.fullmatch(r"[0-9a-f]{7,40}", recorded["commit"]) and recorded["commit"][:7] in text
    assert recorded["command"] in text
