"""Packed documents: ``cu_seqlens`` offsets and running an op once per document.

``cu_seqlens`` is the FlashAttention/fla convention: an int32 1-D tensor ``[0, n_1, n_1 + n_2,
..., T]`` of document offsets into a batch of one row ``(1, T, ...)``. A causal op restarts at
every document start: document ``i`` (positions ``cu[i] .. cu[i+1] - 1``) sees only itself,
and its positions count from 0. With an ``initial_state`` the first document continues it (a
document begun in an earlier chunk); with ``return_state`` the state returned is the last
document's.

The offsets are read on the host (one sync per call, as fla's varlen kernels do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._checks import check_tensor

__all__ = ["check_cu_seqlens", "run_documents"]


def check_cu_seqlens(where: str, cu_seqlens: object, T: int, B: int) -> list[int]:
    """Validate ``cu_seqlens`` for a batch ``(B, T)`` and return its offsets as ints.

    Raises:
        TypeError: not a tensor, or not int32.
        ValueError: not 1-D, ``B != 1``, not starting at 0, decreasing, or not ending at ``T``.
    """
    check_tensor(where, "cu_seqlens", cu_seqlens, ndim=1, dtype=torch.int32)
    assert isinstance(cu_seqlens, torch.Tensor)
    if B != 1:
        raise ValueError(
            f"{where}: 'cu_seqlens' packs documents into a batch of one row, got batch size {B}"
        )
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if not offsets or offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(
            f"{where}: 'cu_seqlens' must run from 0 to the sequence length {T}, got {offsets}"
        )
    if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"{where}: 'cu_seqlens' must be non-decreasing, got {offsets}")
    return offsets


def run_documents(
    offsets: list[int],
    call: Callable[[int, int, Any, bool], Any],
    *,
    initial_state: Any = None,
    return_state: bool = False,
    dim: int = 1,
) -> Any:
    """Run ``call(start, end, state, want_state)`` on every non-empty document; join the outputs.

    ``call`` returns the document's output (positions ``start .. end - 1`` along ``dim``), or
    ``(output, state)`` when ``want_state`` is True. The first document gets ``initial_state``
    (the others ``None``: the empty state); only the last is asked for its state. Returns the
    outputs concatenated along ``dim`` (and the last document's state with ``return_state``;
    ``initial_state`` itself when every document is empty).
    """
    docs = [(a, b) for a, b in zip(offsets, offsets[1:], strict=False) if b > a]
    ys, state = [], initial_state
    for i, (a, b) in enumerate(docs):
        want = return_state and i == len(docs) - 1
        out = call(a, b, initial_state if i == 0 else None, want)
        if want:
            out, state = out
        ys.append(out)
    if not ys:  # no position at all: the caller's empty output
        y = call(0, 0, initial_state, False) if offsets else None
        return (y, state) if return_state else y
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim)
    return (y, state) if return_state else y
