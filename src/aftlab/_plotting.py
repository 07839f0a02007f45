"""matplotlib on demand, for the run's figures (``aftlab.train.plot``) and the bench's."""

from __future__ import annotations

from .errors import UsageError

__all__ = ["pyplot"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend; ``UsageError`` (one line) if not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "plotting needs matplotlib, which is not installed (pip install 'aftlab[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
