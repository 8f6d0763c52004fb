"""The TRL side of ``benchmarks/bench_vs_trl.py``: Hugging Face TRL's ``GRPOTrainer`` on the benchmark's work.

    .venv-trl/bin/python benchmarks/trl_grpo_baseline.py SPEC.json OUT.json

Runs in the TRL virtualenv (``benchmarks/trl_env.sh``), never in hyflow's: it imports only the standard
library, torch, transformers, datasets and trl (those last three inside ``train``, so hyflow's tests can check
the spec and the reward without TRL installed). ``SPEC.json`` (written by the benchmark) names the warm-started
model directory, the training prompts with their answers and the GRPO settings; ``OUT.json`` receives, per
optimizer step, the wall time (a ``TrainerCallback`` from step begin to step end: generation, reward, loss,
backward and the optimizer step), the completion tokens and the mean reward, plus the token ids TRL's own chat
rendering gives the first prompts (the benchmark checks they equal hyflow's).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time

SPEC_KEYS = {
    "model_dir": str,
    "prompts": list,  # [{"question": str, "answer": str}]
    "steps": int,
    "n_prompts": int,  # prompts per optimizer step
    "n_samples": int,  # completions per prompt (the GRPO group)
    "max_new_tokens": int,
    "lr": float,
    "temperature": float,
    "clip_ratio": float,
    "grad_clip": float,
    "seed": int,
}
# a parity check of one update adds "one_update_dir" (where TRL's updated model goes; see ``one_update``)
# a race adds: "train_seconds" (training stops at the first step end past it) and "held_out" ([{question, answer}],
# greedy accuracy measured on them after training)
RACE_KEYS = {"train_seconds": float, "held_out": list}
N_RENDERED = 4  # prompts whose rendered token ids are reported

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INT = re.compile(r"[+-]?\d{1,30}")


def load_spec(path: str) -> dict:
    """The spec at ``path``, with every key present and of its type (ints accepted where floats are)."""
    with open(path) as f:
        spec = json.load(f)
    race = "train_seconds" in spec or "held_out" in spec
    for key, kind in (SPEC_KEYS | RACE_KEYS if race else SPEC_KEYS).items():
        if key not in spec:
            raise ValueError(f"spec {path} lacks {key!r}")
        value = spec[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            spec[key] = float(value)
        elif not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"spec {path}: {key} must be {kind.__name__}, got {value!r}")
    for key in ("prompts", "held_out") if race else ("prompts",):
        if not spec[key] or not all({"question", "answer"} <= set(p) for p in spec[key]):
            raise ValueError(f"spec {path}: {key} must be a non-empty list of {{question, answer}}")
    return spec


def messages(question: str) -> list[dict]:
    """The conversational prompt, the same one message hyflow's task rows hold."""
    return [{"role": "user", "content": question}]


