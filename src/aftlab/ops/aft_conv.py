"""AFT-conv (stub: being written; see the issue 'The AFT family')."""

from __future__ import annotations


def aft_conv(*args, **kwargs):
    raise NotImplementedError("aft_conv is not implemented yet")
def aft_conv2d(*args, **kwargs):
    raise NotImplementedError("aft_conv2d is not implemented yet")
