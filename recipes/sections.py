"""The config sections every recipe shares, each with its checks, and ``RecipeConfig``, the config they make up.

A section dataclass checks itself with ``check(errors, cfg)``: it appends one message per problem, naming the
keys and numbers, and may read the other sections of ``cfg`` (batch sizes against the data-parallel sizes,
placement against the estimator). What the sections imply together (worker group sizes, whether a reference
model loads, what the chosen engines can do) is computed once, at the end of this module, for those checks and
for the driver (``recipes.trainer``). The role sections reuse the workers' own dataclasses (``workers/config.py``);
their checks are in ``recipes.worker_sections``. ``recipes.config.validate`` runs them all, then the recipe
schema's ``check_recipe`` (``recipes.schemas``, which builds each recipe's schema on ``RecipeConfig``).

Sections (verl names inside each): ``data``, ``task`` (generate a dataset with ``recipes.tasks``), ``model``,
``actor``, ``rollout``, ``critic`` (PPO), ``reward``, ``custom_reward_function``, ``algorithm``
(``adv_estimator``, ``use_kl_in_reward``, ``kl_ctrl.*``), ``trainer`` (steps, validation/checkpoint frequency,
resume, loggers, devices and placement), ``sft`` (the supervised warm start of the recipes that have one).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from algorithms import list_adv_estimators, list_rollout_corrections
from recipes.tasks import ALL_TASKS, task_config
from resource_pools.plans import PLACEMENTS
from workers.config import ActorConfig, CriticConfig, ModelConfig, RewardConfig, RolloutConfig
from workers.engine.base import OptimConfig
from workers.engine.registry import TRAIN_ENGINES, train_engine_class
from workers.models.chat_templates import CHAT_TEMPLATES
from workers.models.hub import model_path_problem
from workers.models.packed_kernels import resolve_packed_kernel
from workers.models.tiny import TINY_ARCHS, TINY_MODEL_SIZES
from workers.reward import load_custom_scorer
from workers.rollout.registry import rollout_engine_class

LOGGERS = ("console", "tensorboard", "wandb")
OLD_LOG_PROB_SOURCES = ("auto", "recompute", "rollout")  # algorithm.old_log_prob
DATA_LAYOUT = (  # the columns recipes.data reads from a parquet row (verl's layout)
    "prompt: the chat messages [{'role': 'user', 'content': ...}] (another column by data.prompt_key), "
    "data_source: the task, which names its reward scorer (workers/reward), reward_model: {'ground_truth': ...}, "
    "and optionally ability and extra_info (a dict); `python -m recipes.tasks.make` writes such files"
)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet; empty: generated from ``task``
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 256  # longer prompts are dropped (rollout.prompt_length must match)
    max_response_length: int = 256  # rollout.response_length must match
    train_batch_size: int = 16  # prompts per RL step (each sampled rollout.n times)
    val_batch_size: int | None = None  # prompts per validation generate call; None: the whole set
    train_max_samples: int | None = None  # use only the first k training rows
    val_max_samples: int | None = None
    shuffle: bool = True
    seed: int = 0  # data order: permutation per (seed, epoch)
    # rows whose data_source no reward scorer covers: "error" (name file and row at load time) or "skip" (count)
    unknown_data_source: str = "error"

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        """The batch against the data-parallel sizes, the lengths, and where the data comes from."""
        bs, n, dp = self.train_batch_size, samples_per_prompt(cfg), data_parallel_sizes(cfg)
        if bs < 1:
            errors.append(f"data.train_batch_size must be >= 1, got {bs}")
        else:
            if dp.rollout > 0 and bs % dp.rollout:
                errors.append(
                    f"data.train_batch_size={bs} prompts must be divisible by the rollout data-parallel size "
                    f"{dp.rollout} (each rollout rank generates for an equal share)"
                )
            if dp.train > 0 and (bs * n) % dp.train:
                errors.append(
                    f"data.train_batch_size * rollout.n = {bs} * {n} = {bs * n} rows is not divisible by the "
                    f"training data-parallel size {dp.train}"
                )
        if self.val_batch_size is not None and self.val_batch_size < 1:
            errors.append(f"data.val_batch_size must be >= 1 or null, got {self.val_batch_size}")
        for key in ("max_prompt_length", "max_response_length"):  # rollout.* must agree (its check)
            if getattr(self, key) < 1:
                errors.append(f"data.{key} must be >= 1, got {getattr(self, key)}")
        if not self.train_files and not cfg.task.name:
            errors.append(
                "no training data: set data.train_files (parquet) or task.name (generate a dataset)"
            )
        if self.train_files and not self.val_files and not cfg.task.name:
            errors.append("data.val_files is empty (validation needs held-out prompts)")
        for key in ("train_files", "val_files"):
            missing = [f for f in getattr(self, key) if not os.path.isfile(os.path.expanduser(f))]
            if missing:
                errors.append(f"data.{key}: no such file(s) {missing}")
            for f in getattr(self, key):
                if f not in missing and (problem := self.columns_problem(os.path.expanduser(f))):
                    errors.append(f"data.{key}: {f} {problem}")
        if self.unknown_data_source not in ("error", "skip"):
            errors.append(f"data.unknown_data_source must be error or skip, got {self.unknown_data_source!r}")

    def columns_problem(self, path: str) -> str | None:
        """Why the parquet file ``path`` lacks the columns every row needs (its schema only is read), or None."""
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as err:  # pyarrow.ArrowInvalid and the like: not a parquet file, or a damaged one
            return f"is not a parquet file ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        need = {self.prompt_key: f"{self.prompt_key!r} (data.prompt_key)", "data_source": "'data_source'"}
        need["reward_model"] = "'reward_model'"
        missing = [shown for column, shown in need.items() if column not in names]
        if not missing:
            return None
        return (
            f"has no column {', '.join(missing)} (its columns: {sorted(names)}); each row of a recipe's data holds "
            f"{DATA_LAYOUT}"
        )


@dataclass
class TaskConfig:
    """Generate ``train.parquet`` / ``val.parquet`` with ``recipes.tasks`` into ``<run dir>/data`` when
    ``data.train_files`` is empty."""

    name: str | None = None  # a key of recipes.tasks.ALL_TASKS (math tasks and the long-context RLM tasks)
    n_train: int = 2000
    n_val: int = 200
    seed: int = 0
    knobs: dict[str, Any] = field(default_factory=dict)  # the task config's difficulty knobs

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        if not self.name:
            return
        if self.name not in ALL_TASKS:
            errors.append(f"task.name={self.name!r} is not a task; choose one of {sorted(ALL_TASKS)}")
        else:
            try:
                task_config(self.name, **self.knobs)
            except (ValueError, TypeError) as err:
                errors.append(f"task.knobs: {err}")
        bs = cfg.data.train_batch_size
        if self.n_train < bs:
            errors.append(
                f"task.n_train={self.n_train} is smaller than one batch (data.train_batch_size={bs})"
            )
        if self.n_val < 1:
            errors.append(f"task.n_val must be >= 1, got {self.n_val}")


@dataclass
class RecipeModelConfig(ModelConfig):
    # None: build (once, cached) the tiny Qwen2 model of workers/models/tiny.py
    path: str | None = None  # type: ignore[assignment]  # workers get run.model_config's ModelConfig, path a str
    tiny_size: str = "tiny"  # nano | tiny | small, when path is None
    tiny_seed: int = 0
    # the tiny model's chat template family (workers/models/chat_templates.py: chatml, qwen3, deepseek_r1,
    # llama3); a model.path keeps its own template
    tiny_chat_template: str = "chatml"
    # the tiny model's architecture: dense (Qwen2) or moe (Qwen3-MoE, 4 experts, top-2; docs/moe.md)
    tiny_arch: str = "dense"

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        # a local model folder, or a Hugging Face Hub id (in the Hub's cache, or fetched when the run starts)
        if self.path is not None and (problem := model_path_problem(self.path, "model.path")):
            errors.append(problem)
        if self.path is None and self.tiny_size not in TINY_MODEL_SIZES:
            errors.append(f"model.tiny_size={self.tiny_size!r}; choose one of {sorted(TINY_MODEL_SIZES)}")
        if self.path is None and self.tiny_arch not in TINY_ARCHS:
            errors.append(f"model.tiny_arch={self.tiny_arch!r}; choose one of {list(TINY_ARCHS)}")
        import torch

        try:  # the engine's own rule, for a device that trains
            resolve_packed_kernel(
                self.packed_attention, torch.device("cuda" if uses_gpu(cfg) else "cpu"), True
            )
        except ValueError as err:
            errors.append(f"{err} (trainer.device={cfg.trainer.device})")
        if self.path is None and self.tiny_chat_template not in CHAT_TEMPLATES:
            errors.append(
                f"model.tiny_chat_template={self.tiny_chat_template!r}; choose one of {sorted(CHAT_TEMPLATES)}"
            )


@dataclass
class RecipeCriticConfig(CriticConfig):
    model_path: str | None = None  # None: the policy's model.path (a fresh value head on top)

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        """Checked only when the estimator trains a critic (``gae``), but for ``model_path``."""
        if self.model_path is not None and (
            problem := model_path_problem(self.model_path, "critic.model_path", need_tokenizer=False)
        ):
            errors.append(problem)  # the critic reads the policy's tokens: its folder needs no tokenizer
        if not uses_critic(cfg):
            return
        worlds = device_worlds(cfg)
        _, error = megatron_replicas("critic", self, worlds.get("critic", worlds["train"]))
        if error:
            errors.append(error)
        _check_megatron_colocation(errors, cfg)
        if cfg.data.train_batch_size >= 1:
            check_ppo_batches(
                errors,
                "critic",
                self,
                cfg.data.train_batch_size,
                samples_per_prompt(cfg),
                data_parallel_sizes(cfg).critic,
            )


@dataclass
class CustomRewardConfig:
    """verl's ``custom_reward_function``: a Python file whose function scores every data source instead of
    the registered rule scorers (signature ``fn(data_source, solution_str, ground_truth, extra_info=None)``)."""

    path: str | None = None  # a Python file, imported before Ray starts (relative: from the current dir)
    name: str = "compute_score"  # the function of that file that scores

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        """The file is imported here, before Ray starts, as the reward workers will import it: a missing file, an
        error raised while importing it (named with its file and line) or no function ``name`` in it is an
        error."""
        if self.path is None:
            return
        try:
            load_custom_scorer(self.path, self.name)
        except (OSError, ImportError, AttributeError) as err:
            errors.append(str(err))


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # any name in algorithms.list_adv_estimators()
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False  # token_level_rewards = scores - beta * KL(actor || ref)
    kl_penalty: str = "kl"  # KL estimator for the in-reward penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # Off-policy correction for samples the rollout policy (behaviour) produced with older or different
    # weights than the trainer's (proximal) policy: none | tis | seq_tis | decoupled_ppo (algorithms.off_policy)
    rollout_correction: str = "none"
    rollout_correction_cap: float | None = 2.0  # truncation (tis, seq_tis) / masking (decoupled_ppo) bound
    # The policy-loss ratio's denominator (old_log_probs): auto | recompute | rollout. recompute: the actor's
    # forward pass before the update (verl's default). auto: that pass only when something reads old_log_probs
    # before the update or the update is not strictly on-policy (more than one epoch or mini-batch); else the
    # update's own forward gives them (the same numbers, one pass fewer). rollout: the rollout engine's
    # log-probs (rollout_log_probs; no pass), so the ratio is current / behaviour policy, as verl's bypass mode.
    old_log_prob: str = "auto"

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        """The estimator against the samples per prompt, the KL controller, gamma and lambda (which estimator a
        recipe allows is the recipe schema's ``check_recipe``), the off-policy correction."""
        est, n, kl = self.adv_estimator, samples_per_prompt(cfg), self.kl_ctrl
        if self.rollout_correction not in list_rollout_corrections():
            errors.append(
                f"algorithm.rollout_correction={self.rollout_correction!r}; registered: "
                f"{list_rollout_corrections()}"
            )
        if self.old_log_prob not in OLD_LOG_PROB_SOURCES:
            errors.append(
                f"algorithm.old_log_prob must be one of {list(OLD_LOG_PROB_SOURCES)}, got {self.old_log_prob!r}"
            )
        elif self.old_log_prob == "rollout" and self.rollout_correction != "none":
            errors.append(
                f"algorithm.old_log_prob=rollout makes the rollout engine's log-probs the old ones, so "
                f"algorithm.rollout_correction={self.rollout_correction!r} (old vs rollout) would weigh every "
                f"token by 1: set one of them"
            )
        cap = self.rollout_correction_cap
        if cap is not None and not cap > 0:
            errors.append(f"algorithm.rollout_correction_cap must be > 0 or null, got {cap}")
        if est not in list_adv_estimators():
            errors.append(f"algorithm.adv_estimator={est!r}; registered: {list_adv_estimators()}")
        if est in ("grpo", "rloo") and n < 2:
            errors.append(
                f"algorithm.adv_estimator={est} compares samples of one prompt: rollout.n must be >= 2, got {n}"
            )
        if kl.type not in ("fixed", "adaptive"):
            errors.append(f"algorithm.kl_ctrl.type must be fixed or adaptive, got {kl.type!r}")
        if kl.type == "adaptive" and (kl.target_kl <= 0 or kl.horizon <= 0):
            errors.append(
                f"algorithm.kl_ctrl (adaptive) needs target_kl > 0 and horizon > 0, got target_kl="
                f"{kl.target_kl}, horizon={kl.horizon}"
            )
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            errors.append(
                f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}, {self.lam}"
            )


