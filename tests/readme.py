"""The README's code blocks, as tests read them (one place that parses README.md)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_rlm_snippet() -> str:
    """The README's Python block that loads the RLM recipe's exported model."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    found = [b for b in blocks if "hf_model" in b and "RLM(" in b]
    assert len(found) == 1, "README.md: expected one python block loading the RLM recipe's hf_model"
    return found[0]
