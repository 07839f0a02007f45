"""AFT-full (stub: being written; see the issue 'The AFT family')."""

from __future__ import annotations


def aft_full(*args, **kwargs):
    raise NotImplementedError("aft_full is not implemented yet")
