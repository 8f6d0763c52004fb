"""Shared settings and helpers of the recipe tests (imported by name: pytest puts this directory on sys.path)."""

import os
import signal
import threading

# A brief, quiet RLM recipe run on the nano model: one GRPO step after a two-step warm start, two prompts x two
# samples, two short turns each, console logging only. Tests add their own directory and options.
BRIEF_RLM = [
    "model.tiny_size=nano",
    "task.n_train=8",
    "task.n_val=2",
    "task.knobs.lengths=2000",
    "data.val_max_samples=2",
    "data.val_batch_size=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "env.agent.max_iterations=2",
    "env.agent.max_new_tokens=24",
    "trainer.total_training_steps=1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


# A brief, quiet GRPO run on the nano model: 4 steps of 2 prompts x 2 samples, no validation, no checkpoints.
BRIEF_GRPO = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=64",
    "task.n_val=4",
    "data.val_max_samples=4",
    "data.train_batch_size=2",
    "data.max_prompt_length=32",
    "data.max_response_length=24",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "actor.optim.lr=1e-2",  # large steps: the rollout's and the trainer's log-probs drift apart visibly
    "trainer.total_training_steps=4",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=-1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


def kill_during_generation(monkeypatch, step: int, rank: int, group: str = "rollout", delay_s: float = 0.05):
    """SIGKILL the process of ``group``'s (a `Roles` field: actor, rollout, generator) rank ``rank``, ``delay_s``
    into the training generation of ``step`` (once): a real process death in the middle of a step, as an
    out-of-memory kill or a lost node would be. Returns the list of killed pids (one, once it happened)."""
    from recipes.trainer.roles import Roles
    from recipes.trainer.steps import SEED_STRIDE

    original, killed = Roles.generate, []

    def generate(self, prompts, meta):
        at = (
            meta["seed"] % 2**32
        ) // SEED_STRIDE  # rollout_meta: seed = rollout.seed * 2**32 + step * STRIDE
        if not killed and not meta.get("validate") and at == step:
            pid = getattr(self, group).pids[rank]
            killed.append(pid)
            threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL)).start()
        return original(self, prompts, meta)

    monkeypatch.setattr(Roles, "generate", generate)
    return killed
