"""Recipe configs: YAML + overrides validated against the dataclasses before Ray starts; errors name keys and
numbers; the resolved config is saved with the run and loads back unchanged."""

import dataclasses
import importlib.util

import pytest

from recipes.config import ConfigError, load_config, parse_overrides, save_config
from recipes.schemas import SCHEMAS, GRPOConfig, PPOConfig
from recipes.sections import AlgorithmConfig, data_parallel_sizes, device_counts
from recipes.trainer.run import parse_args, start_run
from recipes.worker_sections import check_actor
from workers.config import ActorConfig, RolloutConfig
from workers.engine.base import OptimConfig
from workers.models.tiny import ensure_tiny_model


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "grpo_async", "quickstart"])
def test_recipe_yaml_loads_into_the_dataclasses(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, PPOConfig if recipe == "ppo" else GRPOConfig)
    assert isinstance(cfg.actor, ActorConfig) and isinstance(cfg.rollout, RolloutConfig)
    assert isinstance(cfg.actor.optim, OptimConfig)
    # interpolations are resolved: the rollout lengths follow data.*
    assert cfg.rollout.response_length == cfg.data.max_response_length
    assert cfg.rollout.prompt_length == cfg.data.max_prompt_length
    assert cfg.algorithm.adv_estimator == ("gae" if recipe == "ppo" else "grpo")
    assert cfg.sft.optim.total_steps == cfg.sft.total_steps  # ${sft.total_steps}
    assert cfg.sft.optim.betas == (0.9, 0.95)
    # every recipe warm-starts the tiny model, whose weights are random; the quickstart always does; a model
    # given by path is trained as it is unless sft.enable=true says otherwise
    assert cfg.sft.runs(cfg)
    model = ensure_tiny_model("nano")  # a model folder given by path
    given = load_config(recipe, [f"model.path={model}"])
    assert given.sft.runs(given) == (recipe == "quickstart")
    forced = load_config(recipe, [f"model.path={model}", "sft.enable=true"])
    assert forced.sft.runs(forced)


def test_overrides_parse_with_types():
    cfg = load_config(
        "grpo",
        [
            "actor.optim.lr=2e-5",
            "rollout.n=8",
            "trainer.logger=[console]",
            "data.val_batch_size=32",
            "data.val_max_samples=null",
            "task.knobs.max_operand=5",
            "algorithm.kl_ctrl.type=adaptive",
            "trainer.experiment_name=abc",
        ],
    )
    assert cfg.actor.optim.lr == pytest.approx(2e-5) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.n == 8
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.val_batch_size == 32 and cfg.data.val_max_samples is None
    assert cfg.task.knobs == {"max_operand": 5}
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.trainer.default_local_dir == "runs/hyflow/abc"  # interpolation sees the override
    # overrides are plain key=value items
    assert dict(parse_overrides(["a.b=1", "c=x"])) == {"a": {"b": 1}, "c": "x"}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["rollout.n"])


def test_unknown_key_names_the_key_and_the_close_match():
    with pytest.raises(ConfigError) as err:
        load_config("grpo", ["actor.ppo_mini_batchsize=4"])
    msg = str(err.value)
    assert "unknown config key 'actor.ppo_mini_batchsize'" in msg
    assert "command-line override" in msg and "ppo_mini_batch_size" in msg
    with pytest.raises(ConfigError, match="unknown config key 'nosuchsection'"):
        load_config("grpo", ["nosuchsection.x=1"])
    with pytest.raises(ConfigError, match="unknown config key 'async_rl'"):  # grpo_async's and rlm's section
        load_config("grpo", ["async_rl.mode=one_step"])


@pytest.mark.parametrize("recipe", ["grpo", "rlm"])
def test_a_yaml_file_holding_a_list_is_a_config_error(tmp_path, recipe):
    """Not omegaconf's ConfigAttributeError / ConfigTypeError from deep inside the merge."""
    path = tmp_path / "list.yaml"
    path.write_text("- a\n")
    with pytest.raises(ConfigError, match="must map section names to sections, not hold a list"):
        load_config(recipe, config_path=str(path))


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_training_step: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config("grpo", config_path=path)
    assert "'trainer.total_training_step'" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("data.train_batch_size=abc", "data.train_batch_size", "abc"),
        ("actor.optim.lr=fast", "actor.optim.lr", "fast"),
        ("trainer.val_before_train=maybe", "trainer.val_before_train", "maybe"),
    ],
)
def test_wrong_type_names_key_and_value(override, key, value):
    with pytest.raises(ConfigError) as err:
        load_config("grpo", [override])
    assert f"'{key}'" in str(err.value) and value in str(err.value)


