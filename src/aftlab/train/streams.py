"""Long streams: training with a carried state, the state in a checkpoint, streamed evaluation.

``carry_state`` (docs/training.md, "Carried state") trains a causal model on consecutive windows
of ``batch_size`` contiguous streams (:meth:`aftlab.data.ByteLMTask.consecutive_windows`): the
model's :class:`~aftlab.models.DecodingCache` after window ``w`` is the state window ``w + 1``
starts from, ``logits, cache = model.prefill(window, cache=cache)``. Only a model whose state
has a fixed size can carry it along a stream of any length (:func:`stream_refusal`).

``aftlab eval --stream`` (:func:`evaluate_stream`) scores a split as one stream: such a model
carries its state through chunks of ``seq_len``; any other reads sliding windows of
``max_seq_len`` tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from .._state import map_state, state_grows

__all__ = [
    "stream_refusal",
    "CarriedWindows",
    "cache_rows",
    "cat_caches",
    "flatten_state",
    "restore_state",
    "evaluate_stream",
]


# --------------------------------------------------------------------------- which models


def stream_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot carry a state of fixed size along a stream of any length, or None.

    A model carries one when it is not length-limited (no learned positional table, no
    ``aft-full`` or absolute-bias ``aft-local``: :attr:`~aftlab.models.TransformerLM.
    length_limit` is None) and no mixer's state grows with the tokens seen (attention's KV
    cache; fields marked :data:`aftlab._state.GROWS`).

    Returns:
        ``None``, or the reason as a phrase: ``"the learned positional table limits it to
        max_seq_len = 128 positions"``, ``"the state of 'attention' grows with every token (a
        cache of all past keys and values)"``.
    """
    limit = getattr(model, "length_limit", None)
    if limit is not None:
        return f"{limit.source} limits it to max_seq_len = {limit.max_seq_len} positions"
    cache = model.init_cache(1)
    for i, state in enumerate(cache.states):
        if state_grows(state):
            return (
                f"the state of {model.backbone.blocks[i].mixer.name!r} grows with every token "
                "(a cache of all past keys and values)"
            )
    return None


# --------------------------------------------------------------------------- training


class CarriedWindows(nn.Module):
    """The module ``carry_state`` trains: ``k`` consecutive windows through ``model.prefill``.

    One call runs the ``k`` windows of one step for one micro-batch, carrying the cache from
    each to the next (so a DDP or ``torch.compile`` wrapper sees one forward per backward)::

        for j in 0 .. k-1:  cache = empty if reset[j];  logits_j, cache = model.prefill(x_j, cache)

    Args:
        model: a causal :class:`~aftlab.models.TransformerLM`; its parameters are this module's.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, windows: torch.Tensor, cache: Any, reset: tuple[bool, ...]
    ) -> tuple[torch.Tensor, Any]:
        """``windows: (k, B, T)`` token ids, the cache carried into the first, ``reset[j]``: the
        state entering window ``j`` is the empty one. Returns ``(logits (k, B, T, V), cache
        after the last window)``; the cache keeps its graph (the caller detaches it)."""
        out = []
        for j, x in enumerate(windows):
            if reset[j]:
                cache = self.model.init_cache(x.shape[0])
            logits, cache = self.model.prefill(x, cache=cache)
            out.append(logits)
        return torch.stack(out), cache


def cache_rows(cache: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a :class:`~aftlab.models.DecodingCache` (every state tensor is
    batch-first), its ``batch_size`` set to ``stop - start``."""
    out = map_state(lambda t: t[start:stop], cache)
    return dataclasses.replace(out, batch_size=stop - start)


def cat_caches(caches: list[Any]) -> Any:
    """The caches of consecutive row blocks as one (tensors concatenated on dim 0).

    Raises:
        ValueError: the caches are at different positions (their plain values differ).
    """
    flats = [flatten_state(c) for c in caches]
    positions = [{k: v for k, v in values.items() if k != "batch_size"} for _, values in flats]
    for i, p in enumerate(positions):
        if p != positions[0]:
            raise ValueError(
                f"cat_caches: cache {i} is at {p} but cache 0 at {positions[0]} (every block of "
                "rows must be at the same positions)"
            )
    tensors = {name: torch.cat([t[name] for t, _ in flats]) for name in flats[0][0]}
    batch = sum(c.batch_size for c in caches)
    values = {**flats[0][1], "batch_size": batch}
    return restore_state(caches[0], tensors, values, rows=batch, where="cat_caches")


# --------------------------------------------------------------------------- the state as files


def _join(path: str, name: object) -> str:
    return f"{path}.{name}" if path else str(name)


def flatten_state(state: Any, path: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A state (dataclasses, lists, tensors, plain values) as ``(tensors, values)`` by field path.

    ``DecodingCache(states=[RunningSums(a, b, p, position=3)], position=3, batch_size=2)`` gives
    ``tensors = {"states.0.a": a, "states.0.b": b, "states.0.p": p}`` and ``values =
    {"states.0.position": 3, "position": 3, "batch_size": 2}``: what a checkpoint stores (the
    tensors as safetensors, the values as JSON).
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}

    def walk(obj: Any, at: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors[at] = obj
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), _join(at, f.name))
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk(x, _join(at, i))
        else:
            values[at] = obj

    walk(state, path)
    return tensors, values


