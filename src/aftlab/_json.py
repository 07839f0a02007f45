"""Strict JSON for every file aftlab writes: a non-finite number becomes ``null``.

Python's :func:`json.dumps` writes ``NaN`` and ``Infinity`` by default, which strict parsers
(JavaScript, ``jq``, Go, Rust) reject. :func:`dumps` writes ``null`` in their place and never
emits them (``allow_nan=False``).
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

__all__ = ["dumps", "finite_or_none"]


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (Python or NumPy) replaced by ``None``, recursively.

    NumPy integers become ``int``, tuples become lists (as in JSON); other values are returned
    unchanged.
    """
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
        return int(obj)
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """:func:`json.dumps` of ``obj`` with non-finite numbers written as ``null`` (strict JSON)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
