"""Packed documents: ``forward(idx, cu_seqlens=...)`` equals one forward per document.

Positions (learned, sinusoidal, rotary) restart at 0 in each document and every block's mixer
restarts there, so the logits and the parameter gradients of a packed row are those of the
documents run apart (float64, odd sizes, an empty document and one of one token).
"""

from __future__ import annotations

import pytest
import torch

from aftlab.mixers.base import document_positions
from aftlab.testing import assert_close

from .helpers import small_lm

#: documents of 4, 1, 0, 7 and 5 tokens in a row of 17
OFFSETS = [0, 4, 5, 5, 12, 17]

#: (mixer, config keywords): every kind of position, every built-in mixer
MODELS = [
    ("attention", dict(positional="learned")),
    ("attention", dict(positional="rotary", head_dim=6)),
    ("attention-naive", dict(positional="sinusoidal")),
    ("aft-full", {}),
    ("aft-local", {}),
    ("aft-simple", dict(positional="none")),
    ("aft-decay", {}),
    ("aft-conv", dict(positional="sinusoidal")),
]
IDS = [f"{n}-{kw.get('positional', 'learned')}" for n, kw in MODELS]


def _cu(offsets) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("name, kw", MODELS, ids=IDS)
def test_packed_documents_equal_separate_forwards(name, kw):
    torch.manual_seed(0)
    model = small_lm(name, **kw)
    idx = torch.randint(0, 29, (1, OFFSETS[-1]))
    weights = torch.randn(1, OFFSETS[-1], 29, dtype=torch.float64)
    names, params = zip(*model.named_parameters(), strict=True)

    def grads(logits):
        return torch.autograd.grad((logits.tanh() * weights).sum(), params)

    packed = model(idx, cu_seqlens=_cu(OFFSETS))
    docs = [(a, b) for a, b in zip(OFFSETS, OFFSETS[1:], strict=False) if b > a]
    apart = torch.cat([model(idx[:, a:b]) for a, b in docs], 1)
    assert_close(f"{name}: packed logits", packed, apart)
    for n, a, e in zip(names, grads(packed), grads(apart), strict=True):
        assert_close(f"{name}: d{n}", a, e)
    # the documents do see each other without cu_seqlens: the check above can fail
    assert (model(idx)[:, 5:] - apart[:, 5:]).abs().max() > 1e-6


def test_one_document_is_the_plain_forward():
    model = small_lm("attention", positional="rotary", head_dim=6)
    idx = torch.randint(0, 29, (1, 9))
    assert_close("one document", model(idx, cu_seqlens=_cu([0, 9])), model(idx))


def test_document_positions_restart():
    doc, pos = document_positions([0, 2, 2, 5])
    assert doc.tolist() == [0, 0, 2, 2, 2] and pos.tolist() == [0, 1, 0, 1, 2]
    _, pos = document_positions([0, 2, 2, 5], start=3)  # the first continues a state at 3
    assert pos.tolist() == [3, 4, 0, 1, 2]
    doc, pos = document_positions([0, 0, 2], start=3)  # the first non-empty one continues
    assert doc.tolist() == [1, 1] and pos.tolist() == [3, 4]


def test_learned_positions_limit_each_document():
    """A packed row may be longer than ``max_seq_len``; each document may not."""
    model = small_lm("aft-simple", max_seq_len=10)
    idx = torch.randint(0, 29, (1, 18))
    packed = model(idx, cu_seqlens=_cu([0, 8, 18]))
    assert_close("a row of 18", packed, torch.cat([model(idx[:, :8]), model(idx[:, 8:])], 1))
    with pytest.raises(ValueError, match="exceeds the learned positional table"):
        model(idx, cu_seqlens=_cu([0, 7, 18]))


def test_length_limited_mixers_limit_each_document():
    model = small_lm("aft-full", max_seq_len=10, positional="sinusoidal")
    idx = torch.randint(0, 29, (1, 18))
    model(idx, cu_seqlens=_cu([0, 8, 18]))
    with pytest.raises(ValueError, match=r"document length 11 \(tokens 7..17 of 'cu_seqlens'\)"):
        model(idx, cu_seqlens=_cu([0, 7, 18]))


def test_packed_bad_input():
    model = small_lm("attention")
    idx = torch.randint(0, 29, (1, 6))
    with pytest.raises(ValueError, match="'cu_seqlens' or 'padding_mask', not both"):
        model(idx, cu_seqlens=_cu([0, 6]), padding_mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="'cu_seqlens' packs documents into a batch of one row"):
        model(idx.expand(2, -1), cu_seqlens=_cu([0, 6]))
    with pytest.raises(TypeError, match="'cu_seqlens' must have dtype torch.int32"):
        model(idx, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"'cu_seqlens' must run from 0 to the sequence length 6"):
        model(idx, cu_seqlens=_cu([0, 5]))
    with pytest.raises(ValueError, match="'cu_seqlens' must be non-decreasing"):
        model(idx, cu_seqlens=_cu([0, 4, 2, 6]))
