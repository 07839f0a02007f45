"""Detaching a state from its graph: the one helper behind every state's ``detach()``.

A state (an op's, a mixer's, a model's cache) is a dataclass of tensors, nested dataclasses,
lists, tuples and plain values. Truncated backpropagation through time is the caller's choice:
``state = state.detach()`` between two chunks stops the gradient there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["detach_state", "clone_state", "map_state"]

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
