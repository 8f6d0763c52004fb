"""The embedded default model: a tiny Qwen2-architecture causal LM and its byte-level BPE tokenizer.

Everything is built locally and deterministically from a seed -- no hub downloads. The result is an
ordinary Hugging Face directory, so the rest of hyflow (and any HF tool) loads it like any checkpoint::

    from workers.models.tiny import build_tiny_model
    path = build_tiny_model("/tmp/hyflow-tiny", size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)

Tokenizer: byte-level BPE (``tokenizers``), vocabulary ``VOCAB_SIZE`` (1024) including the special
tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|pad|>``. Pre-tokenisation follows
Qwen2's split pattern, which puts every digit in its own token (so arithmetic is learnable), then
maps bytes to printable characters. The training text is generated here (arithmetic/countdown
style math text, English sentences, Python snippets for the REPL environments); it deliberately does
not import ``recipes/`` (layering), but uses the same phrasing as the task generators there.

Chat template: Qwen2-style ChatML without an injected default system prompt (short prompts keep the
tiny model cheap)::

    <|im_start|>user\\nCompute 3+4*2.<|im_end|>\\n<|im_start|>assistant\\n

EOS for generation is ``<|im_end|>`` (``generation_config.eos_token_id`` lists ``<|im_end|>`` and
``<|endoftext|>``); the pad token is the dedicated ``<|pad|>``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from workers.models.chat_templates import CHATML, chat_template

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: no top_k=0 in generation_config.json (SGLang refuses it)
MARKER_FILE = "hyflow_tiny.json"
VOCAB_SIZE = 1024

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]  # ids 0..3, in this order

# Qwen2's pre-tokeniser pattern: contractions, letter runs (with one leading non-letter), single
# digits, punctuation runs, newlines, whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = CHATML  # workers/models/chat_templates.py: the other families' templates

# Model presets. Parameter counts include the (tied) 1024x hidden embedding.
TINY_MODEL_SIZES: dict[str, dict] = {
    # ~0.2M params: smoke tests only.
    "nano": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256),
    # ~1.1M params: the CPU quickstart default.
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512),
    # ~4.2M params.
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024),
}  # fmt: skip

MAX_POSITION_EMBEDDINGS = 2048

# Architectures (``model.tiny_arch``). "moe": Hugging Face's Qwen3-MoE class over the size preset's attention, every
# layer a mixture of TINY_MOE["num_experts"] experts of half the dense MLP's width with top-2 routing, so a token's
# active MLP is as wide as the dense model's.
TINY_ARCHS = ("dense", "moe")
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.0)


# --------------------------------------------------------------------------------------------------
# Tokenizer training text (generated, seeded)
# --------------------------------------------------------------------------------------------------

_ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.",
    "Please answer the question and show your work.",
    "Let us think step by step.",
    "The answer is correct.",
    "The answer is wrong, try again.",
    "We first multiply, then add and subtract from left to right.",
    "Multiplication comes before addition and subtraction.",
    "Read the context and find the value of the variable.",
    "The document is long, so we split it into chunks and ask a sub-model about each chunk.",
    "What is the capital of France? The capital of France is Paris.",
    "Summarize the following text in one sentence.",
    "This is a small model trained on a laptop for testing.",
    "Reinforcement learning improves the policy with rewards from a verifier.",
    "The user asks a question and the assistant replies.",
    "There are many ways to solve this problem, but one is simple.",
    "If the number is even, divide it by two; otherwise multiply it by three and add one.",
    "The sum of the numbers is the target.",
    "Each number can be used only once.",
    "The final answer should be written in a box.",
    "Hello, how are you today? I am fine, thank you.",
    "Yes. No. Maybe. True. False. None.",
    "The train leaves at nine and arrives at noon.",
    "A list of items: apples, bananas, oranges, and pears.",
    "Count the words in the sentence and report the total.",
    "The secret key is hidden somewhere in the context.",
]
_WORDS = (
    "the a an one two three four five six seven eight nine ten number numbers value values result "
    "sum product difference answer question step steps first then next finally so because we you "
    "it is are was be can must should use using make find compute calculate solve check each only "
    "once with and or not from to of in on at by for as this that these those all any some more "
    "less than equal equals target total left right add subtract multiply divide plus minus times "
    "model data text word words line lines file context chunk query call function variable list "
    "string integer float code python print return output input error true false none small large"
).split()
_PY = [
    "def f(x):\n    return x * 2 + 1\n",
    "print(len(context))\n",
    "chunks = [context[i:i + 1000] for i in range(0, len(context), 1000)]\n",
    'answer = llm_query(f"Find the key in: {chunk}")\n',
    'result = rlm_query("Summarize this part", context=chunk)\n',
    "FINAL(answer)\n",
    "FINAL_VAR(result)\n",
    "for i, line in enumerate(lines):\n    if 'key' in line:\n        print(i, line)\n",
    "import re\nmatches = re.findall(r'\\d+', text)\n",
    "total = sum(int(x) for x in values)\nprint(total)\n",
    "if x > 0:\n    y = x\nelse:\n    y = -x\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n        self.children = []\n",
    "with open('data.txt') as f:\n    text = f.read()\n",
    "```python\nx = 3 + 4 * 2\nprint(x)\n```\n",
]


def _math_expr(rng: random.Random, n: int, ops: str = "+-*") -> str:
    expr = str(rng.randint(1, 9))
    for _ in range(n - 1):
        expr += rng.choice(ops) + str(rng.randint(1, 9))
    return expr


def _tokenizer_corpus(seed: int, n_math: int = 4000, n_english: int = 1500) -> list[str]:
    """Deterministic training text: math in the task generators' phrasing, English, Python."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_math):
        k = rng.randint(2, 5)
        expr = _math_expr(rng, k)
        value = eval(expr)  # noqa: S307 -- our own digits-and-operators string
        kind = rng.random()
        if kind < 0.5:
            lines.append(f"user\nCompute {expr}.\nassistant\n")
            lines.append(f"{expr} = {value}. The answer is \\boxed{{{value}}}.")
        elif kind < 0.8:
            nums = [rng.randint(1, 20) for _ in range(rng.randint(2, 4))]
            target = rng.randint(1, 100)
            lines.append(
                f"Using the numbers {', '.join(map(str, nums))}, make {target}. "
                f"Use each number exactly once with + - * and parentheses."
            )
            lines.append(f"Try ({nums[0]}+{nums[1]})*{nums[-1]} = {target}. \\boxed{{{nums[0]}*{nums[1]}}}")
        else:
            a, m, c = rng.randint(2, 9), rng.choice([7, 11, 13]), rng.randint(0, 10)
            lines.append(f"Find a number x between 0 and 20 such that ({a}*x) % {m} = {c}.")
            lines.append(f"x = {rng.randint(0, 20)}. Check: step {k}: answer \\boxed{{{rng.randint(0, 20)}}}")
    for _ in range(n_english):
        lines.append(rng.choice(["system\n", "user\n", "assistant\n", ""]) + rng.choice(_ENGLISH))
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + ".")
    for _ in range(40):
        lines.extend(_PY)
    rng.shuffle(lines)
    return lines


