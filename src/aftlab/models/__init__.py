"""Models: the definition's seed Transformer and the practical Transformer family."""

from .config import TransformerConfig
from .seed import *  # noqa: F401,F403  (SeedTransformer)
from .transformer import *  # noqa: F401,F403  (TransformerLM, TransformerClassifier, PixelTransformer, ...)

__all__ = ["TransformerConfig"]