def restore_state(
    template: Any,
    tensors: dict[str, torch.Tensor],
    values: dict[str, Any],
    *,
    rows: int | None = None,
    where: str = "state",
) -> Any:
    """The state of ``template``'s structure holding ``tensors`` and ``values``
    (:func:`flatten_state`'s), on the template's devices.

    Args:
        template: a state of the structure wanted, e.g. ``model.init_cache(B)``.
        tensors, values: by field path.
        rows: the batch of the tensors (dim 0) when it is not the template's (:func:`cat_caches`).
        where: names the source in errors.

    Raises:
        ValueError: a name the template lacks or has and the files do not, a tensor of another
            shape or dtype, a value of another type.
    """
    used: set[str] = set()

    def walk(obj: Any, at: str) -> Any:
        if isinstance(obj, torch.Tensor):
            got = tensors.get(at)
            want = obj.shape if rows is None else (rows, *obj.shape[1:])
            if got is None:
                raise ValueError(f"{where}: no tensor {at!r}, which the model's state has")
            if got.shape != want or got.dtype != obj.dtype:
                raise ValueError(
                    f"{where}: {at!r} is {got.dtype} {tuple(got.shape)}, the model's state needs "
                    f"{obj.dtype} {tuple(want)}"
                )
            used.add(at)
            return got.to(obj.device)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {
                f.name: walk(getattr(obj, f.name), _join(at, f.name))
                for f in dataclasses.fields(obj)
                if f.init
            }
            return dataclasses.replace(obj, **changes)
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(x, _join(at, i)) for i, x in enumerate(obj))
        if at not in values:
            raise ValueError(f"{where}: no value {at!r}, which the model's state has")
        got = values[at]
        if type(got) is not type(obj):
            raise ValueError(
                f"{where}: {at!r} is {type(got).__name__} {got!r}, the model's state needs a "
                f"{type(obj).__name__}"
            )
        used.add(at)
        return got

    out = walk(template, "")
    extra = sorted((set(tensors) | set(values)) - used)
    if extra:
        raise ValueError(f"{where}: {extra[0]!r} is not part of the model's state")
    return out


# --------------------------------------------------------------------------- evaluation


def _tokens(x: np.ndarray, start: int, stop: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x[start:stop]).astype(np.int64)).to(device)


@torch.no_grad()
def evaluate_stream(
    model: nn.Module,
    task: Any,
    split: str,
    *,
    stride: int | None = None,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> dict[str, Any]:
    """Mean loss and the task's metric on ``split`` read as one stream (``aftlab eval --stream``).

    Every byte of the split but the first is scored exactly once, as a target of the bytes
    before it:

    * a model with a state of fixed size (:func:`stream_refusal` is None) reads the stream in
      chunks of ``task.seq_len``, carrying its cache (``prefill(chunk, cache=cache)``): every
      target sees the whole split before it, in constant memory;
    * any other (attention, aft-full, absolute-bias aft-local, learned positions) reads sliding
      windows of ``L = max_seq_len`` tokens, ``stride`` (default ``L // 2``) new ones each: the
      first window scores its ``L`` targets, each next one the last ``stride`` of its ``L``, so a
      target sees at least ``L - stride`` bytes before it (``batch_size`` windows a call).

    Returns:
        ``{"loss", task.metric, "targets", "stream": True, "context"}``: ``context`` says which
        reading it was (``"state carried in chunks of 128"``, ``"sliding window of max_seq_len
        = 128, stride 64 (...why)"``).
    """
    from .trainer import _autocast as autocast  # the trainer imports this module
    from .trainer import nll_sum

    device = torch.device(device)
    x = task.stream(split)
    n = len(x)
    why = stream_refusal(model)
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    try:
        if why is None:
            chunk, cache = task.seq_len, None
            context = f"state carried in chunks of {chunk}"
            for a in range(0, n - 1, chunk):
                b = min(a + chunk, n - 1)
                with autocast(device, precision):
                    logits, cache = model.prefill(_tokens(x, a, b, device)[None], cache=cache)
                cache = cache.detach()
                s, k = nll_sum(logits, _tokens(x, a + 1, b + 1, device)[None])
                total, count = total + s.double().cpu(), count + int(k)
        else:
            L = model.config.max_seq_len
            stride = L // 2 if stride is None else stride
            if not 1 <= stride <= L:
                raise ValueError(f"evaluate_stream: 'stride' must be in [1, {L}], got {stride}")
            context = f"sliding window of max_seq_len = {L}, stride {stride} ({why})"
            ends = [min(L, n - 1)]  # window i: x[ends[i] - L : ends[i] + 1], new after ends[i-1]
            while ends[-1] < n - 1:
                ends.append(min(ends[-1] + stride, n - 1))
            width = ends[0]
            for i in range(0, len(ends), batch_size):
                part = ends[i : i + batch_size]
                rows = torch.stack([_tokens(x, b - width, b + 1, device) for b in part])
                target = rows[:, 1:].clone()
                for j, b in enumerate(part):
                    new = b - ends[i + j - 1] if i + j else width
                    target[j, : width - new] = -100
                with autocast(device, precision):
                    logits = model(rows[:, :-1])
                s, k = nll_sum(logits, target)
                total, count = total + s.double().cpu(), count + int(k)
    finally:
        model.train(was_training)
    loss = float(total) / count
    return {
        "loss": loss,
        task.metric: task.metric_from_loss(loss),
        "targets": count,
        "stream": True,
        "context": context,
    }
