"""The correctness gate: no case is timed unless it matches its float64 reference.

Before a case is timed, the same computation runs at a small size derived from the case
(``B <= 2``, ``T <= 71``, at most 8 channels per head, the case's heads, dtype and device) and
is compared with :func:`aftlab.testing.assert_close` (tolerances of the case's dtype):

* ``forward``: the op's output against the float64 reference on the same inputs;
* ``train``: also the gradients of every floating input for the same upstream gradient
  ``dy``, the reference's through autograd in float64;
* ``decode``: the module's outputs token by token (``init_state`` then ``step``) against the
  module's ``forward`` on the whole sequence in float64 (a float64 copy of the same weights).
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import torch

from ..testing import assert_close, max_error
from .cases import OpCase, Shape

__all__ = ["GateResult", "gate_shape", "check_case", "check_module"]

GATE_MAX_T = 71  # > 2 * 32: the aft-local band (s = 32) does not cover the whole sequence
GATE_MAX_B = 2
GATE_MAX_C = 8


@dataclass(frozen=True)
class GateResult:
    """Outcome of the gate: ``status`` is ``"passed"``, ``"failed"`` or ``"unavailable"``."""

    status: str
    note: str = ""
    max_error: float | None = None


def gate_shape(s: Shape) -> Shape:
    """The small shape the gate checks a case of shape ``s`` at."""
    return Shape(
        min(s.B, GATE_MAX_B), min(s.T, GATE_MAX_T), s.h * min(s.c, GATE_MAX_C), s.h, s.esize
    )


def _first_line(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0]


def _check_op(case: OpCase, mode: str, causal: bool, s: Shape, dtype, device) -> float:
    if case.reference is None:
        raise LookupError(f"{case.name} has no float64 reference")
    gen = torch.Generator().manual_seed(1234)
    x = case.make_inputs(s, causal, dtype, device, gen)
    x64 = {n: t.detach().cpu().double() for n, t in x.items()}
    train = mode == "train"
    if train:
        for t in (*x.values(), *x64.values()):
            t.requires_grad_(True)
    with torch.set_grad_enabled(train):
        y = case.op(x, causal)
        y_ref = case.reference(x64, causal)
    assert_close(f"{case.name} y", y, y_ref)
    err = max_error(y.detach(), y_ref.detach())
    if train:
        dy64 = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
        names = list(x)
        g = torch.autograd.grad(
            y, [x[n] for n in names], dy64.to(dtype=y.dtype, device=y.device), allow_unused=True
        )
        g_ref = torch.autograd.grad(y_ref, [x64[n] for n in names], dy64, allow_unused=True)
        for n, a, e in zip(names, g, g_ref, strict=True):
            a = torch.zeros_like(x[n]) if a is None else a
            e = torch.zeros_like(x64[n]) if e is None else e
            assert_close(f"{case.name} d{n}", a, e)
            err = max(err, max_error(a, e))
    return err


def _check_decode(case: OpCase, s: Shape, dtype, device) -> float:
    from aftlab.mixers import build_mixer

    if case.mixer is None:
        raise LookupError(f"{case.name} has no decoding module")
    torch.manual_seed(1234)
    m = build_mixer(
        case.mixer, d_model=s.d, n_heads=s.h, causal=True, max_seq_len=s.T, **case.mixer_options
    ).eval()
    m64 = copy.deepcopy(m).double()
    m = m.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(s.B, s.T, s.d, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        y_ref = m64(x)
        xs = x.to(device=device, dtype=dtype)
        state = m.init_state(s.B, device=device, dtype=dtype)
        ys = []
        for t in range(s.T):
            y_t, state = m.step(xs[:, t], state)
            ys.append(y_t)
        y = torch.stack(ys, 1)
    assert_close(f"{case.name} step outputs", y, y_ref)
    return max_error(y, y_ref)


def check_module(build, s: Shape, dtype: torch.dtype, device: torch.device) -> GateResult:
    """Gate a comparison module ``build(s)`` that has a float64 ``reference(x)`` (a peer's too).

    Its output and the gradients of ``x`` and of every parameter, in ``dtype`` at
    :func:`gate_shape` of ``s``, against the reference of a float64 copy of the same module.
    """
    s = gate_shape(s)
    try:
        torch.manual_seed(1234)
        m64 = build(s).double()
        if not hasattr(m64, "reference"):
            return GateResult("unavailable", "no float64 reference: outputs not compared")
        m = copy.deepcopy(m64).to(device=device, dtype=dtype)
        x64 = torch.randn(s.B, s.T, s.d, generator=torch.Generator().manual_seed(1234))
        x64 = x64.double().requires_grad_(True)
        x = x64.detach().to(device=device, dtype=dtype).requires_grad_(True)
        y, y_ref = m(x), m64.reference(x64)
        assert_close("y", y, y_ref)
        dy = torch.randn_like(y_ref)
        names = ["x", *(n for n, _ in m.named_parameters())]
        g = torch.autograd.grad(y, [x, *m.parameters()], dy.to(y))
        g_ref = torch.autograd.grad(y_ref, [x64, *m64.parameters()], dy)
        err = max_error(y.detach(), y_ref.detach())
        for n, a, e in zip(names, g, g_ref, strict=True):
            assert_close(f"d{n}", a, e)
            err = max(err, max_error(a, e))
    except AssertionError as e:
        return GateResult("failed", f"correctness gate failed: {_first_line(e)}")
    except Exception as e:  # a crash at the gate is a failure of the case, reported as such
        return GateResult("failed", f"correctness gate raised {_first_line(e)}")
    return GateResult("passed", max_error=err)


def check_case(
    case: OpCase, mode: str, causal: bool, shape: Shape, dtype: torch.dtype, device: torch.device
) -> GateResult:
    """Run the gate for one case at :func:`gate_shape` of ``shape``.

    Returns ``"passed"`` (with the largest absolute error), ``"failed"`` (a mismatch: the
    first line of the assertion) or ``"unavailable"`` (op, reference or mixer missing or not
    implemented yet; the case is then skipped, never timed).
    """
    s = gate_shape(shape)
    try:
        if mode == "decode":
            err = _check_decode(case, s, dtype, device)
        else:
            err = _check_op(case, mode, causal, s, dtype, device)
    except AssertionError as e:
        return GateResult("failed", f"correctness gate failed: {_first_line(e)}")
    except (NotImplementedError, LookupError, ImportError) as e:
        return GateResult("unavailable", f"not available yet: {_first_line(e)}")
    except ValueError as e:
        if "unknown mixer" in str(e) or "unexpected keyword" in str(e):
            return GateResult("unavailable", f"not available yet: {_first_line(e)}")
        return GateResult("failed", f"correctness gate raised {_first_line(e)}")
    except Exception as e:  # a crash at the gate is a failure of the case, reported as such
        return GateResult("failed", f"correctness gate raised {_first_line(e)}")
    return GateResult("passed", max_error=err)
