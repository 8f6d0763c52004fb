"""docs/config.md is what the code says: it equals ``recipes.config_reference.render()`` (regenerate it with
``python -m recipes.config_reference``), and every key of every recipe's schema is in it with its default."""

import dataclasses

from recipes import config_reference
from recipes.config import load_config
from recipes.schemas import SCHEMAS


def _leaf_keys(obj, prefix: str = "") -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= _leaf_keys(value, key + ".")
        else:
            out[key] = value
    return out


def test_config_reference_is_current():
    assert config_reference.main(["--check"]) == 0, (
        "docs/config.md is stale: run python -m recipes.config_reference"
    )


def test_every_key_of_every_recipe_is_documented_with_its_dataclass_default():
    text = config_reference.OUT.read_text()
    for schema in SCHEMAS.values():
        for key, default in _leaf_keys(schema()).items():
            assert f"| `{key}` | " in text and f"| `{default!r}` |" in text, key
    # a field's own comment is its description, e.g. the warm start's switch
    assert (
        "| `sft.enable` | `bool | None` | `None` | None: warm-start exactly when model.path is None"
        in text.replace("\\|", "|")
    )
    # the recipe's resolved config has no key the reference lacks
    for recipe in ("grpo", "rlm", "hybrid_rl"):
        for key in _leaf_keys(load_config(recipe)):
            assert f"| `{key}` | " in text, (recipe, key)