def render_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """The prompt token ids GRPOTrainer generates from: its call on conversational prompts."""
    ids = tokenizer.apply_chat_template(
        [messages(q) for q in questions], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return [list(map(int, row)) for row in ids]


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the last ``\\boxed{...}`` holds the integer ``answer`` (spaces and a sign allowed), else 0.0:
    hyflow's arithmetic rule (workers/reward/arithmetic.py)."""
    found = _BOXED.findall(completion)
    if not found or not _INT.fullmatch(found[-1].strip()):
        return 0.0
    return float(int(found[-1].strip()) == int(answer))


def exact_match_reward(completions: list, answer: list[str], **_) -> list[float]:
    """TRL reward function: ``completions`` are message lists (conversational prompts) or strings."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [exact_match(t, a) for t, a in zip(texts, answer)]


def grpo_config(spec: dict, out_dir: str):
    """TRL's ``GRPOConfig`` for the spec's work: one optimizer step per batch of n_prompts x n_samples."""
    from trl import GRPOConfig

    batch = spec["n_prompts"] * spec["n_samples"]
    return GRPOConfig(
        output_dir=out_dir,
        max_steps=spec["steps"],
        per_device_train_batch_size=batch,  # completions per step: one mini-batch, one optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["n_samples"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=spec["grad_clip"],
        epsilon=spec["clip_ratio"],
        beta=0.0,  # no KL: no reference model
        loss_type="dapo",  # token mean over the batch, as hyflow's token-mean
        scale_rewards="group",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        disable_tqdm=True,
    )


def train(spec: dict) -> dict:
    """``spec["steps"]`` GRPO optimizer steps; returns the per-step times, tokens and rewards."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []
            self.logs: list[dict] = []
            self.line_at: list[float] = []
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_started = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._t0)
            seconds = spec.get("train_seconds")
            if seconds and time.perf_counter() - self.train_started >= seconds:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:  # a step's log line (logging_steps=1), as the user sees it printed
                self.logs.append(dict(logs))
                self.line_at.append(time.perf_counter())

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rows = [{"prompt": messages(p["question"]), "answer": str(p["answer"])} for p in spec["prompts"]]
    rendered = render_ids(tokenizer, [p["question"] for p in spec["prompts"][:N_RENDERED]])
    batch = spec["n_prompts"] * spec["n_samples"]
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        config = grpo_config(spec, out_dir)
        held_out = spec.get("held_out")
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match_reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        generate_s = time_generation(trainer)
        # the warm start's greedy accuracy too: a check that both sides' evaluations agree before training
        before = (
            greedy_accuracy(model, tokenizer, held_out, spec, trainer.eos_token_ids) if held_out else None
        )
        trainer.train()
    lengths = [log["completions/mean_length"] for log in timer.logs]
    accuracy = (
        greedy_accuracy(trainer.model, tokenizer, held_out, spec, trainer.eos_token_ids) if held_out else None
    )
    return {
        "held_out_accuracy_before": before,
        "held_out_accuracy": accuracy,
        "step_s": timer.step_s,
        "line_s": [b - a for a, b in zip(timer.line_at, timer.line_at[1:])],
        "generate_s": generate_s,
        "completion_tokens": [mean * batch for mean in lengths],
        "reward": [log["reward"] for log in timer.logs],
        "prompt_ids": rendered,
        "eos_token_ids": trainer.eos_token_ids,  # generation stops on any of them
        "versions": {"torch": torch.__version__, "trl": sys.modules["trl"].__version__},
    }


def time_generation(trainer) -> list[float]:
    """Wraps the trainer's generate-and-score call (one per step here: sampling, reward, advantages) with a
    timer; returns the list its seconds are appended to, so a step splits into that and the update."""
    seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        out = generate_and_score(inputs)
        seconds.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed
    return seconds


def one_update(spec: dict) -> dict:
    """One GRPO update by TRL's own code, for the benchmark's parity check: ``GRPOTrainer`` generates, scores and
    computes the advantages of one batch (the first ``n_prompts`` prompts x ``n_samples``), then its loss, the
    gradient clipping and its AdamW take one step; the updated model goes to ``spec["one_update_dir"]``.
    Returns that batch (token ids, TRL's advantages), the loss and the pre-clip gradient norm."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rows = [{"prompt": messages(p["question"]), "answer": str(p["answer"])} for p in spec["prompts"]]
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match_reward,
            args=grpo_config({**spec, "steps": 1}, out_dir),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=1)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
        model.train()
        group = [row for row in rows[: spec["n_prompts"]] for _ in range(spec["n_samples"])]
        inputs = trainer._generate_and_score_completions(group)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        trainer.optimizer.step()
    model.save_pretrained(spec["one_update_dir"])
    prompts, completions = inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist()
    prompt_masks, completion_masks = inputs["prompt_mask"].tolist(), inputs["completion_mask"].tolist()
    return {
        "prompt_ids": [[t for t, m in zip(r, ms) if m] for r, ms in zip(prompts, prompt_masks)],
        "completion_ids": [[t for t, m in zip(r, ms) if m] for r, ms in zip(completions, completion_masks)],
        "advantages": inputs["advantages"].tolist(),
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "versions": {"torch": torch.__version__, "trl": sys.modules["trl"].__version__},
    }


def greedy_accuracy(model, tokenizer, held_out: list[dict], spec: dict, eos_token_ids: list[int]) -> float:
    """Share of ``held_out`` prompts whose greedy completion (HF ``generate``, left-padded batch) is right."""
    import torch

    ids = render_ids(tokenizer, [p["question"] for p in held_out])
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=spec["max_new_tokens"],
            eos_token_id=eos_token_ids,
            pad_token_id=pad,
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(exact_match(t, p["answer"]) for t, p in zip(texts, held_out)) / len(held_out)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: trl_grpo_baseline.py SPEC.json OUT.json")
    spec = load_spec(argv[0])
    result = one_update(spec) if "one_update_dir" in spec else train(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