@dataclass
class TrainerConfig:
    project_name: str = "hyflow"
    experiment_name: str = "run"
    # run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, curves.png, hf_model/
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    total_training_steps: int | None = 20  # None: total_epochs over the training set
    total_epochs: int = 1
    test_freq: int = 5  # validate every k steps (and at the last step); <= 0: never during training
    val_before_train: bool = True
    save_freq: int = -1  # checkpoint every m steps (and at the last step); <= 0: never
    max_ckpt_to_keep: int | None = None  # delete older checkpoints beyond this many
    resume_mode: str = "auto"  # auto (latest checkpoint in the run dir) | disable | <path of a step_N dir>
    # the run folder holds another run's results (metrics or checkpoints) and this run does not resume them:
    # false refuses (a rerun of the same config with no checkpoint starts again in place); true removes them
    overwrite: bool = False
    # resume_mode=auto and the latest checkpoint fails its content-hash check: resume from the newest intact
    # earlier one (false: stop with an error naming it)
    resume_fallback: bool = False
    critic_warmup: int = 0  # PPO: steps that update only the critic
    nnodes: int = 1
    n_gpus_per_node: int = 1  # devices per node (CPU bundles when there is no GPU)
    device: str = "auto"  # auto | cpu | cuda
    # colocated: one pool for every role; disaggregated: rollout pool apart; split_critic: critic pool apart
    placement: str = "colocated"
    rollout_gpus_per_node: int = 0  # disaggregated: devices per node for the rollout pool (rest: training)
    critic_gpus_per_node: int = 0  # split_critic: devices per node for the critic pool (rest: actor)
    export_hf: bool = False  # write <run dir>/hf_model at the end
    progress_bar: bool = True
    plot: bool = True  # <run dir>/curves.png at the end
    ray_num_cpus: int | None = None  # only when the recipe starts Ray itself; None: Ray's default
    omp_num_threads: int | None = None  # torch threads per worker process; None: cores / devices (own Ray)
    # every worker-group call: call_timeout_s + call_timeout_per_row_s * (rows of its batch); None: no limit
    call_timeout_s: float | None = 1800.0
    call_timeout_per_row_s: float = 1.0
    # worker faults (a process killed or out of memory, a call past its timeout) survived in a run: a rank of a
    # disaggregated rollout pool is replaced in place; otherwise every worker group is rebuilt and training goes
    # on from the latest checkpoint (the steps since it computed again: trainer.save_freq bounds the loss);
    # 0: the first fault ends the run with the error naming it (docs/reliability.md)
    max_restarts: int = 2
    # a locally started Ray on CPU: allow more devices (worker processes) than this machine has cores
    cpu_oversubscribe: bool = False
    max_consecutive_skipped_updates: int = 5  # abort after this many steps in a row with a non-finite update
    # stop training at the first step that ends past this wall time (then validate, checkpoint, export as
    # at the last step); null: total_training_steps decides
    max_train_time_s: float | None = None
    wandb_mode: str | None = None  # e.g. offline

    def device_errors(self, cfg: RecipeConfig) -> list[str]:
        """What is wrong with the devices and the placement (no worker group sizes without them right)."""
        errors = []
        if self.nnodes < 1:
            errors.append(f"trainer.nnodes must be >= 1, got {self.nnodes}")
        if self.n_gpus_per_node < 1:
            errors.append(f"trainer.n_gpus_per_node must be >= 1, got {self.n_gpus_per_node}")
        if self.placement not in PLACEMENTS:
            errors.append(f"trainer.placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        elif self.placement == "disaggregated" and not 0 < self.rollout_gpus_per_node < self.n_gpus_per_node:
            errors.append(
                f"trainer.placement=disaggregated needs 0 < trainer.rollout_gpus_per_node < "
                f"trainer.n_gpus_per_node (a rollout pool and a training pool), got rollout_gpus_per_node="
                f"{self.rollout_gpus_per_node}, n_gpus_per_node={self.n_gpus_per_node}"
            )
        elif self.placement == "split_critic":
            if not 0 < self.critic_gpus_per_node < self.n_gpus_per_node:
                errors.append(
                    f"trainer.placement=split_critic needs 0 < trainer.critic_gpus_per_node < "
                    f"trainer.n_gpus_per_node (a critic pool and an actor pool), got critic_gpus_per_node="
                    f"{self.critic_gpus_per_node}, n_gpus_per_node={self.n_gpus_per_node}"
                )
            if not uses_critic(cfg):
                errors.append(
                    f"trainer.placement=split_critic puts the critic on its own pool, but algorithm.adv_estimator="
                    f"{cfg.algorithm.adv_estimator} trains no critic (use recipes.ppo with adv_estimator=gae)"
                )
        if self.placement != "split_critic" and self.critic_gpus_per_node != 0:
            errors.append(
                f"trainer.critic_gpus_per_node={self.critic_gpus_per_node} is only used with "
                f"trainer.placement=split_critic (got placement={self.placement!r})"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            errors.append(f"trainer.device must be auto, cpu or cuda, got {self.device!r}")
        return errors

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        errors.extend(self.device_errors(cfg))
        steps = self.total_training_steps
        if steps is not None and steps < 1:
            errors.append(f"trainer.total_training_steps must be >= 1 or null, got {steps}")
        if steps is None and self.total_epochs < 1:
            errors.append(f"trainer.total_epochs must be >= 1, got {self.total_epochs}")
        unknown = [lg for lg in self.logger if lg not in LOGGERS]
        if unknown:
            errors.append(f"trainer.logger has unknown logger(s) {unknown}; known: {list(LOGGERS)}")
        if "wandb" in self.logger and importlib.util.find_spec("wandb") is None:
            errors.append(
                "trainer.logger includes wandb, but the wandb package is not installed (pip install wandb)"
            )
        if self.resume_mode not in ("auto", "disable") and not os.path.isdir(self.resume_mode):
            errors.append(
                "trainer.resume_mode must be auto, disable or an existing checkpoint directory, got "
                f"{self.resume_mode!r}"
            )
        if self.resume_fallback and self.resume_mode != "auto":
            errors.append(
                f"trainer.resume_fallback=true applies to trainer.resume_mode=auto only, got {self.resume_mode!r}"
            )
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            errors.append(f"trainer.max_ckpt_to_keep must be >= 1 or null, got {self.max_ckpt_to_keep}")
        if self.critic_warmup < 0:
            errors.append(f"trainer.critic_warmup must be >= 0, got {self.critic_warmup}")
        if self.max_restarts < 0:
            errors.append(f"trainer.max_restarts must be >= 0, got {self.max_restarts}")
        if self.call_timeout_s is not None and not self.call_timeout_s > 0:
            errors.append(f"trainer.call_timeout_s must be > 0 or null (no limit), got {self.call_timeout_s}")
        if not self.call_timeout_per_row_s >= 0:
            errors.append(f"trainer.call_timeout_per_row_s must be >= 0, got {self.call_timeout_per_row_s}")
        if self.max_train_time_s is not None and not self.max_train_time_s > 0:
            errors.append(f"trainer.max_train_time_s must be > 0 or null, got {self.max_train_time_s}")
        if self.max_consecutive_skipped_updates < 1:
            errors.append(
                "trainer.max_consecutive_skipped_updates must be >= 1, got "
                f"{self.max_consecutive_skipped_updates}"
            )


ASYNC_MODES = ("sync", "one_step", "full")
ON_WEIGHT_UPDATE = ("partial", "abort")


@dataclass
class AsyncRLConfig:
    """How generation overlaps training (``recipes/grpo_async.py``, ``recipes/trainer/async_rl.py``).

    ``sync``: generate, then train, every step (``recipes/grpo.py``'s step). ``one_step``: the next batch is
    generated while this one trains (one-step off-policy). ``full``: the rollout pool streams finished groups
    into a bounded buffer without waiting for the trainer. Both asynchronous modes need
    ``trainer.placement=disaggregated`` (the rollout engines on their own devices)."""

    mode: str = "sync"  # sync | one_step | full
    max_staleness: int = 1  # policy versions a group may lag the trainer; older groups are regenerated
    buffer_batches: int = 2  # full: finished + in-flight groups at most, in train batches
    groups_per_call: int = 1  # full: prompt groups per generate call on one rollout rank
    on_weight_update: str = (
        "partial"  # partial: in-flight requests go on with the new weights; abort: requeued
    )

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        if self.mode not in ASYNC_MODES:
            errors.append(f"async_rl.mode must be one of {list(ASYNC_MODES)}, got {self.mode!r}")
        elif self.mode != "sync" and cfg.trainer.placement != "disaggregated":
            errors.append(
                f"async_rl.mode={self.mode} overlaps generation with training on other devices: it needs "
                f"trainer.placement=disaggregated, got {cfg.trainer.placement!r}"
            )
        if self.on_weight_update not in ON_WEIGHT_UPDATE:
            errors.append(
                f"async_rl.on_weight_update must be one of {list(ON_WEIGHT_UPDATE)}, got {self.on_weight_update!r}"
            )
        elif self.on_weight_update == "abort" and not engine_can(cfg, "swaps_weights_mid_generation"):
            errors.append(
                "async_rl.on_weight_update=abort needs rollout.name=native or another engine that swaps weights "
                f"mid-generation (rollout.name={cfg.rollout.name!r} changes weights only between calls: its "
                "in-flight requests finish on the old weights)"
            )
        if self.max_staleness < 0:
            errors.append(f"async_rl.max_staleness must be >= 0, got {self.max_staleness}")
        if self.buffer_batches < 1:
            errors.append(f"async_rl.buffer_batches must be >= 1, got {self.buffer_batches}")
        if self.groups_per_call < 1:
            errors.append(f"async_rl.groups_per_call must be >= 1, got {self.groups_per_call}")


@dataclass
class SFTConfig:
    """Supervised warm start on the task's demonstration solutions (``extra_info.solution``), run through an
    ActorWorker group (``sft_step``) before RL; the result is exported and RL starts from it."""

    # None: warm-start exactly when model.path is None -- the tiny model is built with random weights, and a
    # random policy earns no reward, so RL from it learns nothing -- and train a given model as it is
    enable: bool | None = None
    total_steps: int = 200  # optimizer steps (a cosine schedule needs sft.optim.total_steps, e.g. the same)
    batch_size: int = 32  # examples per step
    max_length: int = 256  # prompt + solution tokens; longer examples are dropped
    max_samples: int | None = None
    shuffle: bool = True
    seed: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    log_every: int = 25

    def runs(self, cfg: RecipeConfig) -> bool:
        """Whether this run warm-starts (``enable``, or when it is None: whether model.path is None)."""
        return cfg.model.path is None if self.enable is None else self.enable

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        if not self.runs(cfg):
            return
        dp = data_parallel_sizes(cfg).train
        if self.batch_size < 1 or self.total_steps < 1:
            errors.append(
                f"sft.batch_size and sft.total_steps must be >= 1, got {self.batch_size}, {self.total_steps}"
            )
        elif dp > 0 and self.batch_size % dp:
            errors.append(
                f"sft.batch_size={self.batch_size} is not divisible by the training data-parallel size {dp}"
            )


@dataclass
class RecipeConfig:
    """The sections every recipe has (``sft``: the supervised warm start before RL, by default exactly when
    the model is the locally built tiny one, whose weights are random). A section with a ``check(errors, cfg)`` method (or an entry in
    ``recipes.worker_sections.WORKER_SECTION_CHECKS`` for the workers' own dataclasses) checks itself in ``validate``; the recipe's
    schema adds its rules in ``check_recipe``."""

    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: RecipeModelConfig = field(default_factory=RecipeModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    critic: RecipeCriticConfig = field(default_factory=RecipeCriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def check_recipe(self, errors: list[str]) -> None:
        """Rules of one recipe across sections (subclasses); none for the base."""


# ----------------------------------------------------------------------------------------------------------------
# What the sections imply: worker group sizes, and the checks of the workers' own sections
# ----------------------------------------------------------------------------------------------------------------


def device_counts(cfg: RecipeConfig) -> dict[str, int]:
    """World sizes of the worker groups: ``train`` (actor, ref, critic, reward) and ``rollout``; under
    ``split_critic`` ``train`` is the actor pool (actor + rollout, ref, reward) and ``critic`` the critic's."""
    t = cfg.trainer
    if t.placement == "split_critic":
        actor = (t.n_gpus_per_node - t.critic_gpus_per_node) * t.nnodes
        return {
            "train": actor,
            "rollout": actor,
            "critic": t.critic_gpus_per_node * t.nnodes,
            "total": t.n_gpus_per_node * t.nnodes,
        }
    if t.placement == "disaggregated":
        train = (t.n_gpus_per_node - t.rollout_gpus_per_node) * t.nnodes
        return {
            "train": train,
            "rollout": t.rollout_gpus_per_node * t.nnodes,
            "total": t.n_gpus_per_node * t.nnodes,
        }
    n = t.n_gpus_per_node * t.nnodes
    return {"train": n, "rollout": n, "total": n}


def uses_gpu(cfg: RecipeConfig) -> bool:
    """Whether the workers run on GPUs: ``trainer.device`` cuda, or auto where torch sees a CUDA device (the run
    itself refuses cuda where it sees none: ``recipes.trainer.run.resolve_device``)."""
    if cfg.trainer.device == "cpu":
        return False
    if cfg.trainer.device == "cuda":
        return True
    import torch

    return torch.cuda.is_available()


def needs_reference(cfg: RecipeConfig) -> bool:
    # the hybrid advantage's OPD teacher is the reference model conditioned on a hint
    return bool(
        cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or cfg.algorithm.adv_estimator == "hybrid"
    )


def reference_is_actor(cfg: RecipeConfig) -> bool:
    """With LoRA the reference is the actor's own frozen base (adapters disabled): no reference model loads."""
    return needs_reference(cfg) and cfg.actor.lora.enabled


def syncs_adapters(cfg: RecipeConfig) -> bool:
    """Whether weight syncs carry the LoRA adapter alone (the rollout engine loads adapters), not merged weights."""
    return cfg.actor.lora.enabled and engine_can(cfg, "loads_adapters")


def uses_critic(cfg: RecipeConfig) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def samples_per_prompt(cfg: RecipeConfig) -> int:
    """``rollout.n`` for the checks of other sections: 1 when it is below 1 (the rollout check says so)."""
    return max(cfg.rollout.n, 1)


class DataParallelSizes(NamedTuple):
    """Model replicas per worker group, among which batches divide; 0 where the sizes are invalid (the
    section that holds them reports it, and the batch checks that need them are skipped)."""

    train: int  # actor, ref, reward (Megatron: devices / (tp * pp))
    rollout: int
    critic: int


def device_worlds(cfg: RecipeConfig) -> dict[str, int]:
    """``device_counts`` once the devices and placement are valid, else zeros."""
    if cfg.trainer.device_errors(cfg):
        return {"train": 0, "rollout": 0}
    return device_counts(cfg)


def data_parallel_sizes(cfg: RecipeConfig) -> DataParallelSizes:
    worlds = device_worlds(cfg)
    critic = worlds.get("critic", worlds["train"])
    if uses_critic(cfg):
        critic = megatron_replicas("critic", cfg.critic, critic)[0]
    return DataParallelSizes(
        megatron_replicas("actor", cfg.actor, worlds["train"])[0], worlds["rollout"], critic
    )


def model_parallel(role_cfg) -> tuple[int, int]:
    m = role_cfg.megatron
    return m.tensor_model_parallel_size, m.pipeline_model_parallel_size


def megatron_replicas(sec: str, role_cfg, world: int) -> tuple[int, str | None]:
    """(data-parallel size of a role on ``world`` devices: ``world / (tp * pp)`` where the engine is model
    parallel (strategy=megatron), and None), or (0, the error) when the strategy names no training engine or
    the world is not a multiple of tp * pp."""
    strategy = role_cfg.strategy
    if ":" not in strategy and strategy not in TRAIN_ENGINES:
        names = " or ".join(sorted(TRAIN_ENGINES))
        return 0, f"{sec}.strategy must be {names}, got {strategy!r} (or 'package.module:Class' of your own)"
    try:
        engine = train_engine_class(strategy, f"{sec}.strategy")
    except (ValueError, TypeError) as e:
        return 0, str(e)
    mp = engine.model_parallel_size(role_cfg.megatron)  # ranks of one model replica
    if mp == 1 or world <= 0:
        return world, None
    tp, pp = model_parallel(role_cfg)
    if world % mp:
        return 0, (
            f"{sec}.megatron.tensor_model_parallel_size * {sec}.megatron.pipeline_model_parallel_size = "
            f"{tp} * {pp} = {mp} must divide the {world} device(s) of the {sec}'s worker group"
        )
    return world // mp, None


def check_ppo_batches(errors: list[str], sec: str, role_cfg, train_bs: int, n: int, dp: int) -> None:
    mini = role_cfg.ppo_mini_batch_size
    if mini < 1:
        errors.append(f"{sec}.ppo_mini_batch_size must be >= 1, got {mini}")
        return
    if mini > train_bs or train_bs % mini:
        errors.append(
            f"{sec}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_bs} "
            f"(prompts per step; each optimizer step takes {mini} of them)"
        )
    rows = mini * n
    if dp > 0 and rows % dp:
        errors.append(
            f"{sec}.ppo_mini_batch_size * rollout.n = {mini} * {n} = {rows} rows per optimizer step is not "
            f"divisible by the training data-parallel size {dp}"
        )
    elif dp > 0 and not role_cfg.use_dynamic_bsz:
        micro = role_cfg.ppo_micro_batch_size_per_gpu
        per_rank = rows // dp
        if micro is None or micro < 1:
            errors.append(f"{sec}.ppo_micro_batch_size_per_gpu must be >= 1 when {sec}.use_dynamic_bsz=false")
        elif per_rank % micro:
            errors.append(
                f"{sec}.ppo_micro_batch_size_per_gpu={micro} must divide the {per_rank} rows each rank gets per "
                f"optimizer step ({sec}.ppo_mini_batch_size * rollout.n / dp = {mini} * {n} / {dp})"
            )
    if role_cfg.ppo_epochs < 1:
        errors.append(f"{sec}.ppo_epochs must be >= 1, got {role_cfg.ppo_epochs}")


def train_engine_can(strategy: str, capability: str) -> bool:
    """Whether the training engine ``strategy`` names declares ``capability`` (`workers.engine.base.TrainEngine`;
    False for a name that does not resolve: `megatron_replicas` reports that)."""
    try:
        return bool(getattr(train_engine_class(strategy), capability))
    except (ValueError, TypeError):
        return False


def engine_can(cfg: RecipeConfig, capability: str) -> bool:
    """Whether ``rollout.name``'s engine declares ``capability`` (False for a name that does not resolve: that
    is reported by `_check_rollout_engine`)."""
    try:
        return bool(getattr(rollout_engine_class(cfg.rollout.name), capability))
    except (ValueError, TypeError):
        return False


def _check_megatron_colocation(errors: list[str], cfg: RecipeConfig) -> None:
    """Megatron's parallel state is per process: a colocated actor and critic (one process per device) that
    both use Megatron must use the same TP/PP sizes."""
    a, c = cfg.actor, cfg.critic
    if cfg.trainer.placement == "split_critic" or not all(
        train_engine_can(r.strategy, "process_global_parallel_state") for r in (a, c)
    ):
        return
    if model_parallel(a) != model_parallel(c):
        errors.append(
            f"actor.megatron (tp, pp) = {model_parallel(a)} and critic.megatron (tp, pp) = {model_parallel(c)} "
            f"differ, but trainer.placement={cfg.trainer.placement} runs both in one process per device, which "
            "holds one Megatron parallel state; use the same sizes or trainer.placement=split_critic"
        )
