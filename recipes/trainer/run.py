"""A run: its directory, resolved config, model path, dataset files and tokenizer; command-line entry.

    def main(argv=None):
        cfg = parse_args("grpo", argv)          # YAML beside the recipe + key.sub=value overrides, validated
        run = start_run(cfg, "grpo")             # run dir, config.yaml, tiny model / task data, Ray
        return train(cfg, run)

Run directory (``trainer.default_local_dir``)::

    config.yaml       the resolved config of the run (re-written on every start; the previous one of a resumed
                      run is kept as config.prev.yaml)
    data/             generated task data (task.name) with task.json, the generator settings
    metrics.jsonl     one line of metrics per step ({"step": k, ...})
    tensorboard/      TensorBoard event files
    checkpoints/      actor/step_N, critic/step_N (torch.distributed.checkpoint) and latest_step
    curves.png        reward and validation accuracy over the steps
    hf_model/         the trained policy as a Hugging Face directory (trainer.export_hf)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import ray

from recipes.config import ConfigError, load_config, save_config, to_yaml
from recipes.sections import RecipeConfig, device_counts, uses_gpu
from recipes.tasks import make_dataset
from recipes.trainer.run_folder import prepare_run_folder
from recipes.trainer.sizing import resolve_token_budget
from workers.config import ModelConfig
from workers.engine.checkpoint import CheckpointError
from workers.models import load_tokenizer
from workers.models.hub import ModelPathError, resolve_model_path
from workers.models.tiny import ensure_tiny_model

logger = logging.getLogger("recipes")


class RunAborted(RuntimeError):
    """The run cannot usefully go on (every sample's reward failed, updates non-finite step after step)."""


@dataclass
class Run:
    recipe: str
    dir: Path
    model_path: str
    train_files: list[str]
    val_files: list[str]
    tokenizer: object
    use_gpu: bool

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"


def parse_args(recipe: str, argv: list[str] | None = None) -> RecipeConfig:
    """``[--config FILE] key.sub=value ...`` -> the validated config (exits with the message on an error)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m recipes.{recipe}",
        description=f"hyflow {recipe} recipe. Overrides: key.sub=value (see recipes/{recipe}.yaml).",
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: recipes/{recipe}.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(recipe, args.overrides, config_path=args.config)
    except ConfigError as err:
        parser.exit(2, f"config error: {err}\n")
    if args.print_config:
        print(to_yaml(cfg))
        sys.exit(0)
    return cfg


def cli(main) -> None:
    """Run a recipe's ``main()`` as a command: Ctrl-C exits with status 130 after the recipe's own message
    (no traceback); the last complete checkpoint is what ``trainer.resume_mode=auto`` continues from. A
    ConfigError (e.g. more devices than this machine has), RunAborted or CheckpointError exits with status 1
    and its message."""
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except ConfigError as err:  # found after the config pass (capacity of this machine): the message only
        sys.exit(f"config error: {err}")
    except RunAborted as err:  # every sample's reward failed, updates non-finite step after step
        sys.exit(f"run aborted: {err}")
    except CheckpointError as err:  # a full disk, a damaged checkpoint: the worker's reason names the file
        sys.exit(f"checkpoint error: {err}")


def resolve_device(cfg: RecipeConfig) -> bool:
    """True when the workers use GPUs (trainer.device: auto picks CUDA when torch sees one; `uses_gpu`)."""
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda, but torch sees no CUDA device")
    return uses_gpu(cfg)


def resolve_model(cfg: RecipeConfig) -> str:
    """model.path as a local folder (a Hugging Face Hub id: its snapshot in the Hub's cache, downloaded there once),
    or the cached tiny model (built on first use) when it is null."""
    if cfg.model.path is not None:
        try:
            return resolve_model_path(cfg.model.path, "model.path")
        except ModelPathError as err:
            raise ConfigError(str(err)) from None
    return ensure_tiny_model(
        cfg.model.tiny_size,
        seed=cfg.model.tiny_seed,
        chat_template=cfg.model.tiny_chat_template,
        arch=cfg.model.tiny_arch,
    )


def resolve_data(cfg: RecipeConfig, run_dir: Path) -> tuple[list[str], list[str]]:
    """data.train_files / val_files, or the task dataset generated into ``run_dir/data`` (once per settings)."""
    if cfg.data.train_files:
        val = list(cfg.data.val_files)
        return list(cfg.data.train_files), val
    t = cfg.task
    assert t.name is not None  # validate: no data.train_files needs a task.name (DataConfig.check)
    out = run_dir / "data"
    want = {"name": t.name, "n_train": t.n_train, "n_val": t.n_val, "seed": t.seed, "knobs": dict(t.knobs)}
    marker = out / "task.json"
    paths = {"train": str(out / "train.parquet"), "val": str(out / "val.parquet")}
    have = json.loads(marker.read_text()) if marker.is_file() else None
    if have != want or not all(os.path.isfile(p) for p in paths.values()):
        paths = make_dataset(t.name, out, n_train=t.n_train, n_val=t.n_val, seed=t.seed, **t.knobs)
        marker.write_text(json.dumps(want, indent=1) + "\n")
    val = list(cfg.data.val_files) or [paths["val"]]
    return [paths["train"]], val


def job_env_vars(wanted: dict[str, str], environ) -> dict[str, str]:
    """The env vars the driver adds to its workers on an existing cluster: those the environment does not set
    already. Under ``ray job submit`` the job's runtime env is in the driver's environment, and Ray refuses to
    merge a driver's value into a job's for the same variable (even an equal one), so the job's value wins."""
    return {k: v for k, v in wanted.items() if k not in environ}


def check_local_capacity(cfg: RecipeConfig, use_gpu: bool, cores: int | None = None) -> None:
    """Before a recipe starts Ray on this machine: one node, and (on CPU) no more devices than cores unless
    ``trainer.cpu_oversubscribe`` says so (then announced). A locally started Ray would otherwise be sized to
    whatever is asked, so its own capacity check could never fail. GPUs are counted by Ray itself."""
    t, cores = cfg.trainer, cores or os.cpu_count() or 1
    errors = []
    if t.nnodes > 1:
        errors.append(
            f"trainer.nnodes={t.nnodes} asks for {t.nnodes} nodes, but a Ray started by the recipe has 1 (this "
            "machine); run on a Ray cluster (RAY_ADDRESS, recipes/slurm) or set trainer.nnodes=1"
        )
    need = device_counts(cfg)["total"]
    asked = (
        f"trainer.n_gpus_per_node * trainer.nnodes = {t.n_gpus_per_node} * {t.nnodes} = {need} CPU devices "
        "asked (one worker process each)"
    )
    if not use_gpu and need > cores and not t.cpu_oversubscribe:
        errors.append(
            f"{asked}, but this machine has {cores} CPU cores; set trainer.cpu_oversubscribe=true to share the "
            "cores among them anyway (slower), or ask for fewer devices"
        )
    if errors:
        raise ConfigError("this machine cannot hold the run:\n  - " + "\n  - ".join(errors))
    if not use_gpu and need > cores:
        logger.warning("%s on %d CPU cores: oversubscribed (trainer.cpu_oversubscribe=true)", asked, cores)


def init_ray(cfg: RecipeConfig) -> None:
    """Start a local Ray session unless one is running (tests and clusters bring their own)."""
    import ray

    if ray.is_initialized():
        return
    need = device_counts(cfg)["total"]
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # no weight-loading bars from every worker
        "TRANSFORMERS_VERBOSITY": "error",
    }
    address = os.environ.get("RAY_ADDRESS")
    if address:  # an existing cluster: its nodes' defaults, unless threads are asked for
        if cfg.trainer.omp_num_threads:
            env["OMP_NUM_THREADS"] = str(cfg.trainer.omp_num_threads)
        ray.init(address=address, runtime_env={"env_vars": job_env_vars(env, os.environ)})
        return
    # Ray gives each 1-CPU actor one torch thread; with one worker process per device the local cores are
    # shared out instead (the controller mostly waits): 2 cores, 1 device -> 2 threads, ~1.6x faster on CPU.
    cores = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(cfg.trainer.omp_num_threads or max(1, cores // max(need, 1)))
    num_cpus = cfg.trainer.ray_num_cpus or max(cores, need)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})


def write_run_config(cfg: RecipeConfig, run_dir: Path) -> None:
    """``run_dir/config.yaml`` (a resumed run's previous one kept as config.prev.yaml). The new file is written
    in full before either is renamed, so a full disk leaves both as they were."""
    path, staged = run_dir / "config.yaml", run_dir / "config.yaml.new"
    try:
        save_config(cfg, staged)
    except OSError as err:  # e.g. a full disk: one line, not the traceback of the YAML writer
        raise OSError(
            err.errno, f"cannot write the run's config {staged} ({err.strerror}); {path} is unchanged"
        ) from None
    if path.is_file() and cfg.trainer.resume_mode != "disable":
        os.replace(path, run_dir / "config.prev.yaml")
    os.replace(staged, path)


def start_run(cfg: RecipeConfig, recipe: str, start_ray: bool = True) -> Run:
    """Create the run directory, save the resolved config, prepare model and data, start Ray."""
    use_gpu = resolve_device(cfg)
    if start_ray and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        check_local_capacity(cfg, use_gpu)  # before anything is written or started
    model_path = resolve_model(cfg)  # a Hub id is fetched (or refused) before anything is written
    critic_path = cfg.critic.model_path
    if critic_path is not None:  # a Hub id: the critic's workers load the cached snapshot
        try:
            critic_path = resolve_model_path(critic_path, "critic.model_path", need_tokenizer=False)
        except ModelPathError as err:
            raise ConfigError(str(err)) from None
    run_dir = Path(cfg.trainer.default_local_dir).expanduser().resolve()
    prepare_run_folder(cfg, run_dir)  # another run's results are never overwritten silently
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(cfg, run_dir)  # model.path and critic.model_path as given (a Hub id stays an id)
    budget = resolve_token_budget(cfg, model_path, use_gpu)  # after the write: the saved config keeps auto
    if budget:
        logger.warning(budget)
    cfg.critic.model_path = critic_path
    train_files, val_files = resolve_data(cfg, run_dir)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if start_ray:
        init_ray(cfg)
    return Run(recipe, run_dir, model_path, train_files, val_files, tokenizer, use_gpu)


def model_config(cfg: RecipeConfig, path: str):
    """The workers' ModelConfig (workers/config.py) for ``path`` with the model section's settings."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k in names}
    kwargs["path"] = path
    return ModelConfig(**kwargs)
