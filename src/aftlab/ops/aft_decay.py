"""AFT-decay (stub: being written; see the issue 'The AFT family')."""

from __future__ import annotations


def aft_decay(*args, **kwargs):
    raise NotImplementedError("aft_decay is not implemented yet")
