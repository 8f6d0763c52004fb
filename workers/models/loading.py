"""Load Hugging Face causal LMs (Qwen2, Qwen3, Llama, ...) and their tokenizers from a local directory.

Everything is loaded with ``local_files_only=True``: a model path is a directory on this machine, never a
hub id that would be downloaded. Errors name the path (and the missing file).

Critics use the same model classes with a scalar head: ``<Arch>ForTokenClassification(num_labels=1)`` where
transformers has one for the architecture (Qwen2, Qwen3, Llama, Mistral, ...), else :class:`ValueHeadModel`
(the base model plus a ``Linear(hidden, 1)`` named ``score``). Either way ``model(...).logits`` has shape
[batch, seq, 1] and the value head is randomly initialised from the seed set by the caller.

Sharded training builds models on the meta device instead (`build_on_meta`, then `meta_init.materialize`
after sharding): each rank reads only its pieces of the safetensors files, or draws only its pieces of a
random-init directory's seeded weights (`meta_init.write_random_init_model`: real shapes, no weights file).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_outputs import TokenClassifierOutput

from workers.models.attention import VARLEN_ATTENTION, register_varlen_attention
from workers.models.meta_init import (
    CheckpointWeights,
    RandomWeights,
    WeightSource,
    materialize,
    parameters_on_meta,
    random_init_seed,
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32'/'fp32', 'bfloat16'/'bf16', 'float16'/'fp16' or a torch.dtype -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def check_model_dir(path: str | os.PathLike, *, need_weights: bool = False) -> Path:
    """The model directory as a Path; FileNotFoundError naming the path or the missing config.json."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model path {str(p)!r} does not exist (models are loaded from local directories only)"
        )
    if not p.is_dir():
        raise NotADirectoryError(f"model path {str(p)!r} is not a directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(p)!r} has no config.json (missing file: {str(p / 'config.json')!r})"
        )
    if need_weights and not any((p / f).is_file() for f in _WEIGHT_FILES):
        raise FileNotFoundError(
            f"model path {str(p)!r} has no weights (looked for {', '.join(_WEIGHT_FILES)})"
        )
    return p


def load_config(path: str | os.PathLike, *, trust_remote_code: bool = False, **overrides) -> PretrainedConfig:
    """The model's config with ``overrides`` applied (e.g. ``attn_implementation``)."""
    p = check_model_dir(path)
    config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def load_tokenizer(
    path: str | os.PathLike,
    *,
    padding_side: str = "left",
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """Tokenizer from a local directory, with a pad token guaranteed.

    If the tokenizer has no pad token, the EOS token is used as pad (the usual choice for Llama-style
    tokenizers; padding positions are masked everywhere so the id itself never matters). ``padding_side``
    defaults to "left", the layout of `prompts` in BATCH_LAYOUT.md.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise OSError(f"could not load a tokenizer from {str(p)!r}: {e}") from e
    ensure_pad_token(tok)
    tok.padding_side = padding_side
    return tok


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """Set ``pad_token`` to the EOS token when missing; returns the pad id."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has neither a pad nor an EOS token; "
                "set one explicitly"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer.pad_token_id


def pad_token_id_of(tokenizer: PreTrainedTokenizerBase | None, config: PretrainedConfig | None = None) -> int:
    """Pad id from the tokenizer, else config.pad_token_id, else config.eos_token_id, else 0."""
    if tokenizer is not None:
        return ensure_pad_token(tokenizer)
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(config, attr, None) if config is not None else None
        if isinstance(v, list | tuple):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


class ValueHeadModel(nn.Module):
    """Base transformer + ``score = Linear(hidden, 1)``: the critic for architectures that lack a
    ``*ForTokenClassification`` class. ``forward`` mirrors the HF signature and returns ``.logits`` [B, T, 1]."""

    def __init__(self, base: PreTrainedModel):
        super().__init__()
        self.model = base
        self.config = base.config
        hidden = base.config.get_text_config().hidden_size
        self.score = nn.Linear(hidden, 1, bias=True)
        nn.init.normal_(self.score.weight, std=getattr(base.config, "initializer_range", 0.02))
        nn.init.zeros_(self.score.bias)
        self._no_split_modules = getattr(base, "_no_split_modules", None)

    def activation_checkpointing_enable(self, **kwargs):
        enable = (
            getattr(self.model, "activation_checkpointing_enable", None)
            or self.model.gradient_checkpointing_enable
        )
        if enable is self.model.gradient_checkpointing_enable and "activation_checkpointing_kwargs" in kwargs:
            kwargs = {"gradient_checkpointing_kwargs": kwargs.pop("activation_checkpointing_kwargs")}
        enable(**kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden.to(self.score.weight.dtype)))


