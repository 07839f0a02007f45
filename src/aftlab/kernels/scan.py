"""Callers of the scan kernels (``csrc/scan.cpp``): ``aftlab::simple_causal``,
``simple_global`` (aft-simple) and ``decay`` (aft-decay, RWKV's WKV), with their fakes and
autograd.

The Triton kernels (:mod:`aftlab.kernels.triton.scan`) are the ops ``aftlab::triton_<name>``
with the same schemas: the callers take ``backend`` (``"cpp"`` or ``"triton"``, what
:func:`aftlab.kernels.implementation` says) and :func:`register` takes the ops' prefix, so that
both backends share one caller, one fake and one autograd per op.

The backend's ops must be loaded (:func:`aftlab.kernels.load`,
:func:`aftlab.kernels.triton.load`); inputs are validated by the public ops. float16/bfloat16
are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import torch

from ._common import LOW, needs_grad, register_autograd

__all__ = ["aft_simple", "aft_decay", "aft_decay_state"]


def _empty_or_like(x: torch.Tensor, save: bool) -> torch.Tensor:
    """A contiguous tensor shaped like ``x`` (what the C++ ops return), or empty."""
    return x.new_empty(x.shape) if save else x.new_empty(0)


#: The op-name prefix of each backend, and what implements its ops (for errors).
PREFIX = {"cpp": "", "triton": "triton_"}
WHAT = {"cpp": "C++ kernel", "triton": "Triton kernel"}


def _op(backend: str, name: str):
    return getattr(torch.ops.aftlab, PREFIX[backend] + name)


def register(backend: str = "cpp") -> None:
    """Register the fakes and autograd of ``aftlab::simple_causal``, ``simple_global`` and
    ``decay`` (``backend="cpp"``, once the C++ library is loaded) or of their ``triton_`` ops
    (``"triton"``, once :mod:`aftlab.kernels.triton` has defined them)."""
    prefix, what = PREFIX[backend], WHAT[backend]
    lib = "aftlab::" + prefix
    backward_op = {name: getattr(torch.ops.aftlab, prefix + name + "_backward")
                   for name in ("simple_causal", "simple_global", "decay")}

    @torch.library.register_fake(lib + "simple_causal")
    def _(q, k, v, mask, save):
        return q.new_empty(q.shape), _empty_or_like(q, save)

    @torch.library.register_fake(lib + "simple_causal_backward")
    def _(gy, q, v, y, r):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    @torch.library.register_fake(lib + "simple_global")
    def _(q, k, v, mask):
        return q.new_empty(q.shape), q.new_empty(3, q.shape[0], q.shape[2])

    @torch.library.register_fake(lib + "simple_global_backward")
    def _(gy, q, k, v, stats, mask):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    @torch.library.register_fake(lib + "decay")
    def _(q, k, v, decay, bonus, mask, save):
        return q.new_empty(q.shape), _empty_or_like(q, save), _empty_or_like(q, save)

    @torch.library.register_fake(lib + "decay_state")
    def _(q, k, v, decay, bonus, state):
        return q.new_empty(q.shape), q.new_empty(3, q.shape[0], q.shape[2])

    @torch.library.register_fake(lib + "decay_backward")
    def _(gy, q, v, y, r, w):
        d = q.shape[2]
        like = q.new_empty(q.shape)
        return like, q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(d), q.new_empty(d)

    def setup_simple_causal(ctx, inputs, output):
        q, _, v, _, _ = inputs
        ctx.save_for_backward(q, v, output[0], output[1])

    def backward_simple_causal(ctx, gy, _gr):
        q, v, y, r = ctx.saved_tensors
        dq, dk, dv = backward_op["simple_causal"](gy, q, v, y, r)
        return dq, dk, dv, None, None

    def setup_simple_global(ctx, inputs, output):
        q, k, v, mask = inputs
        ctx.save_for_backward(q, k, v, output[1], mask)

    def backward_simple_global(ctx, gy, _gstats):
        q, k, v, stats, mask = ctx.saved_tensors
        dq, dk, dv = backward_op["simple_global"](gy, q, k, v, stats, mask)
        return dq, dk, dv, None

    def setup_decay(ctx, inputs, output):
        q, _, v, _, _, _, _ = inputs
        ctx.save_for_backward(q, v, output[0], output[1], output[2])

    def backward_decay(ctx, gy, _gr, _gw):
        q, v, y, r, w = ctx.saved_tensors
        dq, dk, dv, dlam, du = backward_op["decay"](gy, q, v, y, r, w)
        return dq, dk, dv, dlam, du, None, None

    register_autograd(prefix + "simple_causal", backward_simple_causal, setup_simple_causal, what)
    register_autograd(prefix + "simple_global", backward_simple_global, setup_simple_global, what)
    register_autograd(prefix + "decay", backward_decay, setup_decay, what)


def aft_simple(q, k, v, *, causal: bool, padding_mask, backend: str = "cpp"):
    """Kernel of :func:`aftlab.ops.aft_simple` (inputs already validated)."""
    out_dtype = q.dtype
    if out_dtype in LOW:
        q, k, v = q.float(), k.float(), v.float()
    if causal:
        y, _ = _op(backend, "simple_causal")(q, k, v, padding_mask, needs_grad(q, k, v))
    else:
        y, _ = _op(backend, "simple_global")(q, k, v, padding_mask)
    return y.to(out_dtype)


def aft_decay(q, k, v, decay, bonus, *, padding_mask, backend: str = "cpp"):
    """Kernel of :func:`aftlab.ops.aft_decay` (inputs already validated)."""
    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in LOW else out_dtype
    q, k, v, decay, bonus = (t.to(cdt) for t in (q, k, v, decay, bonus))
    save = needs_grad(q, k, v, decay, bonus)
    y, _, _ = _op(backend, "decay")(q, k, v, decay, bonus, padding_mask, save)
    return y.to(out_dtype)


def aft_decay_state(q, k, v, decay, bonus, initial_state, *, backend: str = "cpp"):
    """Kernel of :func:`aftlab.ops.aft_decay` continuing a state and returning the next, for
    inference (no gradient is taken: the caller checks; no padding): ``aftlab::decay_state``
    starts its scan from ``initial_state`` (a :class:`~aftlab.ops.state.RunningSums` or None)
    and returns the one after the last token, from the same pass: ``(y, state)``."""
    from ..ops.state import RunningSums

    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in LOW else out_dtype
    q, k, v, decay, bonus = (t.to(cdt) for t in (q, k, v, decay, bonus))
    s0, position = None, 0
    if initial_state is not None:
        s0 = torch.stack([initial_state.a, initial_state.b, initial_state.p]).to(cdt)
        position = initial_state.position
    y, s1 = _op(backend, "decay_state")(q, k, v, decay, bonus, s0)
    a, b, p = s1.unbind(0)
    return y.to(out_dtype), RunningSums(a, b, p, position=position + q.shape[1])
