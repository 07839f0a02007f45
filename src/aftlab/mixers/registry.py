"""Registry from a mixer name (``"attention"``, ``"aft-full"``, ...) to its class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import SequenceMixer

__all__ = ["register_mixer", "get_mixer_class", "build_mixer", "available_mixers"]

_MIXERS: dict[str, type[SequenceMixer]] = {}


def register_mixer(name: str) -> Callable[[type[SequenceMixer]], type[SequenceMixer]]:
    """Class decorator: register a :class:`SequenceMixer` subclass under ``name``."""

    def deco(cls: type[SequenceMixer]) -> type[SequenceMixer]:
        if name in _MIXERS and _MIXERS[name] is not cls:
            raise ValueError(
                f"register_mixer: name {name!r} is already taken by {_MIXERS[name].__name__}"
            )
        if not (isinstance(cls, type) and issubclass(cls, SequenceMixer)):
            raise TypeError(f"register_mixer: {cls!r} is not a SequenceMixer subclass")
        cls.name = name
        _MIXERS[name] = cls
        return cls

    return deco


def available_mixers() -> list[str]:
    """Names of all registered mixers, sorted."""
    return sorted(_MIXERS)


def get_mixer_class(name: str) -> type[SequenceMixer]:
    """Return the class registered as ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _MIXERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown mixer {name!r}; expected one of {available_mixers()}") from None


def build_mixer(
    name: str,
    *,
    d_model: int,
    n_heads: int = 1,
    causal: bool = False,
    max_seq_len: int | None = None,
    dropout: float = 0.0,
    bias: bool = True,
    **options: Any,
) -> SequenceMixer:
    """Build the mixer ``name`` with the common arguments and its own ``options``.

    Example:
        >>> from aftlab.mixers import build_mixer
        >>> m = build_mixer("attention", d_model=64, n_heads=4, causal=True)
    """
    cls = get_mixer_class(name)
    try:
        return cls(
            d_model=d_model,
            n_heads=n_heads,
            causal=causal,
            max_seq_len=max_seq_len,
            dropout=dropout,
            bias=bias,
            **options,
        )
    except TypeError as e:
        if "unexpected keyword argument" in str(e):
            raise ValueError(f"mixer {name!r}: {e}") from None
        raise
