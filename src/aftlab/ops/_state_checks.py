"""The checks of the state keywords, shared by every causal op (one message per mistake).

``initial_state=``, ``return_state=`` and ``cu_seqlens=`` (:mod:`aftlab.ops.state`,
:mod:`aftlab.ops._packed`): the keywords need a causal call, ``return_state`` is a bool, and a
state's tensors have the op's layout, the compute dtype of ``q`` (float32 for float16/bfloat16,
else ``q``'s) and its device.
"""

from __future__ import annotations

import torch

from .._checks import check_positive_int, check_tensor
from ._numerics import compute_dtype
from .state import RunningSums

__all__ = ["check_state_keywords", "check_state_fields", "check_running_sums"]


def check_state_keywords(
    where: str, causal: bool, initial_state: object, return_state: object, cu_seqlens: object
) -> bool:
    """Whether a call uses any of ``initial_state``, ``return_state``, ``cu_seqlens``.

    Raises:
        TypeError: ``return_state`` not a bool.
        ValueError: one of them on a non-causal call (a query sees later keys: no state carries
            a sequence over to the next call, and documents are causal ones).
    """
    if not isinstance(return_state, bool):
        raise TypeError(
            f"{where}: 'return_state' must be a bool, got {type(return_state).__name__}"
        )
    used = [
        name
        for name, on in (
            ("initial_state", initial_state is not None),
            ("return_state", return_state),
            ("cu_seqlens", cu_seqlens is not None),
        )
        if on
    ]
    if used and not causal:
        raise ValueError(
            f"{where}: {', '.join(repr(n) for n in used)} need causal=True (a state carries a "
            "causal sequence over to the next call), got causal=False"
        )
    return bool(used)


def check_state_fields(
    where: str,
    state: object,
    kind: type,
    fields: dict[str, tuple[object, tuple[int, ...], str]],
    q: torch.Tensor,
    *,
    what: str,
) -> None:
    """Raise unless ``state`` is a ``kind`` whose tensors ``fields`` fit ``q``.

    ``fields`` maps a field's path (``"gone.a"``) to ``(value, shape, layout)``, ``layout`` the
    shape in words for the message (``"(B, window - 1, *key)"``); ``what`` says what the state
    is (``"the state of aft_simple and aft_decay"``). A field named ``valid`` is bool, the others
    are in the compute dtype of ``q``; all on ``q``'s device. ``state.position`` is an int >= 0.

    Raises:
        TypeError: ``state`` not a ``kind``, a field not a tensor, a non-int position.
        ValueError: a shape of another batch, window or width; another device.
        DTypeError: another dtype (a ``TypeError`` and a ``ValueError``).
    """
    if not isinstance(state, kind):
        raise TypeError(
            f"{where}: 'initial_state' must be a {kind.__name__} ({what}), "
            f"got {type(state).__name__}"
        )
    dtype = compute_dtype(q.dtype)
    for name, (x, shape, layout) in fields.items():
        check_tensor(where, f"initial_state.{name}", x)
        assert isinstance(x, torch.Tensor)
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{where}: 'initial_state.{name}' must have shape {layout} = {shape} for 'q' "
                f"{tuple(q.shape)}, got {tuple(x.shape)} (a state of another batch, window or "
                "width?)"
            )
        want = torch.bool if name == "valid" else dtype
        check_tensor(where, f"initial_state.{name}", x, dtype=want)
        if x.device != q.device:
            raise ValueError(
                f"{where}: 'initial_state.{name}' is on {x.device} but 'q' is on {q.device}"
            )
    check_positive_int(where, "initial_state.position", state.position, allow_zero=True)


def check_running_sums(where: str, state: object, q: torch.Tensor) -> RunningSums:
    """``initial_state`` of a scan op on ``q: (B, T, d)``: a :class:`RunningSums` with ``a, b,
    p`` ``(B, d)`` (:func:`check_state_fields`)."""
    shape = (q.shape[0], q.shape[2])
    fields = {f: (getattr(state, f, None), shape, "(B, d)") for f in ("a", "b", "p")}
    check_state_fields(
        where, state, RunningSums, fields, q, what="the state of aft_simple and aft_decay"
    )
    assert isinstance(state, RunningSums)
    return state
