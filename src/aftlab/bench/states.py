"""The size of each causal mixer's decoding state, per layer and sequence, after ``T`` tokens:
what ``aftlab bench`` prints beside attention's KV cache. Read from the states themselves, built
on the meta device (nothing is allocated, so ``T`` may be a million). See docs/benchmarks.md,
"Decoding state per layer"."""

from __future__ import annotations

import dataclasses

import torch

from .._state import state_bytes
from .cases import MATMUL, Op, Shape, decoding_mixer
from .measure import first_line

__all__ = ["state_sizes"]


def state_sizes(
    table: dict[str, Op | None], mixers: list[str], tokens: list[int], s: Shape, dtype: torch.dtype
) -> list[dict]:
    """``{mixer, T, state_bytes, note}`` per mixer of ``table`` in ``mixers`` with a decoding
    state and per ``T`` in ``tokens``: its state for one sequence (``B = 1``) after ``T`` tokens,
    at the width and heads of ``s``, for inputs of ``dtype``.

    The mixer is the one the decoding cases run (:func:`~aftlab.bench.cases.decoding_mixer`,
    ``max_seq_len = T``: aft-full's state is its ``T_max``), its state ``init_state(1)`` on the
    meta device: every mixer's state keeps its shape while decoding but on the dims marked
    :data:`GROWS` (the contract tests check it), taken as ``T``. A mixer without one (its
    ``init_state`` raises) gets a row with ``state_bytes = None`` and the error as its note.
    """
    rows = []
    for name in (m for m in mixers if table[m] is not MATMUL):
        for T in tokens:
            row = {"mixer": name, "T": T, "state_bytes": None, "note": ""}
            try:
                with torch.device("meta"):
                    m = decoding_mixer(name, table[name], dataclasses.replace(s, B=1, T=T))
                    state = m.init_state(1, device="meta", dtype=dtype)
            except Exception as e:  # noqa: BLE001 - a plugin's mixer: reported, not fatal
                row["note"] = f"no decoding state: {first_line(e)}"
            else:
                row["state_bytes"] = state_bytes(state, T)
            rows.append(row)
    return rows