# --------------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------------


def build_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE tokenizer; returns a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())  # no unk: byte-level covers every input
    tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer (AutoTokenizer loads it as Qwen2Tokenizer)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[ENDOFTEXT, IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def tiny_config(size: str = "tiny", vocab_size: int = VOCAB_SIZE, arch: str = "dense", **overrides):
    """A ``Qwen2Config`` (``arch="moe"``: a ``Qwen3MoeConfig``) for one of ``TINY_MODEL_SIZES`` (keyword overrides
    win)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    if size not in TINY_MODEL_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(TINY_MODEL_SIZES)}")
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {list(TINY_ARCHS)}")
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    kw = dict(
        vocab_size=vocab_size,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD],
        **TINY_MODEL_SIZES[size],
    )
    if arch == "moe":
        kw.pop("use_sliding_window")
        kw.update(TINY_MOE, moe_intermediate_size=kw["intermediate_size"] // 2, decoder_sparse_step=1)
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    kw.update(overrides)
    return Qwen2Config(**kw)


def _is_complete(out_dir: Path) -> dict | None:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    if not all((out_dir / f).is_file() for f in needed):
        return None
    return info


@contextmanager
def _dir_lock(out_dir: Path):
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_tiny_model(
    out_dir: str | os.PathLike,
    size: str = "tiny",
    seed: int = 0,
    overwrite: bool = False,
    arch: str = "dense",
) -> str:
    """Build tokenizer + randomly initialised tiny Qwen2 model (``arch="moe"``: Qwen3-MoE) into ``out_dir``; return
    its path.

    Deterministic: the same ``(size, seed, arch)`` gives byte-identical weights and tokenizer. Idempotent:
    when ``out_dir`` already holds a complete build of the same ``(size, seed)`` nothing is done;
    a different build there is an error unless ``overwrite=True``. Safe against concurrent callers
    (file lock) and interrupted builds (files are written to a temporary directory and moved in, the
    marker file last). Takes a few seconds on one CPU core.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM, Qwen3MoeForCausalLM

    out = Path(out_dir).resolve()
    want = {"format_version": FORMAT_VERSION, "size": size, "seed": seed, "vocab_size": VOCAB_SIZE}
    if arch != "dense":  # a dense build's marker has no "arch" (builds made before MoE stay valid)
        want["arch"] = arch
    if size not in TINY_MODEL_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(TINY_MODEL_SIZES)}")
    with _dir_lock(out):
        info = _is_complete(out)
        if info is not None:
            if all(info.get(k) == v for k, v in want.items()) and info.get("arch", "dense") == arch:
                return str(out)
            if not overwrite:
                raise ValueError(
                    f"{out} already holds a tiny model built with "
                    f"{ {k: info.get(k) for k in want} }, not {want}; pass overwrite=True or another dir"
                )
        elif out.exists() and any(out.iterdir()) and not overwrite:
            raise ValueError(f"{out} exists, is not empty and holds no complete tiny model build")
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            tokenizer = build_tokenizer(seed=seed)
            tokenizer.save_pretrained(tmp)
            config = tiny_config(size, vocab_size=len(tokenizer), arch=arch)
            state = torch.random.get_rng_state()
            try:
                torch.manual_seed(seed)
                model = (Qwen3MoeForCausalLM if arch == "moe" else Qwen2ForCausalLM)(config)
            finally:
                torch.random.set_rng_state(state)
            model.generation_config = GenerationConfig(
                eos_token_id=[
                    tokenizer.convert_tokens_to_ids(IM_END),
                    tokenizer.convert_tokens_to_ids(ENDOFTEXT),
                ],
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,  # no top_k: serving engines (SGLang) refuse HF's 0-means-off
            )
            model.save_pretrained(tmp, safe_serialization=True)
            n_params = sum(p.numel() for p in model.parameters())
            (tmp / MARKER_FILE).write_text(json.dumps({**want, "num_parameters": n_params}, indent=1) + "\n")
            out.mkdir(parents=True, exist_ok=True)
            marker_tmp = tmp / MARKER_FILE
            (out / MARKER_FILE).unlink(missing_ok=True)
            for f in sorted(tmp.iterdir()):
                if f != marker_tmp:
                    os.replace(f, out / f.name)
            os.replace(marker_tmp, out / MARKER_FILE)  # last: marks the build complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info(
            "built tiny model size=%s seed=%d (%d params, vocab %d) in %s in %.1fs",
            size, seed, n_params, len(tokenizer), out, time.perf_counter() - t0,
        )  # fmt: skip
    return str(out)


