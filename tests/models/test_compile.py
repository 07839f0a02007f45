"""``torch.compile(fullgraph=True)``: every mixer's model traces in one graph, forward and backward.

``fullgraph=True`` raises on any graph break, and a host sync in the forward (``.item()``,
``bool(tensor)``, a Python branch on data) is one: so this is the test that no forward or backward
pass reads tensor values back to the host. The compiled model must also match eager. Both
implementations of the AFT ops run: the C++ kernels (through their fake implementations,
``aftlab/kernels/{scan,band,full}.py``) and the PyTorch ops (what CUDA runs; their hand-written
backwards are opaque custom ops, ``aftlab::lse_average``, ``stable_prefix_average``, ``aft_conv``).
"""

from __future__ import annotations

import pytest
import torch

from aftlab import kernels
from aftlab.mixers import available_mixers
from aftlab.models import TransformerClassifier, TransformerConfig, TransformerLM
from aftlab.testing import assert_close

V, B, T = 11, 2, 7


def _config(mixer: str, causal: bool) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=V, d_model=8, n_layers=2, n_heads=2, max_seq_len=12, mixer=mixer,
        causal=causal, dropout=0.0,
    )


def _model(mixer: str, causal: bool) -> torch.nn.Module:
    cfg = _config(mixer, causal)
    model = TransformerLM(cfg) if causal else TransformerClassifier(cfg, num_classes=3)
    return model.double()


def _supports(mixer: str, causal: bool) -> bool:
    try:
        _model(mixer, causal)
    except ValueError:  # e.g. aft-decay is causal only
        return False
    return True


_SLOW = ("aft-conv",)  # its PyTorch op took 8-40 s to compile while it was unrolled (now ~3 s)


def _case(mixer: str, causal: bool, impl: str):
    marks = [pytest.mark.slow] if impl == "pytorch" and mixer in _SLOW else []
    name = f"{mixer}-{'causal' if causal else 'bidirectional'}-{impl}"
    return pytest.param(mixer, causal, impl, id=name, marks=marks)


CASES = [
    _case(m, c, impl)
    for impl in ("kernel", "pytorch")
    for m in available_mixers()
    for c in (True, False)
    if _supports(m, c)
]


def _forward_backward(model: torch.nn.Module, run, idx: torch.Tensor, mask: torch.Tensor):
    """Output and parameter gradients of ``run`` (``model`` or its compiled form)."""
    model.zero_grad(set_to_none=True)
    out = run(idx, padding_mask=mask)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("mixer", "causal", "impl"), CASES)
def test_compiled_model_matches_eager_in_one_graph(mixer: str, causal: bool, impl: str):
    if impl == "kernel" and not kernels.load():
        pytest.skip(f"kernels unavailable: {kernels.status()['aft_simple'][1]}")
    with kernels.use_kernels(impl == "kernel"):
        _check_compiled(mixer, causal)


def _check_compiled(mixer: str, causal: bool) -> None:
    torch._dynamo.reset()
    model = _model(mixer, causal)
    idx = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, T - 2 :] = False  # right padding (left padding for an encoder changes nothing)
    want_out, want_grads = _forward_backward(model, model, idx, mask)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got_out, got_grads = _forward_backward(model, compiled, idx, mask)
    assert_close(f"{mixer} output", got_out, want_out)
    for name, grad in want_grads.items():
        assert grad is not None, name
        assert_close(f"{mixer} d/d{name}", got_grads[name], grad)