def model_from_config(
    config: PretrainedConfig,
    *,
    value_head: bool = False,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
) -> nn.Module:
    """A causal LM (or a critic with a scalar head) of ``config``'s architecture with freshly initialised
    weights; inside `meta_init.parameters_on_meta` it costs no memory."""
    torch_dtype = resolve_dtype(dtype)
    kwargs: dict = dict(trust_remote_code=trust_remote_code, dtype=torch_dtype)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if not value_head:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    _as_value_config(config)
    if type(config) in AutoModelForTokenClassification._model_mapping:
        return AutoModelForTokenClassification.from_config(config, **kwargs)
    return ValueHeadModel(AutoModel.from_config(config, **kwargs)).to(torch_dtype)


def _as_value_config(config: PretrainedConfig) -> None:
    config.num_labels = 1
    config.classifier_dropout = 0.0  # a value head must be deterministic in train mode


def weight_source(path: str | os.PathLike, config: PretrainedConfig) -> WeightSource | None:
    """Where the weights of the model directory ``path`` can be read piece by piece: its random init (a
    random-init directory), its safetensors files, else None (e.g. ``pytorch_model.bin`` only)."""
    seed = random_init_seed(path)
    if seed is not None:
        return RandomWeights(seed, std=getattr(config, "initializer_range", 0.02))
    if CheckpointWeights.available(path):
        return CheckpointWeights(path)
    return None


def _register_attention(attn_implementation: str | None) -> None:
    if attn_implementation == VARLEN_ATTENTION:
        register_varlen_attention()


def build_on_meta(
    path: str | os.PathLike,
    *,
    value_head: bool = False,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    config_overrides: dict | None = None,
) -> tuple[nn.Module, WeightSource]:
    """The model of directory ``path`` with its parameters on the meta device, and the `WeightSource` that
    `meta_init.materialize` fills it from (after sharding, each rank reads only its pieces). ValueError when
    the weights cannot be read piece by piece (no safetensors; a critic's new head on a checkpoint)."""
    p = check_model_dir(path)
    _register_attention(attn_implementation)
    config = load_config(p, trust_remote_code=trust_remote_code, **(config_overrides or {}))
    source = weight_source(p, config)
    if source is None or (value_head and isinstance(source, CheckpointWeights)):
        raise ValueError(
            f"model {str(p)!r} cannot be built on the meta device (no safetensors, or a new head)"
        )
    with parameters_on_meta():
        model = model_from_config(
            config,
            value_head=value_head,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    if (p / "generation_config.json").is_file():  # what from_pretrained would have read
        # torch types Module.__setattr__ for Tensor | Module values only; any value is accepted
        model.generation_config = GenerationConfig.from_pretrained(p)  # type: ignore[assignment]
    return model, source


def can_build_on_meta(path: str | os.PathLike, *, value_head: bool = False) -> bool:
    """Whether `build_on_meta` takes ``path``: a random-init directory, or safetensors for a causal LM (a
    critic's head is new, and keeps Hugging Face's own init through `load_model`)."""
    if random_init_seed(path) is not None:
        return True
    return not value_head and CheckpointWeights.available(path)


def load_model(
    path: str | os.PathLike,
    *,
    value_head: bool = False,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    config_overrides: dict | None = None,
) -> nn.Module:
    """Load a causal LM (``value_head=False``) or a critic with a scalar head (``value_head=True``).

    ``attn_implementation`` is any name transformers knows, including ``"hyflow_varlen"`` from
    ``workers.models.attention`` (registered on import). Returns the model on ``device`` in ``dtype``. A
    random-init directory (`meta_init.write_random_init_model`) gives its seeded weights.
    """
    model: nn.Module  # not PreTrainedModel: its ``to`` is wrapped by functools.wraps, which mypy cannot bind
    if random_init_seed(path) is not None:
        model, source = build_on_meta(
            path,
            value_head=value_head,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            config_overrides=config_overrides,
        )
        return materialize(model, source, device=device)
    p = check_model_dir(path, need_weights=True)
    torch_dtype = resolve_dtype(dtype)
    _register_attention(attn_implementation)
    config = load_config(p, trust_remote_code=trust_remote_code, **(config_overrides or {}))
    kwargs: dict[str, Any] = dict(
        local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch_dtype
    )
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        if not value_head:
            model = AutoModelForCausalLM.from_pretrained(p, config=config, **kwargs)
        else:
            _as_value_config(config)
            if type(config) in AutoModelForTokenClassification._model_mapping:
                model = AutoModelForTokenClassification.from_pretrained(p, config=config, **kwargs)
            else:
                base = AutoModel.from_pretrained(p, config=config, **kwargs)
                model = ValueHeadModel(base).to(torch_dtype)
    except (OSError, ValueError, KeyError) as e:
        raise type(e)(f"could not load model from {str(p)!r}: {e}") from e
    return model.to(device)


def is_value_model(model: nn.Module) -> bool:
    """True for critics loaded by :func:`load_model` with ``value_head=True``."""
    if isinstance(model, ValueHeadModel):
        return True
    return type(model).__name__.endswith("ForTokenClassification")