def default_tiny_dir(size: str = "tiny", seed: int = 0, arch: str = "dense") -> str:
    """Where ``ensure_tiny_model`` keeps a build: ``$HYFLOW_CACHE`` or ``~/.cache/hyflow``."""
    root = os.environ.get("HYFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hyflow")
    name = size if arch == "dense" else f"{size}-{arch}"
    return os.path.join(root, f"tiny-{name}-v{FORMAT_VERSION}-seed{seed}")


def ensure_tiny_model(
    size: str = "tiny", seed: int = 0, chat_template: str = "chatml", arch: str = "dense"
) -> str:
    """Build (once) and return the path of the cached tiny model for ``(size, seed, arch)``; ``chat_template`` (a
    name in ``workers.models.chat_templates``) gives the same weights and tokenizer with that family's template."""
    base = build_tiny_model(default_tiny_dir(size, seed, arch), size=size, seed=seed, arch=arch)
    if chat_template == "chatml":
        return base
    return _with_template(base, chat_template)


def _with_template(base: str, name: str) -> str:
    """A copy of the model directory ``base`` whose tokenizer has the chat template ``name`` (built once)."""
    from transformers import AutoTokenizer

    template = chat_template(name)
    digest = hashlib.sha256(template.encode()).hexdigest()[:16]  # a changed template rebuilds the copy
    out = Path(f"{base}-{name}")
    with _dir_lock(out):
        marker = out / MARKER_FILE
        if marker.is_file() and json.loads(marker.read_text()).get("chat_template") == [name, digest]:
            return str(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            for f in Path(base).iterdir():
                if f.is_file() and f.name != MARKER_FILE:
                    shutil.copy2(f, tmp / f.name)
            tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
            tok.chat_template = template
            tok.save_pretrained(tmp)
            info = json.loads((Path(base) / MARKER_FILE).read_text())
            out.mkdir(parents=True, exist_ok=True)
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
            marker.write_text(json.dumps({**info, "chat_template": [name, digest]}, indent=1) + "\n")  # last
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
