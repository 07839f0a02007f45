"""The correctness gate of ``aftlab bench``: no case is timed before its computation, at a small
shape (:func:`gate_shape`), matches its float64 reference (``aftlab.testing.assert_close``). See
docs/benchmarks.md, "Correctness gate"."""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import torch

from ..testing import assert_close, max_error
from .cases import Op, Shape, decoder


@dataclass(frozen=True)
class Gate:
    """``status``: ``"passed"`` (with the largest error), ``"failed"``, ``"unavailable"`` (op or
    reference missing: skipped) or ``"unchecked"`` (a peer without a reference: timed)."""

    status: str
    note: str = ""
    max_error: float | None = None


def gate_shape(s: Shape) -> Shape:
    """``B <= 2``, ``T <= 71`` (past aft-local's band of 2 x 32), at most 8 channels per head."""
    return Shape(min(s.B, 2), min(s.T, 71), s.h * min(s.c, 8), s.h, s.esize)


def first_line(e: BaseException) -> str:
    """``"Type: message"``, the message's first line only."""
    return traceback.format_exception_only(e)[-1].strip().splitlines()[0]


def _grads(y: torch.Tensor, leaves: dict, dy: torch.Tensor) -> list[torch.Tensor]:
    g = torch.autograd.grad(y, list(leaves.values()), dy.to(y), allow_unused=True)
    return [torch.zeros_like(t) if a is None else a for t, a in zip(leaves.values(), g)]  # noqa: B905


def _compare(name: str, fn, fn64, x: dict, x64: dict, train: bool) -> float:
    """``fn()`` against ``fn64()``, and if ``train`` the gradients of the leaves ``x``, ``x64``
    for the same ``dy``; the largest error."""
    for t in (*x.values(), *x64.values()):
        t.requires_grad_(train)
    with torch.set_grad_enabled(train):
        y, y64 = fn(), fn64()
    pairs = [("y", y, y64)]
    if train:
        dy = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=y64.dtype)
        pairs += zip((f"d{n}" for n in x), _grads(y, x, dy), _grads(y64, x64, dy), strict=True)
    for what, a, e in pairs:
        assert_close(f"{name} {what}", a, e)
    return max(max_error(a.detach(), e.detach()) for _, a, e in pairs)


def _check_op(name: str, op: Op, mode: str, causal: bool, s: Shape, dtype, device) -> float:
    """The op's output (train: and the gradient of every input) against its reference."""
    x = op.make(s, causal, dtype, device, torch.Generator().manual_seed(1234))
    x64 = {n: t.detach().cpu().double() for n, t in x.items()}
    fast, ref = lambda: op.fast(x, causal), lambda: op.reference(x64, causal)
    return _compare(name, fast, ref, x, x64, mode == "train")


def _copies(build, s: Shape, dtype, device):
    """``(m, m64, x, x64)``: a float64 module and its copy in ``dtype``, an input ``(B, T, d)``."""
    torch.manual_seed(1234)
    m64 = build(s).double().eval()
    x64 = torch.randn(s.B, s.T, s.d, generator=torch.Generator().manual_seed(1234)).double()
    m = copy.deepcopy(m64).to(device=device, dtype=dtype)
    return m, m64, x64.to(device=device, dtype=dtype, copy=True), x64


def _check_decode(name: str, op: Op | None, s: Shape, dtype, device) -> float:
    """The mixer's ``step`` outputs token by token against its float64 ``forward``."""
    m, m64, x, x64 = _copies(lambda s: decoder(name, op, s, s.T), s, dtype, device)
    with torch.inference_mode():
        state, ys = m.init_state(s.B, device=device, dtype=dtype), []
        for t in range(s.T):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t)
        return _compare(f"{name} step", lambda: torch.stack(ys, 1), lambda: m64(x64), {}, {}, False)


def _check_module(build, s: Shape, dtype, device) -> float:
    """A peer's module: output, gradients of ``x`` and its parameters, against ``reference``."""
    m, m64, x, x64 = _copies(build, s, dtype, device)
    x, x64 = {"x": x, **dict(m.named_parameters())}, {"x": x64, **dict(m64.named_parameters())}
    return _compare("module", lambda: m(x["x"]), lambda: m64.reference(x64["x"]), x, x64, True)


def _gate(check, *args) -> Gate:
    try:
        return Gate("passed", max_error=check(*args))
    except AssertionError as e:
        return Gate("failed", f"correctness gate failed: {first_line(e)}")
    except (NotImplementedError, LookupError) as e:
        return Gate("unavailable", f"not available: {first_line(e)}")
    except Exception as e:  # a crash at the gate is a failure of the case, reported as such
        return Gate("failed", f"correctness gate raised {first_line(e)}")


def check_case(name: str, op: Op | None, mode: str, causal: bool, s: Shape, dtype, device) -> Gate:
    """Gate case ``name`` (its op; the mixer ``name`` for ``decode``) at :func:`gate_shape`."""
    if mode == "decode":
        return _gate(_check_decode, name, op, gate_shape(s), dtype, device)
    return _gate(_check_op, name, op, mode, causal, gate_shape(s), dtype, device)


def check_module(build, s: Shape, dtype, device) -> Gate:
    """Gate a peer's module ``build(s)`` against its float64 ``reference(x)``; ``"unchecked"``
    (timed all the same) for a module without one."""
    if not hasattr(build(gate_shape(s)), "reference"):
        return Gate("unchecked", "no float64 reference: outputs not compared")
    return _gate(_check_module, build, gate_shape(s), dtype, device)
