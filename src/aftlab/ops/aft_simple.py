"""AFT-simple (stub: being written; see the issue 'The AFT family')."""

from __future__ import annotations


def aft_simple(*args, **kwargs):
    raise NotImplementedError("aft_simple is not implemented yet")
