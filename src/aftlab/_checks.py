"""Argument validation that fails early with a message naming the argument.

Every public function validates its inputs with these helpers, so a user sees
``aft_full: 'k' must have shape (2, 7, 16) like 'q', got (2, 7, 15)`` rather than an
opaque error from deep inside torch.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Mapping, Sequence

import torch

__all__ = [
    "comma_separated",
    "DTypeError",
    "check_tensor",
    "check_state_dtypes",
    "check_compatible",
    "check_floating_dtype",
    "check_padding_mask",
    "check_tokens",
    "check_positive_int",
    "check_choice",
    "check_qkv",
    "did_you_mean",
]


class DTypeError(ValueError, TypeError):
    """A tensor of the wrong dtype, or dtypes that do not match.

    Subclasses both ``ValueError`` (a mismatch between arguments) and ``TypeError`` (the
    tensor's element type), like NumPy's ``AxisError``; either ``except`` clause catches it.
    """


def _fmt(shape: Sequence[int | None]) -> str:
    return (
        "("
        + ", ".join("*" if s is None else str(s) for s in shape)
        + ("," if len(shape) == 1 else "")
        + ")"
    )


def check_tensor(
    where: str,
    name: str,
    value: object,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    floating: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of the given rank/shape/dtype.

    Args:
        where: the function or module doing the check, used as the message prefix.
        name: the argument's name as the user wrote it.
        value: the object to check.
        ndim: required number of dimensions (or a sequence of allowed ones).
        shape: required shape; ``None`` entries match any size. Implies ``ndim``.
        floating: require a floating-point dtype.
        dtype: require exactly this dtype.

    Raises:
        TypeError: ``value`` is not a tensor.
        DTypeError: wrong dtype (both a ``ValueError`` and a ``TypeError``).
        ValueError: wrong rank or shape.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: '{name}' must be a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            extra = f" {_fmt(shape)}" if shape is not None else ""
            raise ValueError(
                f"{where}: '{name}' must have {want} dimensions{extra}, "
                f"got {value.dim()} with shape {_fmt(value.shape)}"
            )
    if shape is not None and any(
        s is not None and s != v for s, v in zip(shape, value.shape, strict=True)
    ):
        raise ValueError(
            f"{where}: '{name}' must have shape {_fmt(shape)}, got {_fmt(value.shape)}"
        )
    if floating and not value.is_floating_point():
        raise DTypeError(
            f"{where}: '{name}' must be a floating-point tensor, got dtype {value.dtype}"
        )
    if dtype is not None and value.dtype != dtype:
        raise DTypeError(f"{where}: '{name}' must have dtype {dtype}, got {value.dtype}")
    return value


def check_floating_dtype(where: str, name: str, value: object) -> torch.dtype:
    """Return ``value`` if it is a floating-point ``torch.dtype``; else a :class:`DTypeError`."""
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise DTypeError(f"{where}: '{name}' must be a floating-point torch.dtype, got {value!r}")
    return value


def check_compatible(where: str, named: dict[str, torch.Tensor]) -> None:
    """Raise unless all tensors share one dtype and one device (names both offenders)."""
    items = list(named.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise DTypeError(
                f"{where}: '{name}' has dtype {t.dtype} but '{first_name}' has {first.dtype}; "
                "all inputs must share one dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"{where}: '{name}' is on {t.device} but '{first_name}' is on {first.device}; "
                "all inputs must be on one device"
            )


def check_bool_mask(
    where: str,
    name: str,
    mask: object,
    shape: Sequence[int],
    ref_name: str,
    ref: torch.Tensor,
    *,
    true_means: str,
) -> torch.Tensor:
    """Check a mask ``name``: a bool tensor of ``shape`` on ``ref``'s device.

    ``true_means`` says what True stands for, in the message (``"real token"``).

    Raises:
        ValueError: wrong rank or shape, or another device than ``ref``.
        TypeError: not a tensor, or not bool.
    """
    check_tensor(where, name, mask, shape=tuple(shape))
    assert isinstance(mask, torch.Tensor)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{where}: '{name}' must be a bool tensor (True = {true_means}), got dtype {mask.dtype}"
        )
    if mask.device != ref.device:
        raise ValueError(
            f"{where}: '{name}' is on {mask.device} but '{ref_name}' is on {ref.device}"
        )
    return mask


def check_padding_mask(
    where: str, mask: object, shape: Sequence[int], ref_name: str, ref: torch.Tensor
) -> torch.Tensor:
    """Check a padding mask: a bool tensor of ``shape`` (True = real token) on ``ref``'s device
    (:func:`check_bool_mask`)."""
    return check_bool_mask(
        where, "padding_mask", mask, shape, ref_name, ref, true_means="real token"
    )


def check_tokens(
    where: str, name: str, idx: object, *, ndim: int, vocab_size: int, in_forward: bool = False
) -> torch.Tensor:
    """``idx`` must be an integer tensor of rank ``ndim`` with ids in ``[0, vocab_size)``.

    The rank, dtype and length are checked always (free: no data is read). The id range reads
    the data: never inside ``torch.compile`` (it would break the graph), and in a forward pass
    (``in_forward``) only for CPU tensors, where it stalls nothing; on a GPU a read per step
    would stall the host, so there ``nn.Embedding`` rejects an out-of-range id itself (a
    device-side assert on CUDA; the tasks make ids in range by construction). Decoding entry
    points (prefill, step, generate), which wait for the host anyway, check on every device.
    """
    shape = ("B", "T") if ndim == 2 else ("B",)
    if not isinstance(idx, torch.Tensor):
        raise TypeError(
            f"{where}: '{name}' must be a torch.Tensor of token ids, got {type(idx).__name__}"
        )
    if idx.dim() != ndim:
        raise ValueError(
            f"{where}: '{name}' must have shape ({', '.join(shape)}{',' if ndim == 1 else ''}) "
            f"of token ids, got {tuple(idx.shape)}"
        )
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(
            f"{where}: '{name}' must be an integer (long) tensor of token ids, "
            f"got dtype {idx.dtype}"
        )
    if ndim == 2 and idx.shape[1] == 0:
        raise ValueError(
            f"{where}: '{name}' must hold at least one token, got shape {tuple(idx.shape)}"
        )
    read = not in_forward or idx.device.type == "cpu"
    if idx.numel() and read and not torch.compiler.is_compiling():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{where}: '{name}' ids must be in [0, vocab_size={vocab_size}), "
                f"got values in [{lo}, {hi}]"
            )
    return idx


def check_positive_int(where: str, name: str, value: object, *, allow_zero: bool = False) -> int:
    """Return ``value`` if it is an int > 0 (or >= 0 with ``allow_zero``); else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: '{name}' must be an int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{where}: '{name}' must be {bound}, got {value}")
    return value


def check_choice(where: str, name: str, value: object, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``; else raise listing them."""
    if value not in choices:
        raise ValueError(f"{where}: '{name}' must be one of {sorted(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def did_you_mean(name: object, candidates: Iterable[str]) -> str:
    """The hint for an unknown ``name``: ``"did you mean 'a' or 'b'? "``, or ``""``.

    Up to three ``candidates`` close to ``name`` (``difflib``'s ratio >= 0.6). The hint ends
    with a space so that the list of known names can follow it::

        f"unknown task {name!r}; {did_you_mean(name, tasks)}known tasks: {', '.join(tasks)}"
    """
    near = difflib.get_close_matches(str(name), list(candidates), n=3)
    return f"did you mean {' or '.join(map(repr, near))}? " if near else ""


def check_qkv(where: str, q: object, k: object, v: object, padding_mask: object = None) -> None:
    """Check the AFT inputs ``q, k, v``: floating ``(B, T, d)`` tensors of one shape, dtype and
    device, and the optional bool ``padding_mask (B, T)`` (:func:`check_padding_mask`)."""
    check_tensor(where, "q", q, ndim=3, floating=True)
    check_tensor(where, "k", k, ndim=3, floating=True)
    check_tensor(where, "v", v, ndim=3, floating=True)
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(
                f"{where}: '{name}' must have shape {tuple(q.shape)} like 'q', got {tuple(x.shape)}"
            )
    check_compatible(where, {"q": q, "k": k, "v": v})
    if padding_mask is not None:
        check_padding_mask(where, padding_mask, tuple(q.shape[:2]), "q", q)


def check_state_dtypes(
    where: str, dtypes: Mapping[str, torch.dtype], own: Mapping[str, torch.Tensor]
) -> None:
    """Refuse weights that ``load_state_dict`` would cast into something else.

    A floating-point tensor of any precision loads into a floating-point one (cast to the
    module's dtype); any other tensor must have the module's dtype, so integer, bool and
    complex weights are refused. ``dtypes`` maps state-dict names to the dtypes to load, ``own``
    is the module's ``state_dict()``; names the module lacks are left to ``load_state_dict``.

    Raises:
        DTypeError: naming the tensor, its dtype and the dtype expected.
    """
    for name, dtype in dtypes.items():
        want = own[name].dtype if name in own else dtype
        if dtype == want or (dtype.is_floating_point and want.is_floating_point):
            continue
        expected = (
            f"floating point (the model's {want}; any floating dtype is cast to it)"
            if want.is_floating_point
            else f"the model's {want}"
        )
        raise DTypeError(f"{where}: '{name}' has dtype {dtype}, expected {expected}")


def comma_separated(kind: type, text: str) -> list:
    """``--lengths 256,1024``: comma-separated values of ``kind`` (an argparse type)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated {kind.__name__}s, got {text!r}"
        ) from None
