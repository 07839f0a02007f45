"""Helpers for tests and benchmarks: comparisons whose failures name the tensor, and mixer drivers.

Example:
    >>> import torch
    >>> from aftlab.mixers import build_mixer
    >>> m = perturb_parameters(build_mixer("aft-simple", d_model=8, causal=True))
    >>> x = torch.randn(2, 5, 8)
    >>> y, state = decode(m, x)  # five calls of m.step
    >>> assert_close("decode vs forward", y, m(x))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = [
    "assert_close",
    "assert_same_state",
    "default_tolerance",
    "max_error",
    "decode",
    "perturb_parameters",
]

_TOL = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing a result in ``dtype`` with a float64 reference."""
    return _TOL.get(dtype, (1e-5, 1e-4))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64."""
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0


def assert_close(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    precision: torch.dtype | None = None,
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise, naming ``name``.

    Tolerances default to :func:`default_tolerance` of ``precision``, the dtype ``actual`` was
    computed in, which is ``actual.dtype`` unless given: a value stored wider than it was
    computed (a float64 state field summed from float32 keys) is compared at the narrower
    precision, since its last bits follow the CPU's summation order. The comparison runs in
    float64, so a low-precision result can be checked against a float64 reference directly.
    Non-finite values in ``actual`` fail unless ``expected`` has the same non-finite value there.
    """
    d_atol, d_rtol = default_tolerance(actual.dtype if precision is None else precision)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    bad_finite = ~torch.isfinite(a) & ~(a == e)
    if bad_finite.any():
        idx = tuple(bad_finite.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int(bad_finite.sum())} non-finite value(s), first at {idx}: "
            f"got {a[idx].item()}, expected {e[idx].item()}"
        )
    err = (a - e).abs()
    tol = atol + rtol * e.abs()
    over = err > tol
    if over.any():
        flat = int((err - tol).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        raise AssertionError(
            f"{name}: {int(over.sum())}/{err.numel()} elements out of tolerance "
            f"(atol={atol:g}, rtol={rtol:g}); max abs error {err.max().item():.3e}; "
            f"worst at {idx}: got {a[idx].item():.10g}, expected {e[idx].item():.10g}"
        )


def assert_same_state(name: str, actual: Any, expected: Any, precision: torch.dtype) -> None:
    """Assert two decoding states equal, field by field (dataclasses, nested ones and lists too).

    Tensors are compared by :func:`assert_close` at ``precision``, the dtype of the model that
    computed them (a float64 field of a float32 model holds float32 sums, whose last bits
    depend on the CPU's summation order), and must have the same dtype; other values must be
    equal. A failure names the field (``name: gone.a``).
    """
    assert type(actual) is type(expected), (
        f"{name}: {type(actual).__name__} != expected {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
        assert_close(name, actual, expected, precision=precision)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            a, e = getattr(actual, f.name), getattr(expected, f.name)
            assert_same_state(f"{name}: {f.name}", a, e, precision)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{name}: {len(actual)} != {len(expected)} items"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(f"{name}[{i}]", a, e, precision)
    else:
        assert actual == expected, f"{name} = {actual!r}, expected {expected!r}"


def decode(mixer: nn.Module, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
    """Feed ``x: (B, T, d)`` to a causal mixer's ``step`` one token at a time.

    Starts from ``state``, or from ``mixer.init_state(B)`` when it is None, and returns
    ``(y, state)``: the stacked outputs ``y: (B, T, d)`` (``y[:, t]`` is ``step``'s output for
    ``x[:, t]``) and the state after the ``T`` tokens, from which decoding continues.
    """
    if state is None:
        state = mixer.init_state(x.shape[0])
    ys = []
    for t in range(x.shape[1]):
        y_t, state = mixer.step(x[:, t], state)
        ys.append(y_t)
    return (torch.stack(ys, 1) if ys else x.new_zeros(x.shape)), state


@torch.no_grad()
def perturb_parameters(module: nn.Module, scale: float = 0.3) -> nn.Module:
    """Add ``N(0, scale^2)`` noise to every parameter of ``module`` in place; returns ``module``.

    Mixers start with parameters at 0 (AFT position biases ``V``, AFT-conv's ``gamma`` and
    ``beta``), under which whole paths, and the gradients of the factors beside them, vanish; a
    test that perturbs them first sees every path.
    """
    for p in module.parameters():
        p.add_(scale * torch.randn_like(p))
    return module
