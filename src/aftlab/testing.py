"""Comparison helpers for tests and benchmarks: every failure names the tensor."""

from __future__ import annotations

import torch

__all__ = ["assert_close", "default_tolerance", "max_error"]

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
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise, naming ``name``.

    Tolerances default to :func:`default_tolerance` of ``actual.dtype``. The comparison runs in
    float64, so a low-precision result can be checked against a float64 reference directly.
    Non-finite values in ``actual`` fail unless ``expected`` has the same non-finite value there.
    """
    d_atol, d_rtol = default_tolerance(actual.dtype)
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
