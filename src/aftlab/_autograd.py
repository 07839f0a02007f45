"""Backward passes that are differentiable once, and say so when asked for a second derivative.

aftlab's hand-written backward passes (the autograd of the C++ kernels and of the PyTorch ops'
custom ops, :func:`register_autograd_once`) have no derivative of their own. PyTorch's
:func:`torch.autograd.function.once_differentiable` raises on a second derivative only when the
upstream gradient itself requires grad; when it does not (``grad(y.sum(), x,
create_graph=True)``), the first gradient comes back as a constant, and a second derivative
that also has another path to ``x`` is then silently wrong. :func:`once_differentiable` links
the first gradient to the op's own inputs and to the upstream gradients through a node that
raises, so any second derivative through it raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["keep_inputs", "once_differentiable", "register_autograd_once"]


def keep_inputs(ctx, *inputs) -> None:
    """Remember the inputs that require grad (call in ``forward`` / ``setup_context``)."""
    ctx.aftlab_inputs = tuple(
        t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad
    )


def once_differentiable(name: str) -> Callable:
    """Decorate ``backward(ctx, *grads)`` of the op ``name``: run it without grad and, under
    ``create_graph=True``, hand back gradients whose own derivative raises a clear error."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def once(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():  # the usual backward (create_graph=False)
                return out
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            tensors = [g for g in outs if isinstance(g, torch.Tensor)]
            sources = getattr(ctx, "aftlab_inputs", ()) + tuple(
                g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad
            )
            if not tensors or not sources:
                return out
            err = torch._C._functions.DelayedError(
                f"{name} is differentiable once (its backward is hand-written); for a higher "
                "derivative there is no implementation in aftlab",
                len(tensors) + len(sources),
            )
            linked = iter(err(*tensors, *sources)[: len(tensors)])
            outs = tuple(next(linked) if isinstance(g, torch.Tensor) else g for g in outs)
            return outs[0] if single else outs

        return once

    return decorate


def register_autograd_once(op: str, backward: Callable, setup: Callable, *, what: str) -> None:
    """Register ``backward`` and ``setup(ctx, inputs, output)`` as the autograd of the custom op
    ``op`` (``"namespace::name"``), differentiable once (a second derivative raises, naming
    ``op`` and ``what`` implements it). Gradients are not materialised: ``backward`` gets None
    for an output that no loss uses (not a zero tensor of its size), and is not called when
    none is used."""

    def setup_context(ctx, inputs, output):
        keep_inputs(ctx, *inputs)
        setup(ctx, inputs, output)
        # the ops' extra outputs (saved statistics) get no gradient: None, not a zero tensor
        # of their size filled on every backward
        ctx.set_materialize_grads(False)
        ctx.aftlab_n_inputs = len(inputs)

    once = once_differentiable(f"{op} ({what})")(backward)

    def backward_or_none(ctx, *grads):
        if all(g is None for g in grads):  # no output is used: no input gets a gradient
            return (None,) * ctx.aftlab_n_inputs
        return once(ctx, *grads)

    torch.library.register_autograd(op, backward_or_none, setup_context=setup_context)
