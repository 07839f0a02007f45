"""Models: the definition's seed Transformer and the practical Transformer family."""

from . import seed as _seed
from . import transformer as _transformer
from .config import TransformerConfig
from .seed import *  # noqa: F401,F403  (SeedTransformer, SeedBlock)
from .transformer import *  # noqa: F401,F403  (TransformerLM, TransformerClassifier, PixelTransformer, ...)

__all__ = ["TransformerConfig", *_seed.__all__, *_transformer.__all__]
