"""AFT-local (stub: being written; see the issue 'The AFT family')."""

from __future__ import annotations


def aft_local(*args, **kwargs):
    raise NotImplementedError("aft_local is not implemented yet")
