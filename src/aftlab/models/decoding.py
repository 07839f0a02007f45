"""What a causal language model costs to decode one sequence at position ``P``: ms per token
and the bytes of its cache (an AFT mixer's fixed-size sums, attention's KV cache of ``P``
tokens). What ``aftlab compare --decode-positions`` prints beside the quality table
(docs/results.md, "The main job").

The cache at ``P`` is the one a prompt of ``P`` random tokens leaves (:func:`cache_at`):
prefilled, or, where the states are caches that grow with the tokens (attention's), filled
with ``P`` random keys and values, since that prefill costs ``O(P^2)`` (minutes at 64k on a
2-CPU machine) and a step's time does not depend on the values.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from .._state import GROWS, state_bytes, state_grows

__all__ = ["cache_at", "decoding_cost"]


def _filled(state: Any, position: int, gen: torch.Generator) -> Any:
    """``type(state).from_prefix`` of random tensors with each :data:`GROWS` dim ``position``."""
    parts = {}
    for f in dataclasses.fields(state):
        if grows := f.metadata.get(GROWS):
            t = getattr(state, f.name)
            shape = [position if i in grows else n for i, n in enumerate(t.shape)]
            parts[f.name] = torch.randn(shape, generator=gen, dtype=t.dtype).to(t.device)
    return type(state).from_prefix(**parts)


@torch.inference_mode()
def cache_at(model: torch.nn.Module, position: int, *, seed: int = 0) -> Any:
    """The decoding cache of ``model`` (one sequence) after ``position`` random tokens.

    A model whose every block state grows with the tokens and has ``from_prefix`` (attention's
    :class:`~aftlab.mixers.attention.KVCache`) gets those states filled with random tensors of
    ``position`` tokens; any other is prefilled with ``position`` random token ids in one call.
    """
    gen = torch.Generator().manual_seed(seed)
    cache = model.init_cache(1)
    if all(state_grows(s) and hasattr(type(s), "from_prefix") for s in cache.states):
        cache.states = [_filled(s, position, gen) for s in cache.states]
        cache.position = position
        return cache
    device = next(model.parameters()).device
    ids = torch.randint(model.vocab_size, (1, position), generator=gen).to(device)
    return model.prefill(ids, logits_to_keep=1)[1]


@torch.inference_mode()
def decoding_cost(
    model: torch.nn.Module, position: int, *, steps: int = 16, warmup: int = 4, seed: int = 0
) -> dict[str, Any]:
    """``{position, state_bytes, ms_per_token, ms_min}`` of ``model`` decoding one sequence.

    The cache is :func:`cache_at` ``position``; ``warmup`` steps run untimed (a KV cache grows
    there), then ``steps`` steps are timed one by one: the median and the fastest. The state's
    bytes are those of ``position`` tokens (:func:`aftlab._state.state_bytes`).

    Raises:
        ValueError: ``position``, ``steps`` or ``warmup`` out of range, or a position past the
            model's length limit.
    """
    for name, value, low in (("position", position, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"decoding_cost: {name} must be an integer >= {low}, got {value!r}")
    model.eval()
    cache = cache_at(model, position, seed=seed)
    size = state_bytes(cache.states, position)
    device = next(model.parameters()).device
    tokens = torch.randint(
        model.vocab_size, (warmup + steps, 1), generator=torch.Generator().manual_seed(seed + 1)
    ).to(device)
    times = []
    for i, tok in enumerate(tokens):
        t0 = time.perf_counter()
        model.step(tok, cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {
        "position": position,
        "state_bytes": size,
        "ms_per_token": 1e3 * statistics.median(times),
        "ms_min": 1e3 * min(times),
    }