def test_dataclass_checks_surface_as_config_errors():
    with pytest.raises(
        ConfigError, match="at 'actor.optim': OptimConfig.lr_schedule='cosine' needs total_steps"
    ):
        load_config("grpo", ["actor.optim.lr_schedule=cosine"])
    with pytest.raises(ConfigError, match="at 'critic.optim': OptimConfig.min_lr_ratio must be in"):
        load_config("ppo", ["critic.optim.min_lr_ratio=2"])
    cfg = load_config("grpo", ["actor.optim.lr_schedule=cosine", "actor.optim.total_steps=20"])
    assert cfg.actor.optim.total_steps == 20


def _errors(overrides, recipe="grpo"):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    return str(err.value)


def test_mini_batch_must_divide_the_batch():
    msg = _errors(["data.train_batch_size=16", "actor.ppo_mini_batch_size=5"])
    assert "actor.ppo_mini_batch_size=5 must divide data.train_batch_size=16" in msg
    msg = _errors(["data.train_batch_size=16", "actor.ppo_mini_batch_size=32"])
    assert "actor.ppo_mini_batch_size=32" in msg


def test_rows_must_divide_the_data_parallel_size():
    msg = _errors(["trainer.n_gpus_per_node=3", "data.train_batch_size=16", "rollout.n=4"])
    assert (
        "data.train_batch_size * rollout.n = 16 * 4 = 64 rows is not divisible by the training data-parallel size 3"
        in msg
    )
    assert "data.train_batch_size=16 prompts must be divisible by the rollout data-parallel size 3" in msg
    # two nodes of two devices: dp 4 divides 16 * 4
    cfg = load_config("grpo", ["trainer.n_gpus_per_node=2", "trainer.nnodes=2"])
    assert device_counts(cfg) == {"train": 4, "rollout": 4, "total": 4}


def test_micro_batch_must_divide_rows_per_rank():
    msg = _errors(
        [
            "actor.use_dynamic_bsz=false",
            "actor.ppo_micro_batch_size_per_gpu=3",
            "trainer.n_gpus_per_node=2",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=4",
        ]
    )
    assert "actor.ppo_micro_batch_size_per_gpu=3 must divide the 8 rows each rank gets" in msg
    assert "4 * 4 / 2" in msg


def test_critic_batches_checked_for_ppo_only():
    msg = _errors(["critic.ppo_mini_batch_size=3"], recipe="ppo")
    assert "critic.ppo_mini_batch_size=3 must divide data.train_batch_size=16" in msg
    load_config("grpo", ["critic.ppo_mini_batch_size=3"])  # GRPO has no critic: not checked


def test_placement_needs_a_rollout_split():
    msg = _errors(["trainer.placement=disaggregated", "trainer.n_gpus_per_node=2"])
    assert "trainer.rollout_gpus_per_node" in msg and "got rollout_gpus_per_node=0, n_gpus_per_node=2" in msg
    cfg = load_config(
        "grpo",
        ["trainer.placement=disaggregated", "trainer.n_gpus_per_node=3", "trainer.rollout_gpus_per_node=1"],
    )
    assert device_counts(cfg) == {"train": 2, "rollout": 1, "total": 3}
    assert "trainer.placement must be one of" in _errors(["trainer.placement=split"])


def test_several_problems_are_reported_together():
    msg = _errors(["rollout.n=1", "trainer.logger=[console,mlflow]", "algorithm.kl_ctrl.type=pid"])
    assert "rollout.n must be >= 2, got 1" in msg
    assert "unknown logger(s) ['mlflow']" in msg
    assert "algorithm.kl_ctrl.type must be fixed or adaptive, got 'pid'" in msg


def test_estimator_and_roles_must_agree():
    assert "algorithm.adv_estimator=gae needs a critic; use recipes.ppo" in _errors(
        ["algorithm.adv_estimator=gae"]
    )
    assert "must be gae, got 'grpo'" in _errors(["algorithm.adv_estimator=grpo"], recipe="ppo")
    assert "registered:" in _errors(["algorithm.adv_estimator=nope"])


