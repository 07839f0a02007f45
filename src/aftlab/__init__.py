"""aftlab: the Transformer and the Attention Free Transformer (AFT), exact and fast.

Layout:
    aftlab.functional  the formulas as functions (seed Transformer, AFT ops)
    aftlab.ops         AFT kernels, each with a float64 reference beside it
    aftlab.mixers      token mixers (``attention``, ``aft-*``) behind one interface and a registry
    aftlab.models      the seed Transformer, the practical Transformer models, configs
    aftlab.data, aftlab.train, aftlab.cli, aftlab.bench   using them for real
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("aftlab")  # one source of truth: pyproject.toml's version
except PackageNotFoundError:  # pragma: no cover - src/ on sys.path without an install
    __version__ = "0+unknown"
del PackageNotFoundError, version
