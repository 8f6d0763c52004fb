"""docs/config.md is what the code says: it equals ``recipes.config_reference.render()`` (regenerate it with
``python -m recipes.config_reference``), and every key of every recipe's schema is in it with its default."""

import dataclasses

from recipes import config_reference
from recipes.config import load_config
from recipes.schemas import SCHEMAS


def _leaf_keys(obj, prefix: str = "") -> dict[str, object]:
    """Every key of the config ``obj``; a dict of sections (``env.envs``) counts as a key and so does each key of
    its entries (``env.envs.rlm.agent.max_depth``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= _leaf_keys(value, key + ".")
        else:
            out[key] = value
            if isinstance(value, dict) and all(dataclasses.is_dataclass(v) for v in value.values()):
                for name, entry in value.items():
                    out |= _leaf_keys(entry, f"{key}.{name}.")
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
    # a field's own comment is its description, e.g. the warm start's switch; a type with a pipe is HTML code
    # (a backslash before the pipe would show in MkDocs' code span), a class type is its name
    assert (
        "| `sft.enable` | <code>bool &#124; None</code> | `None` | None: warm-start exactly when model.path is None"
        in text
    )
    assert "| `env.sandbox.timeout_s` | `float` | `30.0` |" in text
    assert "<class '" not in text and "\\|" not in "".join(text.split("`")[1::2])  # no backslash in code
    assert "&lt;/python>" in text  # a tag-like word in a description is shown, not read as HTML


def test_every_key_of_every_yaml_beside_the_recipes_is_documented():
    """Every recipes/*.yaml as its recipe reads it, among them the mixed environments of rlm_mixed.yaml
    (``env.envs.<name>.*``, ``env.default``) and the word-count example's env."""
    text = config_reference.OUT.read_text()
    yamls = {path.name: recipe for recipe, path in config_reference.recipe_yamls()}
    assert yamls["rlm_mixed.yaml"] == "rlm" and yamls["hybrid_rl_grpo.yaml"] == "hybrid_rl"
    assert len(yamls) == len(list((config_reference.OUT.parents[1] / "recipes").glob("*.yaml")))
    entries = []
    for recipe, path in config_reference.recipe_yamls():
        keys = _leaf_keys(load_config(recipe, config_path=path, check=False))
        missing = [key for key in keys if f"| `{key}` | " not in text]
        assert not missing, (path.name, missing)
        entries += [k for k in keys if k.startswith("env.envs.")]
    assert {k.split(".")[2] for k in entries} == {"rlm", "tool_math", "word_count"} and len(entries) > 100
    assert "| `env.envs.tool_math.sandbox.echo_last_expr` | `bool` | `True` |" in text
    assert "| `env.default` | `str` | `''` | the environment of rows without an env_name" in text
