"""Shared settings of the recipe tests (imported by name: pytest puts this directory on sys.path)."""

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
