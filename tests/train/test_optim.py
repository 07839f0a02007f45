import math

import pytest
import torch

from aftlab.models import TransformerConfig, TransformerLM
from aftlab.train.optim import build_optimizer, lr_at, param_groups


def test_weight_decay_on_matrices_only():
    cfg = TransformerConfig(
        vocab_size=20, d_model=8, n_layers=1, n_heads=2, max_seq_len=6, mixer="aft-full"
    )
    model = TransformerLM(cfg)
    decay, other = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and other["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in other["params"]}
    assert decayed and all(n.endswith(".weight") for n in decayed)
    assert not any("embedding" in n or "norm" in n for n in decayed)
    assert any("embedding" in n for n in kept) and any(n.endswith(".bias") for n in kept)
    # the AFT-full position bias (w, or its factors u, v) is not decayed
    assert any(n.rsplit(".", 1)[-1] in ("w", "u", "v") for n in kept)
    # every parameter once, tied head included once
    assert len(decay["params"]) + len(other["params"]) == len({id(p) for p in model.parameters()})


def test_optimizer_is_adamw_with_both_groups():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.5, betas=[0.8, 0.9])
    assert isinstance(opt, torch.optim.AdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_lr_schedule_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup=4, steps=14)
    assert [lr_at(t, **kw) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)
    lrs = [lr_at(t, **kw) for t in range(4, 15)]
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True))
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup=0, steps=10) == 1.0
