"""Each op's tensor arguments and their shapes, the one place the bench (``aftlab.bench.cases``)
and the property tests (tests/ops/test_properties.py) read them from.

A shape is written as dims named by size: ``B`` batch, ``T`` length, ``d`` width, ``h`` heads,
``c`` channels per head, ``ck`` key channels per head (1 or ``c``), ``s`` kernel size, ``H, W``
an image grid, ``Tw`` the side of a bias ``w`` (``T`` or more), ``Wb`` a band's width.

Example:
    >>> SIGNATURES["aft_conv"].shapes({"B": 2, "T": 5, "h": 3, "c": 4, "ck": 1, "s": 7})
    {'q': (2, 5, 3, 4), 'k': (2, 5, 3, 1), 'v': (2, 5, 3, 4), 'w': (3, 7)}
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

__all__ = ["SIGNATURES", "Signature"]

_SEQUENCE = ("T", "Tw")  # dims along the sequence


class Signature(NamedTuple):
    """An op's tensor arguments in call order (keyword ones last), each with its dims."""

    args: dict[str, str]

    @property
    def dims(self) -> tuple[str, ...]:
        """The dims of the first argument, the op's leading shape."""
        return tuple(next(iter(self.args.values())).split())

    def shapes(self, sizes: Mapping[str, int], skip: Collection[str] = ()) -> dict[str, tuple]:
        """Each argument's shape from ``sizes`` by dim name (others ignored), less ``skip``."""
        return {
            name: tuple(sizes[dim] for dim in dims.split())
            for name, dims in self.args.items()
            if name not in skip
        }

    def positions(self) -> dict[str, tuple[int, ...]]:
        """The dims along the sequence of each argument that has any (what causality is about)."""
        out = {
            n: tuple(i for i, x in enumerate(d.split()) if x in _SEQUENCE)
            for n, d in self.args.items()
        }
        return {n: p for n, p in out.items() if p}


_QKV = {"q": "B T d", "k": "B T d", "v": "B T d"}

#: The ops of :mod:`aftlab.ops` by name (``aft_local_band`` from :mod:`aftlab.ops.aft_local`).
SIGNATURES: dict[str, Signature] = {
    "aft_full": Signature({**_QKV, "w": "Tw Tw"}),
    "aft_local": Signature({**_QKV, "w": "Tw Tw"}),
    "aft_local_band": Signature({**_QKV, "w_band": "T Wb"}),
    "aft_simple": Signature(_QKV),
    "aft_conv": Signature({"q": "B T h c", "k": "B T h ck", "v": "B T h c", "w": "h s"}),
    "aft_conv2d": Signature({"q": "B H W h c", "k": "B H W h ck", "v": "B H W h c", "w": "h s s"}),
    "aft_decay": Signature({**_QKV, "decay": "d", "bonus": "d"}),
    "stable_prefix_average": Signature({"k": "B T d", "v": "B T d", "decay": "d"}),
}
