"""The embedded tiny model: deterministic build, HF loading, tokenizer behaviour, chat template."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from workers.models.tiny import (
    MARKER_FILE,
    SPECIAL_TOKENS,
    TINY_MODEL_SIZES,
    VOCAB_SIZE,
    build_tiny_model,
    tiny_config,
)


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_build_is_deterministic_and_idempotent(tmp_path, tiny_dir):
    again = build_tiny_model(tmp_path / "again", size="tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(os.path.join(again, name)) == _digest(os.path.join(tiny_dir, name))
    mtime = os.path.getmtime(os.path.join(again, "model.safetensors"))
    assert build_tiny_model(tmp_path / "again", size="tiny", seed=0) == again  # skipped: already complete
    assert os.path.getmtime(os.path.join(again, "model.safetensors")) == mtime
    other = build_tiny_model(tmp_path / "other", size="tiny", seed=1)
    assert _digest(os.path.join(other, "model.safetensors")) != _digest(
        os.path.join(again, "model.safetensors")
    )
    with pytest.raises(ValueError, match="overwrite=True"):
        build_tiny_model(tmp_path / "again", size="nano", seed=0)
    build_tiny_model(tmp_path / "again", size="nano", seed=0, overwrite=True)
    assert json.load(open(tmp_path / "again" / MARKER_FILE))["size"] == "nano"
    # an interrupted build (no marker) is rebuilt, not trusted
    os.remove(tmp_path / "other" / MARKER_FILE)
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_model(tmp_path / "other", size="tiny", seed=1)
    build_tiny_model(tmp_path / "other", size="tiny", seed=1, overwrite=True)
    assert (tmp_path / "other" / MARKER_FILE).is_file()
    with pytest.raises(ValueError, match="unknown tiny model size"):
        build_tiny_model(tmp_path / "x", size="huge")


def test_from_pretrained_and_forward(tiny_dir, tok):
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert isinstance(model, Qwen2ForCausalLM)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 10_000_000
    assert model.config.vocab_size == len(tok) == VOCAB_SIZE
    ids = torch.tensor([tok("Compute 1+2.")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE) and torch.isfinite(logits).all()
    gc = model.generation_config
    assert tok.convert_tokens_to_ids("<|im_end|>") in gc.eos_token_id and gc.pad_token_id == tok.pad_token_id
    # sampling defaults a serving engine accepts: SGLang's server answered every request with a 400 for top_k=0
    saved = json.loads((Path(tiny_dir) / "generation_config.json").read_text())
    assert "top_k" not in saved and saved["do_sample"] is True and saved["temperature"] == 1.0


def test_exported_generation_config_drops_top_k_zero_and_keeps_a_real_top_k(tmp_path):
    from transformers import GenerationConfig

    from workers.engine.checkpoint import servable_generation_config

    for top_k, expect in ((0, None), (20, 20)):
        original = GenerationConfig(do_sample=True, top_k=top_k)
        servable_generation_config(original).save_pretrained(tmp_path / str(top_k))
        saved = json.loads((tmp_path / str(top_k) / "generation_config.json").read_text())
        assert saved.get("top_k") == expect and original.top_k == top_k  # the engine's own copy is untouched


def test_sizes():
    for size in TINY_MODEL_SIZES:
        cfg = tiny_config(size)
        assert cfg.hidden_size % cfg.num_attention_heads == 0
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
        assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings


def test_special_tokens(tok):
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == [0, 1, 2, 3]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.pad_token_id == 3
    assert tok.padding_side == "left"
    # special tokens are atomic in text
    assert tok("<|im_start|>user<|im_end|>", add_special_tokens=False)["input_ids"][0] == 1
    assert tok("x", add_special_tokens=True)["input_ids"] == tok("x", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "text",
    [
        "Compute 3+4*2-1.",
        "3+4*2-1 = 3+8-1 = 11-1 = 10. The answer is \\boxed{10}.",
        "def f(x):\n    return x * 2  # comment\n\n",
        "Ünïcödé text, emoji 🙂 and tabs\tand  double  spaces",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_digits_tokenize_individually(tok):
    for text in ["1234567890", "x=2048", "3+45*678", " 99 bottles"]:
        toks = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
        digits = [t for t in toks if any(c.isdigit() for c in t)]
        assert digits and all(len(t) == 1 for t in digits), toks
    assert len(tok("12345678901234567890", add_special_tokens=False)["input_ids"]) == 20


def test_vocab_is_useful(tok):
    # common words of the task/REPL text are single tokens (the BPE learnt them)
    for word in ["Compute", " answer", " numbers", "assistant", "user"]:
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Compute 1+2."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *msgs, {"role": "assistant", "content": "3"}],
        tokenize=False,
    )
    assert full == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompute 1+2.<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1
