"""The engines' optimizer (workers/engine/optim.py): fused AdamW where the parameters allow it, with the
update of the per-tensor AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.engine.base import OptimConfig
from workers.engine.optim import build_optimizer


def test_fused_adamw_makes_the_per_tensor_update():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0)
    optimizer, schedule = build_optimizer(model, cfg)
    assert optimizer is not None and schedule is not None and optimizer.defaults["fused"] is True
    plain = torch.optim.AdamW(
        reference.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=cfg.eps, foreach=False
    )
    for _ in range(5):
        x = torch.randn(8, 16)
        for m, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(next(model.parameters()), next(initial.parameters()), atol=1e-3)  # it moved


def test_forward_only_engine_gets_no_optimizer():
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, None) == (None, None)
    assert not any(p.requires_grad for p in model.parameters())


def test_betas_from_a_yaml_list_become_a_tuple_and_bad_betas_are_refused():
    """OmegaConf hands a YAML pair over as a list on Python 3.12 (the GPU image's; the rehearsal of
    benchmarks/gpu_check.sh caught test_config's quickstart case); the config holds one type either way."""
    assert OptimConfig(betas=[0.9, 0.95]).betas == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\), got \[0.9, 1.0\]"):
        OptimConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas must be two numbers"):
        OptimConfig(betas=[0.9])
