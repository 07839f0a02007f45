"""States as data: detaching one from its graph (the one helper behind every state's
``detach()``), copying one, and counting its bytes.

A state (an op's, a mixer's, a model's cache) is a dataclass of tensors, nested dataclasses,
lists, tuples and plain values. Truncated backpropagation through time is the caller's choice:
``state = state.detach()`` between two chunks stops the gradient there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["GROWS", "detach_state", "clone_state", "map_state", "state_bytes", "state_grows"]

#: ``dataclasses.field`` metadata of a state tensor: the dims that grow while decoding (a
#: key-value cache's capacity); :meth:`~aftlab.mixers.SequenceMixer.check_state` leaves their
#: size free and :func:`state_bytes` counts them at the tokens held
GROWS = "grows"

S = TypeVar("S")


def detach_state(state: S) -> S:
    """A copy of ``state`` whose tensors are detached (same storage, no graph).

    Dataclasses are rebuilt field by field (``dataclasses.replace``), lists and tuples element
    by element; other values are returned as they are.
    """
    return map_state(torch.Tensor.detach, state)


def clone_state(state: S) -> S:
    """A copy of ``state`` whose tensors are clones (new storage, in the graph): in-place
    writes to the copy leave the tensors of ``state`` (and what autograd saved of them) intact.
    """
    return map_state(torch.Tensor.clone, state)


def map_state(fn: Callable[[torch.Tensor], torch.Tensor], state: S) -> S:
    """``state`` rebuilt with ``fn`` applied to each of its tensors (as :func:`detach_state`)."""
    if isinstance(state, torch.Tensor):
        return fn(state)  # type: ignore[return-value]
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes: dict[str, Any] = {
            f.name: map_state(fn, getattr(state, f.name))
            for f in dataclasses.fields(state)
            if f.init
        }
        return dataclasses.replace(state, **changes)  # type: ignore[type-var]
    if isinstance(state, (list, tuple)):
        return type(state)(map_state(fn, x) for x in state)  # type: ignore[return-value]
    return state


def state_bytes(state: Any, tokens: int, grows: tuple[int, ...] = ()) -> int:
    """Bytes of the tensors of a decoding ``state`` holding ``tokens`` tokens: ``numel *
    element_size`` of each, with every dim its dataclass field marks :data:`GROWS` (a key-value
    cache's length) taken as ``tokens``.

    ``state``: a tensor, a dataclass of them (nested dataclasses, lists and tuples too); other
    values (a position) hold no tensor bytes.
    """
    if isinstance(state, torch.Tensor):
        shape = [tokens if i in grows else n for i, n in enumerate(state.shape)]
        return math.prod(shape) * state.element_size()
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return sum(
            state_bytes(getattr(state, f.name), tokens, f.metadata.get(GROWS, ()))
            for f in dataclasses.fields(state)
        )
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(x, tokens) for x in state)
    return 0


def state_grows(state: Any) -> bool:
    """Whether a state (a dataclass, nested ones, lists) has a field marked :data:`GROWS`."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return any(
            f.metadata.get(GROWS) or state_grows(getattr(state, f.name))
            for f in dataclasses.fields(state)
        )
    if isinstance(state, (list, tuple)):
        return any(state_grows(s) for s in state)
    return False
