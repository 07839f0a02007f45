"""Registry from a mixer name (``"attention"``, ``"aft-full"``, ...) to its class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import SequenceMixer

__all__ = [
    "register_mixer",
    "unregister_mixer",
    "get_mixer_class",
    "build_mixer",
    "available_mixers",
]

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


def unregister_mixer(name: str) -> type[SequenceMixer]:
    """Remove ``name`` from the registry and return its class (e.g. a mixer a test registered).

    Example:
        >>> from aftlab.mixers import SequenceMixer, register_mixer, unregister_mixer
        >>> @register_mixer("doc-identity")
        ... class Identity(SequenceMixer):
        ...     def _forward(self, x, padding_mask):
        ...         return x
        >>> unregister_mixer("doc-identity") is Identity
        True
    """
    get_mixer_class(name)  # ValueError naming the known mixers
    return _MIXERS.pop(name)


def build_mixer(name: str, **kwargs: Any) -> SequenceMixer:
    """Build the mixer ``name`` from the common arguments and its own options.

    Args:
        name: a registered name (:func:`available_mixers`).
        **kwargs: the common arguments (``d_model``, ``n_heads``, ``causal``, ``max_seq_len``,
            ``dropout``, ``bias``: see :class:`~aftlab.mixers.SequenceMixer`) and the mixer's
            own options; an option the mixer does not know is a ``ValueError`` naming it.

    A model builds its mixers from its config instead:
    :func:`aftlab.models.blocks.mixer_from_config`.

    Example:
        >>> from aftlab.mixers import build_mixer
        >>> m = build_mixer("attention", d_model=64, n_heads=4, causal=True)
    """
    cls = get_mixer_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        if "unexpected keyword argument" in str(e):
            raise ValueError(f"mixer {name!r}: {e}") from None
        raise
