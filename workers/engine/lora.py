"""LoRA on the training model, with peft: adapters added before sharding, the base frozen, and the weights
the rest of hyflow needs in Hugging Face form.

peft wraps the model (``PeftModelForCausalLM``), renaming every parameter
(``base_model.model.<hf name>``, ``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``). FSDP2's
``fully_shard`` takes the wrapped model as is (frozen and trainable parameters in one group; a 2-rank step's
adapter gradients equal one process's exactly: tests/workers/engine/test_lora.py). What leaves the engine is
named as the base model names it:

* `merged_named_tensors`: every weight with its adapter folded in (``W + alpha / r * B @ A``), under the base
  model's names: what a rollout engine without adapter support loads, and the merged export;
* `adapter_named_tensors`: the adapter weights alone, under PEFT's file names (what ``save_pretrained`` writes
  and ``PeftModel.from_pretrained`` reads), for adapter-only weight sync and the adapter export.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workers.engine.base import LoRAConfig

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def peft_config(lora: LoRAConfig):
    from peft import LoraConfig

    targets = lora.target_modules
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; it only divides it by r
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def write_peft_adapter(
    out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], lora: LoRAConfig, base_model_path: str
) -> None:
    """An adapter directory as peft writes one (``adapter_config.json`` + ``adapter_model.safetensors``):
    ``PeftModel.from_pretrained(<the base model>, out_dir)`` loads it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora)
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def add_adapters(model: nn.Module, lora: LoRAConfig, *, where: str = "actor.lora") -> nn.Module:
    """``model`` wrapped by peft with freshly initialised adapters (A random from the caller's RNG, B zero:
    the wrapped model computes exactly what ``model`` did); only adapter parameters require gradients. A
    target that names no module of ``model`` is a ValueError naming it (peft itself only refuses a list of
    which nothing matches)."""
    from peft import get_peft_model

    if lora.target_modules != ["all-linear"]:
        names = [n for n, _ in model.named_modules()]
        missing = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            linear = sorted(
                {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            )
            raise ValueError(
                f"{where}.target_modules: {missing} name no module of {type(model).__name__} "
                f"(its linear modules: {linear})"
            )
    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as err:  # peft refuses a target that is not a layer it can adapt
        raise ValueError(f"{where}.target_modules={lora.target_modules}: {err}") from None


def target_module_errors(model_path: str, lora: LoRAConfig, *, trust_remote_code: bool = False) -> list[str]:
    """What is wrong with ``lora.target_modules`` for the model at ``model_path``, found on a meta-device copy
    of the model (no weights read), before any worker starts."""
    from transformers import AutoModelForCausalLM

    from workers.models.loading import load_config

    config = load_config(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:
        add_adapters(model, lora)
    except ValueError as err:
        return [str(err)]
    return []


def base_name(peft_name: str) -> str:
    """The base model's name of a wrapped parameter (``base_model.model.x.q_proj.base_layer.weight`` ->
    ``x.q_proj.weight``)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def adapter_file_name(peft_name: str) -> str:
    """PEFT's file name of an adapter parameter (the adapter's own name left out, as ``save_pretrained``
    writes it)."""
    return peft_name.replace(f".{ADAPTER}.", ".")


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """The wrapped modules (peft's LoRA layers), by their name in ``model``."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_named_tensors(
    model: nn.Module, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model name, full tensor) of every parameter with the adapters folded in. Each wrapped layer's weight is gathered with its A and B (FSDP: one all-gather per tensor, in the
    same order on every rank, so every rank must consume the iterator to the end)."""
    layers = lora_layers(model)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # layer name -> its gathered base weight, A, B
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        layer_name = next((ln for ln in _prefixes(owner) if ln in layers), None)
        if layer_name is None:
            yield base_name(name), _full(p).to(device=device, dtype=dtype or p.dtype)
            continue
        # base_layer.weight | base_layer.bias | lora_A.default.weight | ...
        part = name[len(layer_name) + 1 :]
        if part == "base_layer.bias":
            yield base_name(name), _full(p).to(device=device, dtype=dtype or p.dtype)
            continue
        parts = pending.setdefault(layer_name, {})
        parts[part.split(".", 1)[0]] = _full(p)
        if {"base_layer", "lora_A", "lora_B"} <= parts.keys():
            del pending[layer_name]
            w, a, b = parts["base_layer"], parts["lora_A"], parts["lora_B"]
            scale = layers[layer_name].scaling[ADAPTER]
            merged = (w.float() + scale * (b.float() @ a.float())).to(dtype or w.dtype)
            yield base_name(f"{layer_name}.base_layer.weight"), merged.to(device)
    if pending:
        raise RuntimeError(f"LoRA layers with parts missing after the parameters: {sorted(pending)}")


def _prefixes(dotted: str) -> Iterator[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``: the modules that may own a parameter of ``a.b.c``."""
    while dotted:
        yield dotted
        dotted = dotted.rpartition(".")[0]


@torch.no_grad()
def adapter_named_tensors(
    model: nn.Module, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT file name, full tensor) of every adapter parameter; collective like `merged_named_tensors`."""
    for name, p in model.named_parameters():
        if ".lora_" in name:
            yield adapter_file_name(name), _full(p).to(device=device, dtype=dtype or p.dtype)