def test_lengths_and_data_sources():
    msg = _errors(["rollout.response_length=32"])
    assert "rollout.response_length=32 differs from data.max_response_length=64" in msg
    msg = _errors(["task.name=null"])
    assert "no training data: set data.train_files (parquet) or task.name" in msg
    assert "task.name='sudoku' is not a task" in _errors(["task.name=sudoku"])
    assert "task.knobs" in _errors(["task.knobs.bogus=1"])
    assert "task.n_train=8 is smaller than one batch (data.train_batch_size=16)" in _errors(
        ["task.n_train=8"]
    )
    assert "trainer.resume_mode" in _errors(["trainer.resume_mode=/no/such/checkpoint"])
    assert "trainer.resume_fallback=true applies to trainer.resume_mode=auto only, got 'disable'" in _errors(
        ["trainer.resume_fallback=true", "trainer.resume_mode=disable"]
    )
    assert "trainer.resume_fallback" in _errors(["trainer.resume_fallback=maybe"])  # not a bool
    assert "custom_reward_function.path='/no/such.py' is not a file" in _errors(
        ["custom_reward_function.path=/no/such.py"]
    )


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_requested_but_missing():
    assert "trainer.logger includes wandb, but the wandb package is not installed" in _errors(
        ["trainer.logger=[console,wandb]"]
    )


