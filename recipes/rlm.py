"""GRPO on Recursive Language Model (RLM) trajectories: the policy drives a persistent sandboxed Python REPL
that holds a long context, turn by turn, until ``FINAL(...)`` / ``FINAL_VAR(...)``.

    python -m recipes.rlm                                   # recipes/rlm.yaml: tiny model, S-NIAH 2K-8K chars, CPU
    python -m recipes.rlm trainer.total_training_steps=20 env.agent.max_iterations=3
    python -m recipes.rlm trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1
    python -m recipes.rlm trainer.placement=disaggregated trainer.n_gpus_per_node=2 trainer.rollout_gpus_per_node=1 \
        async_rl.mode=full                             # trajectories stream in while the trainer trains
    python -m recipes.rlm --config recipes/rlm_word_count.yaml   # another environment: env.loop (docs/agent_env.md)
    python -m recipes.rlm --config recipes/rlm_tool_calls.yaml   # tool calls in the model's format (Hermes/Qwen)
    python -m recipes.rlm --config recipes/rlm_mixed.yaml        # three environments, a row's env_name picks one

1. build the tiny model and the long-context task data (``task.name``: sniah / oolong / oolong_pairs);
2. warm start: the tasks' reference solutions replayed as multi-turn RLM trajectories (system prompt + query,
   the reference repl turns as assistant messages, the observations the sandbox really printed), trained
   with ``ActorWorker.sft_step`` on the assistant turns only;
3. GRPO (``recipes/grpo.py``'s step) with the env role generating (``workers/agents``, ``env.loop: rlm``): it runs
   ``rollout.n`` RLM trajectories per prompt in its sandbox (``env/*`` metrics); the reward is the task scorer
   on each trajectory's final answer; log-probs, group-relative advantages, clipped update and weight sync run
   on the trajectories' model tokens (observation tokens are attended to but carry loss mask 0);
4. greedy RLM validation (``trainer.val_before_train``, ``trainer.test_freq``): success rate
   (``val/accuracy``) and ``val-env/*``.

The steps are not RLM-specific: ``env.loop`` picks any agent environment, whose own dataclass holds the ``env``
section (``recipes/config.py``), and they run it the same way (its metrics, its reference replay for the warm
start).
"""

from __future__ import annotations

import re
import time

from recipes import grpo, grpo_async
from recipes.schemas import RLMConfig
from recipes.trainer import (
    Run,
    cli,
    parse_args,
    replayed,
    report_result,
    start_run,
    warm_start,
)
from recipes.trainer.roles import env_generator
from workers.agents.loop import AgentEnvConfig
from workers.agents.replay import reference_batch


def train(cfg: RLMConfig, run: Run, recipe: str = "rlm") -> dict:
    # the RLM env generates, in its sandbox; async_rl.mode one_step / full: while the trainer trains
    trainer = grpo if cfg.async_rl.mode == "sync" else grpo_async
    return trainer.train(cfg, run, recipe, **env_generator(cfg, run, cfg.env))


def success_label(env: AgentEnvConfig) -> str:
    """What the final line measured: the share of held-out problems the environment's greedy trajectories solved
    (``val/accuracy``), named by the environment's config class: "RLM success rate", "word-count success rate";
    an ``env.loop: mixed`` run names its environments (each has its own ``val-env/<name>/accuracy``)."""
    names = [n for n in env.env_names() if n]
    if len(names) > 1:
        return f"success rate over the environments {', '.join(names)}"
    kind = type(env).__name__.removesuffix("EnvConfig") or env.loop
    words = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", kind).split()  # OpenAIAgent: 3 words
    return "-".join(w if w.isupper() else w.lower() for w in words) + " success rate"


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = parse_args("rlm", argv)
    assert isinstance(cfg, RLMConfig)  # SCHEMAS["rlm"]
    run = start_run(cfg, "rlm")
    print(f"[rlm] run dir {run.dir}; model {run.model_path}; data {run.train_files[0]}")
    run.model_path = warm_start(cfg, run, replayed(reference_batch, "reference trajectories"))
    result = train(cfg, run)
    summary = report_result(result, t0, success_label(cfg.env), run.dir)  # README's figures: its result.json
    return {**result, **summary}


if __name__ == "__main__":
    cli(main)
