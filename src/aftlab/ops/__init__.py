"""AFT kernels. Each module holds a fast op and, beside it, a float64 per-position reference
(``*_reference``) written straight from the formula, which the tests compare it against."""

from .aft_conv import aft_conv, aft_conv2d
from .aft_decay import aft_decay
from .aft_full import aft_full
from .aft_local import aft_local
from .aft_simple import aft_simple
from .scan import stable_prefix_average

__all__ = [
    "aft_full",
    "aft_local",
    "aft_simple",
    "aft_conv",
    "aft_conv2d",
    "aft_decay",
    "stable_prefix_average",
]