def test_resolved_config_saved_and_reloaded(tmp_path):
    cfg = load_config("quickstart", ["rollout.n=4", "trainer.experiment_name=x", "sft.total_steps=7"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert "${" not in text  # interpolations resolved
    again = load_config("quickstart", config_path=path)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_start_run_saves_config_and_prepares_data(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        "grpo",
        [
            f"trainer.default_local_dir={run_dir}",
            "model.tiny_size=nano",
            "task.n_train=40",
            "task.n_val=8",
            "trainer.resume_mode=disable",
        ],
    )
    run = start_run(cfg, "grpo", start_ray=False)
    assert (run_dir / "config.yaml").is_file() and run.dir == run_dir
    assert dataclasses.asdict(load_config("grpo", config_path=run_dir / "config.yaml")) == dataclasses.asdict(
        cfg
    )
    assert run.train_files == [str(run_dir / "data" / "train.parquet")]
    assert (run_dir / "data" / "val.parquet").is_file() and (run_dir / "data" / "task.json").is_file()
    assert run.tokenizer.pad_token_id is not None


def test_command_line_error_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args("grpo", ["actor.nope=1"])
    assert exc.value.code == 2
    assert "unknown config key 'actor.nope'" in capsys.readouterr().err


def test_switching_task_on_the_command_line_drops_the_files_knobs():
    assert load_config("rlm").task.knobs["sloppy_frac"] == 0.8  # rlm.yaml's S-NIAH knobs
    assert load_config("rlm", ["task.name=oolong"]).task.knobs == {}
    assert load_config("rlm", ["task.name=oolong", "task.knobs.lengths=4000"]).task.knobs == {"lengths": 4000}
    kept = load_config("rlm", ["task.name=sniah", "task.knobs.lengths=4000"]).task.knobs  # the same task
    assert kept["lengths"] == 4000 and kept["n_decoys"] == 1
    with pytest.raises(ConfigError, match="unknown knob"):
        load_config("rlm", ["task.name=oolong", "task.knobs.n_decoys=1"])


def test_rollout_engine_is_checked_before_ray(monkeypatch):
    assert "rollout.name must be 'native' or 'sglang', got 'vllm'" in _errors(["rollout.name=vllm"])
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real_find_spec(n, *a)
    )
    assert "rollout.name=sglang needs the sglang package: `make sglang-cpu`" in _errors(
        ["rollout.name=sglang"]
    )
    # rollout.compile is the native engine's; SGLang compiles by its own server argument
    assert "rollout.compile=true compiles the native engine; rollout.name=sglang does not take it" in _errors(
        ["rollout.name=sglang", "rollout.compile=true"]
    )


def test_rollout_cuda_graphs_reads_auto_true_and_false(tmp_path):
    """``rollout.cuda_graphs``: a word or a bool, from the command line and from YAML (a quoted 'true' too); the
    native engine's ``EngineConfig.cuda_graphs`` is None for auto; anything else is an error naming the key."""
    for value, want, engine in [("true", True, True), ("false", False, False), ("auto", "auto", None)]:
        cfg = load_config("grpo", [f"rollout.cuda_graphs={value}", "trainer.device=cuda"])
        assert cfg.rollout.cuda_graphs == want and type(cfg.rollout.cuda_graphs) is type(want)
        assert cfg.rollout.engine_cuda_graphs is engine
        saved = save_config(cfg, tmp_path / f"{value}.yaml")  # the saved run config loads back the same
        assert load_config("grpo", config_path=saved).rollout.cuda_graphs == want
    assert load_config("grpo").rollout.cuda_graphs == "auto"
    for yaml_value, want in [("true", True), ("false", False), ("'true'", True), ("auto", "auto")]:
        path = tmp_path / "graphs.yaml"
        path.write_text(f"trainer:\n  device: cuda\nrollout:\n  cuda_graphs: {yaml_value}\n")
        got = load_config("grpo", config_path=path, check=False).rollout.cuda_graphs  # a file of two keys
        assert got == want and type(got) is type(want), yaml_value
    assert "rollout.cuda_graphs must be auto, true or false, got 'yes2'" in _errors(
        ["rollout.cuda_graphs=yes2"]
    )
    assert "'rollout.cuda_graphs'" in _errors(["rollout.cuda_graphs=1"])
    with pytest.raises(ValueError, match="cuda_graphs must be auto, true or false"):
        RolloutConfig(cuda_graphs="on_cuda")


TP2 = [
    "trainer.n_gpus_per_node=4",
    "trainer.save_freq=-1",
    "actor.strategy=megatron",
    "actor.megatron.tensor_model_parallel_size=2",
    "rollout.tensor_model_parallel_size=2",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.device=cpu"],
            "rollout.cuda_graphs=true replays decode steps as CUDA graphs, but the run has no",
        ),
        (["trainer.device=auto"], "the run has no GPU (trainer.device=auto, torch sees no CUDA device)"),
        (
            ["trainer.device=cuda", *TP2],
            "rollout.cuda_graphs=true cannot capture a tensor-parallel replica (rollout.tensor_model_parallel_size=2",
        ),
        (
            ["trainer.device=cuda", "model.tiny_arch=moe"],
            "rollout.cuda_graphs=true cannot capture a mixture of experts' decode step",
        ),
        (
            ["trainer.device=cuda", "rollout.name=sglang"],
            "rollout.cuda_graphs=true replays the native engine's decode steps as CUDA graphs; rollout.name=sglang "
            "does not take it (SGLang captures its own CUDA graphs on a GPU unless its disable_cuda_graph server",
        ),
    ],
)
def test_rollout_cuda_graphs_true_is_refused_where_they_cannot_be_had_and_auto_passes(
    monkeypatch, overrides, message
):
    """No GPU (trainer.device=cpu, or auto where torch sees none), a TP>1 rollout replica, a mixture of experts,
    SGLang (its own graphs): ``rollout.cuda_graphs=true`` is a config error before Ray starts; auto is not (the
    engine leaves the graphs off there), nor is false."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_find_spec = (
        importlib.util.find_spec
    )  # SGLang counts as installed: its own error is not the point here
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "sglang" else real_find_spec(n, *a)
    )
    msg = _errors([*overrides, "rollout.cuda_graphs=true"])
    assert message in msg and "use rollout.cuda_graphs=auto or false" in msg
    # trainer.device=cuda counts as a GPU here (the run refuses it where torch sees none: resolve_device)
    assert ("the run has no GPU" in msg) == (overrides[0] != "trainer.device=cuda"), msg
    for value, want in (("auto", "auto"), ("false", False)):
        assert load_config("grpo", [*overrides, f"rollout.cuda_graphs={value}"]).rollout.cuda_graphs == want


def test_rollout_cuda_graphs_true_passes_with_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (
        load_config("grpo", ["rollout.cuda_graphs=true"]).rollout.cuda_graphs is True
    )  # trainer.device=auto
    assert (
        load_config("grpo", ["rollout.cuda_graphs=true", "trainer.device=cuda"]).rollout.cuda_graphs is True
    )


def test_the_recipe_schema_carries_the_recipes_own_rules():
    assert type(load_config("grpo")) is GRPOConfig and type(load_config("ppo")) is PPOConfig
    errors: list[str] = []
    PPOConfig().check_recipe(errors)  # the default estimator (grpo) trains no critic
    GRPOConfig(algorithm=AlgorithmConfig(adv_estimator="gae")).check_recipe(errors)
    assert errors == [
        "recipes.ppo trains a critic: algorithm.adv_estimator must be gae, got 'grpo'",
        "algorithm.adv_estimator=gae needs a critic; use recipes.ppo",
    ]


def test_batches_divide_among_megatron_replicas_not_devices():
    cfg = load_config(
        "grpo",
        [
            "trainer.n_gpus_per_node=4",
            "actor.strategy=megatron",
            "actor.megatron.tensor_model_parallel_size=2",
        ],
    )
    assert data_parallel_sizes(cfg) == (2, 4, 4)  # actor replicas, rollout ranks, critic (unused) devices
    errors: list[str] = []
    cfg.trainer.n_gpus_per_node = 3  # 3 devices hold no whole TP=2 replica: no sizes, one error
    check_actor(errors, cfg)
    assert data_parallel_sizes(cfg).train == 0
    assert errors == [
        "actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size = 2 * 1 = 2 "
        "must divide the 3 device(s) of the actor's worker group"
    ]


def test_every_recipe_schema_is_known_without_registration():
    assert sorted(SCHEMAS) == ["grpo", "grpo_async", "hybrid_rl", "ppo", "quickstart", "rlm"]
    for recipe, schema in SCHEMAS.items():
        assert type(load_config(recipe)) is schema


def test_recipe_rules_stop_the_command_line_before_ray(capsys):
    for recipe, override, message in [
        ("hybrid_rl", "hybrid.w_opd=-1", "hybrid.w_rl and hybrid.w_opd must be >= 0"),
        ("hybrid_rl", "algorithm.adv_estimator=rloo", "must be hybrid (the method) or grpo (the baseline)"),
        ("rlm", "algorithm.adv_estimator=gae", "recipes.rlm has no critic"),
    ]:
        with pytest.raises(SystemExit) as exc:
            parse_args(recipe, [override])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_old_log_prob_source_is_checked():
    assert load_config("grpo", []).algorithm.old_log_prob == "auto"
    assert "algorithm.old_log_prob must be one of ['auto', 'recompute', 'rollout'], got 'cached'" in _errors(
        ["algorithm.old_log_prob=cached"]
    )
    msg = _errors(["algorithm.old_log_prob=rollout", "algorithm.rollout_correction=tis"], recipe="grpo_async")
    assert "algorithm.old_log_prob=rollout makes the rollout engine's log-probs the old ones" in msg
    assert load_config("grpo", ["algorithm.old_log_prob=rollout"]).algorithm.old_log_prob == "rollout"


def test_schema_nodes_of_frozen_dataclasses_take_merged_values():
    """``env.sandbox`` is a frozen dataclass (SandboxConfig): OmegaConf makes its node read-only, and on Python
    3.12 (the GPU image's; found by ``benchmarks/gpu_check.sh --rehearse``) merging rlm.yaml into it failed."""
    from omegaconf import OmegaConf

    from recipes.config import schema_config
    from recipes.schemas import SCHEMAS

    cfg = schema_config(SCHEMAS["rlm"])
    assert not OmegaConf.is_readonly(cfg.env.sandbox)
    merged = OmegaConf.merge(cfg, OmegaConf.create({"env": {"sandbox": {"timeout_s": 3.5}}}))
    assert OmegaConf.to_object(merged).env.sandbox.timeout_s == 3.5


def test_model_compile_with_the_megatron_engine_is_a_config_error_naming_the_role():
    cfg = load_config("grpo", ["model.compile=true"])
    errors: list[str] = []
    check_actor(errors, cfg)
    assert errors == []  # the FSDP engine compiles
    cfg.actor.strategy = cfg.critic.strategy = "megatron"
    check_actor(errors, cfg)
    assert len(errors) == 2
    assert all("model.compile=true compiles the FSDP engine's layers" in e for e in errors)
    assert "actor.strategy='megatron'" in errors[0] and "critic.strategy='megatron'" in errors[1]


def test_model_packed_attention_reaches_the_engine_and_cuda_kernels_need_a_gpu(monkeypatch):
    """``model.packed_attention``: auto/sdpa anywhere, flex and flash only where the run has a GPU (torch has no
    CPU backward for either), an unknown kernel named; the role's EngineConfig carries the choice."""
    import torch

    from workers.roles.common import engine_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kernel in ("auto", "sdpa"):
        cfg = load_config("grpo", [f"model.packed_attention={kernel}"])
        assert engine_config(cfg.model, optim=None).packed_attention == kernel
    for kernel in ("flex", "flash"):
        msg = _errors([f"model.packed_attention={kernel}"])
        assert f"model.packed_attention='{kernel}' trains on CUDA only" in msg and "use auto or sdpa" in msg
        cfg = load_config("grpo", [f"model.packed_attention={kernel}", "trainer.device=cuda"])
        assert engine_config(cfg.model, optim=None).packed_attention == kernel
    assert "model.packed_attention='paged'; choose one of ['auto', 'sdpa', 'flex', 'flash']" in _errors(
        ["model.packed_attention=paged"]
    )
