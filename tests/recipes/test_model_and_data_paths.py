"""``model.path`` and ``data.*_files`` as a newcomer writes them, checked by the recipe's command line before Ray
starts: a Hugging Face Hub id resolves through the Hub's cache (here a cache built in a temporary folder, offline:
this machine cannot reach the Hub), a missing one says how to fetch it; a folder that is not a model names what
a model folder holds; one parquet path needs no brackets; a parquet without the prompt column names the file,
the column and the layout the recipes read."""

import os
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes.config import ConfigError, load_config
from recipes.trainer.run import parse_args, resolve_model, start_run
from workers.models import load_tokenizer
from workers.models.tiny import default_tiny_dir, ensure_tiny_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face Hub cache (``HF_HUB_CACHE``) and ``HF_HUB_OFFLINE=1``."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _cache_model(cache, repo_id: str):
    """The tiny model as the Hub's cache holds a download of ``repo_id``: ``models--org--name/snapshots/<rev>/``
    and ``refs/main`` naming that revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(ensure_tiny_model("nano"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def _cli_error(capsys, overrides: list[str], recipe: str = "grpo") -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(recipe, [*overrides, "--print-config"])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_hub_id_resolves_through_the_hub_cache_offline(offline_hub, capsys):
    snapshot = _cache_model(offline_hub, "hyflow-test/tiny-nano")
    cfg = parse_args("grpo", ["model.path=hyflow-test/tiny-nano"])  # checked: the cached snapshot is a model
    assert cfg.model.path == "hyflow-test/tiny-nano"  # the run's config.yaml keeps the id
    assert resolve_model(cfg) == str(snapshot)
    assert load_tokenizer(resolve_model(cfg)).pad_token_id is not None
    # an id the cache lacks, offline: how to fetch it or where to point instead, before Ray starts
    err = _cli_error(capsys, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert "model.path='Qwen/Qwen2.5-0.5B-Instruct' is not a local folder" in err
    assert f"not in the Hugging Face Hub cache ({offline_hub})" in err
    assert "HF_HUB_OFFLINE" in err
    assert "fetch it with `hf download Qwen/Qwen2.5-0.5B-Instruct`" in err
    assert "or set model.path to a local model folder" in err
    # a run whose config was not checked (the model may have left the cache since): refused before anything
    # is written, not by the tokenizer's traceback
    run_dir = offline_hub.parent / "run"
    cfg = load_config(
        "grpo", ["model.path=Qwen/Qwen2.5-0.5B-Instruct", f"trainer.default_local_dir={run_dir}"], check=False
    )
    with pytest.raises(ConfigError, match="fetch it with `hf download Qwen/Qwen2.5-0.5B-Instruct`"):
        start_run(cfg, "grpo", start_ray=False)
    assert not run_dir.exists()
    # the same for the critic's own model
    err = _cli_error(capsys, ["critic.model_path=Qwen/Qwen2.5-0.5B-Instruct"], recipe="ppo")
    assert "critic.model_path='Qwen/Qwen2.5-0.5B-Instruct' is not a local folder" in err
    # a path that can be no Hub id is still a missing path
    assert "model.path='/nonexistent/model' does not exist" in _cli_error(
        capsys, ["model.path=/nonexistent/model"]
    )


def test_a_folder_that_is_not_a_model_is_named_before_ray(tmp_path, capsys):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    err = _cli_error(capsys, [f"model.path={folder}"])
    assert f"model.path='{folder}' is not a model folder: it has no config.json and no tokenizer files" in err
    assert "a model folder (a Hugging Face checkpoint) holds config.json" in err
    assert "tokenizer.json or tokenizer_config.json" in err
    # config.json but no tokenizer: the tokenizer files are named, not a sentencepiece/tiktoken traceback
    shutil.copy(ensure_tiny_model("nano") + "/config.json", folder)
    err = _cli_error(capsys, [f"model.path={folder}"])
    assert f"model.path='{folder}' is not a model folder: it has no tokenizer files" in err
    assert "config.json" not in err.split("holds")[0].split("it has no")[1]
    # a tiktoken vocabulary is a tokenizer file too
    (folder / "qwen.tiktoken").write_text("")
    assert parse_args("grpo", [f"model.path={folder}"]).model.path == str(folder)
    # a file is not a folder
    err = _cli_error(capsys, [f"model.path={folder / 'notes.txt'}"])
    assert f"model.path='{folder / 'notes.txt'}' is a file, not a model folder" in err


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def _rows(n: int = 4) -> dict:
    return {
        "data_source": ["hyflow/arithmetic"] * n,
        "prompt": [[{"role": "user", "content": f"{k} + 1 = ?"}] for k in range(n)],
        "reward_model": [{"ground_truth": str(k + 1)} for k in range(n)],
    }


def test_one_data_file_needs_no_brackets(tmp_path):
    train, val = (
        _parquet(tmp_path / "train.parquet", **_rows()),
        _parquet(tmp_path / "val.parquet", **_rows()),
    )
    cfg = load_config("grpo", [f"data.train_files={train}", f"data.val_files={val}"])
    assert cfg.data.train_files == [train] and cfg.data.val_files == [val]
    # the same in a YAML file, and any list of strings (trainer.logger=console)
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        f"data:\n  train_files: {train}\n  val_files: {val}\ntrainer:\n  logger: console\nrollout:\n  n: 2\n"
    )
    cfg = load_config("grpo", [], config_path=yaml)
    assert (
        cfg.data.train_files == [train] and cfg.data.val_files == [val] and cfg.trainer.logger == ["console"]
    )
    # brackets still work, and a list of numbers still refuses a string
    assert load_config("grpo", [f"data.train_files=[{train},{val}]"]).data.train_files == [train, val]
    with pytest.raises(ConfigError, match="actor.optim.betas"):
        load_config("grpo", ["actor.optim.betas=high"])


def test_a_parquet_without_the_prompt_column_is_named_before_ray(tmp_path, capsys):
    rows = _rows()
    rows["question"] = rows.pop("prompt")
    bad = _parquet(tmp_path / "mine.parquet", **rows)
    good = _parquet(tmp_path / "val.parquet", **_rows())
    err = _cli_error(capsys, [f"data.train_files=[{bad}]", f"data.val_files=[{good}]"])
    assert f"data.train_files: {bad} has no column 'prompt' (data.prompt_key)" in err
    assert "its columns: ['data_source', 'question', 'reward_model']" in err
    assert "prompt: the chat messages" in err and "reward_model: {'ground_truth': ...}" in err
    # the key that names another column, and the other required columns
    cfg = load_config(
        "grpo", [f"data.train_files=[{bad}]", f"data.val_files=[{bad}]", "data.prompt_key=question"]
    )
    assert cfg.data.prompt_key == "question"
    del rows["data_source"]
    no_source = _parquet(tmp_path / "no_source.parquet", **rows)
    err = _cli_error(capsys, [f"data.train_files=[{good}]", f"data.val_files=[{no_source}]"])
    assert f"data.val_files: {no_source} has no column 'prompt' (data.prompt_key), 'data_source'" in err
    (tmp_path / "x.parquet").write_text("not parquet")
    err = _cli_error(capsys, [f"data.train_files=[{tmp_path / 'x.parquet'}]", f"data.val_files=[{good}]"])
    assert f"data.train_files: {tmp_path / 'x.parquet'} is not a parquet file" in err


def test_the_final_line_names_what_was_measured_for_the_environment(tmp_path, monkeypatch):
    """``python -m recipes.rlm`` ends with ``<what> before -> after``: the RLM's success rate, or that of the
    environment the config file picks (``env.loop``), not "RLM success rate" for every one. The run itself is
    stubbed (the recipe's own steps are tested in test_rlm_recipe.py and the environments' tests): what is
    checked is the name ``main`` gives the final line for each shipped config."""
    import recipes.rlm as rlm

    said: list[str] = []
    run = SimpleNamespace(dir=tmp_path, model_path="m", train_files=["t"])
    monkeypatch.setattr(rlm, "start_run", lambda cfg, recipe: run)
    monkeypatch.setattr(rlm, "warm_start", lambda cfg, run, data: "m")
    monkeypatch.setattr(rlm, "train", lambda cfg, run: {})
    monkeypatch.setattr(rlm, "report_result", lambda result, t0, what, run_dir: said.append(what) or {})
    files = [f"data.{k}_files=[{_parquet(tmp_path / f'{k}.parquet', **_rows())}]" for k in ("train", "val")]
    for name, more in [
        ("rlm.yaml", []),  # the task's data, generated at the start
        ("rlm_tool_calls.yaml", files),
        ("rlm_word_count.yaml", files),
        ("rlm_mixed.yaml", [*files, "env.default=rlm"]),  # the rows name no env_name
    ]:
        rlm.main(["--config", f"recipes/{name}", *more])
    assert said == [
        "RLM success rate",
        "math-tool success rate",
        "word-count success rate",
        "success rate over the environments rlm, tool_math, word_count",
    ]


def test_where_things_are_written(tmp_path, monkeypatch):
    """README's "Where things are written": the tiny model in ``$HYFLOW_CACHE`` (default ``~/.cache/hyflow``),
    built there on first use; each run in its recipe's ``trainer.default_local_dir``."""
    monkeypatch.delenv("HYFLOW_CACHE", raising=False)
    assert default_tiny_dir("tiny") == os.path.expanduser("~/.cache/hyflow/tiny-tiny-v2-seed0")
    monkeypatch.setenv("HYFLOW_CACHE", str(tmp_path / "cache"))
    built = resolve_model(load_config("grpo", ["model.tiny_size=nano"]))  # model.path null: the tiny model
    assert built == str(tmp_path / "cache" / "tiny-nano-v2-seed0")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(built))
    assert load_config("quickstart").trainer.default_local_dir == "runs/quickstart"
    assert load_config("rlm").trainer.default_local_dir == "runs/rlm"
    assert load_config("grpo").trainer.default_local_dir == "runs/hyflow/grpo"  # runs/<project>/<experiment>
    assert (
        load_config("ppo", ["trainer.experiment_name=mine"]).trainer.default_local_dir == "runs/hyflow/mine"
    )
