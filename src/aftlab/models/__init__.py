"""Models: the definition's seed Transformer, the practical Transformer family and RWKV-4."""

from . import seed as _seed
from . import transformer as _transformer
from .config import RWKV4Config, TransformerConfig
from .rwkv4 import RWKV4LM
from .seed import *  # noqa: F401,F403  (SeedTransformer, SeedBlock)
from .transformer import *  # noqa: F401,F403  (TransformerLM, TransformerClassifier, PixelTransformer, ...)

__all__ = [
    "TransformerConfig",
    "RWKV4Config",
    "RWKV4LM",
    *_seed.__all__,
    *_transformer.__all__,
]
