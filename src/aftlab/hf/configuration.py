"""``AftlabConfig``: a :class:`~aftlab.models.TransformerConfig` as a transformers config."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from ..models.config import TransformerConfig

__all__ = ["AftlabConfig"]

#: the TransformerConfig fields an AftlabConfig carries (``causal`` is always True for an LM;
#: ``tie_embeddings`` is stored as transformers' own ``tie_word_embeddings``)
_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(TransformerConfig)
    if f.name not in ("causal", "tie_embeddings")
)


class AftlabConfig(PretrainedConfig):
    """Hugging Face config of an aftlab causal language model (``model_type = "aftlab"``).

    Holds every field of :class:`~aftlab.models.TransformerConfig` under the same name (the
    mixer by its registry name, ``"attention"``, ``"aft-full"``, ..., and its ``mixer_options``),
    ``causal`` fixed to True; ``tie_embeddings`` is transformers' ``tie_word_embeddings``. The
    usual transformers names read the aftlab ones: ``hidden_size`` is ``d_model``,
    ``num_hidden_layers`` is ``n_layers``, ``num_attention_heads`` is ``n_heads``,
    ``max_position_embeddings`` is ``max_seq_len``. Defaults are TransformerConfig's; the
    values are validated by building the TransformerConfig (a ``ValueError`` names the field).

    Args:
        tie_embeddings: share the token embedding with the output head (``tie_word_embeddings``).
        use_cache: forward returns aftlab's decoding state as ``past_key_values`` by default.
        **kwargs: the TransformerConfig fields, then transformers' own config arguments.

    Example:
        >>> from aftlab.hf import AftlabConfig
        >>> cfg = AftlabConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2,
        ...                    mixer="aft-local", mixer_options={"window": 8})
        >>> cfg.to_transformer_config().mixer
        'aft-local'
    """

    model_type = "aftlab"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
        "tie_embeddings": "tie_word_embeddings",
    }

    def __init__(self, *, tie_embeddings: bool = True, use_cache: bool = True, **kwargs: Any):
        defaults = TransformerConfig()
        for name in _FIELDS:
            value = kwargs.pop(name, getattr(defaults, name))
            setattr(self, name, dict(value) if name == "mixer_options" else value)
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", tie_embeddings)
        super().__init__(**kwargs)
        self.to_transformer_config()  # validates every field

    def to_transformer_config(self) -> TransformerConfig:
        """The :class:`~aftlab.models.TransformerConfig` of this config (``causal=True``)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        return TransformerConfig(
            **fields, causal=True, tie_embeddings=bool(self.tie_word_embeddings)
        )

    @classmethod
    def from_transformer_config(cls, config: TransformerConfig, **kwargs: Any) -> AftlabConfig:
        """An AftlabConfig from a causal TransformerConfig (``kwargs``: transformers' options).

        Raises:
            TypeError: ``config`` is not a TransformerConfig.
            ValueError: ``config.causal`` is False (an encoder is not a causal LM).
        """
        if not isinstance(config, TransformerConfig):
            raise TypeError(
                "AftlabConfig.from_transformer_config: 'config' must be a TransformerConfig, "
                f"got {type(config).__name__}"
            )
        if not config.causal:
            raise ValueError(
                "AftlabConfig.from_transformer_config: 'config' must have causal=True "
                "(AftlabForCausalLM is a causal language model), got causal=False"
            )
        data = config.to_dict()
        del data["causal"]
        return cls(**data, **kwargs)
