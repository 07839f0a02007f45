"""Typed, validated configs with a JSON round trip (``to_dict`` / ``from_dict``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["TransformerConfig", "RWKV4Config", "ARCHITECTURES", "model_config_from_dict"]

_NORMS = ("pre", "post", "none")
_ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
_POSITIONAL = ("learned", "sinusoidal", "rotary", "none")
_INITS = ("gpt2", "torch")


#: the largest tensor dimension (torch sizes are int64)
_MAX_SIZE = 2**63 - 1


def _is_size(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and 0 < v <= _MAX_SIZE


def _fail(name: str, expected: str, got: Any, where: str = "TransformerConfig") -> None:
    raise ValueError(f"{where}: '{name}' must be {expected}, got {got!r}")


@dataclass
class TransformerConfig:
    """Configuration of the practical Transformer and its mixer-swapped variants.

    Every model in :mod:`aftlab.models` (language model, classifier, pixel model) takes one.
    ``mixer`` names a registered token mixer (``"attention"``, ``"aft-full"``, ...); all other
    fields stay the same when it changes.

    Attributes:
        vocab_size: number of token ids (256 for bytes/pixels).
        d_model: model width ``d``.
        n_layers: number of blocks ``N``.
        n_heads: heads ``H`` of the mixer (attention, AFT-conv).
        head_dim: per-head width ``m``; defaults to ``d_model // n_heads``.
        d_ff: feed-forward hidden width ``r``; defaults to ``4 * d_model``; 0: no feed-forward
            (a block is its mixer alone, as in Zoology's MQAR models).
        max_seq_len: longest sequence ``T_max`` (learned positions, AFT-full/local biases).
        mixer: registry name of the token mixer.
        mixer_options: extra keyword arguments of the mixer (e.g. ``{"window": 32}``).
        causal: causal (language/pixel model) or bidirectional (encoder).
        norm: LayerNorm placement: ``"pre"`` (GPT-2), ``"post"`` (original paper) or ``"none"``.
        activation: feed-forward activation: ``"gelu"``, ``"gelu_tanh"`` (GPT-2) or ``"relu"``.
        positional: ``"learned"``, ``"sinusoidal"``, ``"rotary"`` (attention only) or ``"none"``.
        scaled: scale attention logits by ``1/sqrt(head_dim)`` (False gives the definition's form).
        dropout: dropout probability (embeddings, mixer output, feed-forward output).
        bias: biases in linear layers.
        tie_embeddings: share the token embedding with the output head.
        layer_norm_eps: LayerNorm epsilon.
        final_norm: LayerNorm after the last block (pre-LN models).
        init: weight initialisation: ``"gpt2"`` (linear weights and embeddings
            ``N(0, 0.02^2)``, residual projections ``N(0, (0.02/sqrt(2 N))^2)``, biases 0, then
            each mixer's own hook; docs/transformer.md) or ``"torch"`` (PyTorch's default for
            the linear layers, embeddings ``N(0, 0.02^2)``: the scheme before GPT-2's was adopted,
            kept to measure against).
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 1024
    mixer: str = "attention"
    mixer_options: dict[str, Any] = field(default_factory=dict)
    causal: bool = True
    norm: str = "pre"
    activation: str = "gelu"
    positional: str = "learned"
    scaled: bool = True
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    final_norm: bool = True
    init: str = "gpt2"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if not _is_size(getattr(self, name)):
                _fail(name, "a positive int below 2**63", getattr(self, name))
        if self.head_dim is not None and not _is_size(self.head_dim):
            _fail("head_dim", "a positive int below 2**63, or None", self.head_dim)
        no_ff = type(self.d_ff) is int and self.d_ff == 0
        if self.d_ff is not None and not (_is_size(self.d_ff) or no_ff):
            _fail("d_ff", "a non-negative int below 2**63 (0: no feed-forward), or None", self.d_ff)
        if self.head_dim is None and self.d_model % self.n_heads:
            _fail(
                "n_heads",
                f"a divisor of d_model={self.d_model} when head_dim is not given",
                self.n_heads,
            )
        if self.norm not in _NORMS:
            _fail("norm", f"one of {_NORMS}", self.norm)
        if self.activation not in _ACTIVATIONS:
            _fail("activation", f"one of {_ACTIVATIONS}", self.activation)
        if self.positional not in _POSITIONAL:
            _fail("positional", f"one of {_POSITIONAL}", self.positional)
        if self.init not in _INITS:
            _fail("init", f"one of {_INITS}", self.init)
        if not isinstance(self.mixer, str):
            _fail("mixer", "a registered mixer name (str)", self.mixer)
        if not isinstance(self.mixer_options, dict):
            _fail("mixer_options", "a dict", self.mixer_options)
        try:
            json.dumps(self.mixer_options)
        except (TypeError, ValueError):
            _fail("mixer_options", "a JSON-serialisable dict", self.mixer_options)
        for name in ("dropout", "layer_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _fail(name, "a number", v)
        if not 0.0 <= self.dropout < 1.0:
            _fail("dropout", "in [0, 1)", self.dropout)
        if not self.layer_norm_eps > 0:
            _fail("layer_norm_eps", "> 0", self.layer_norm_eps)
        for name in ("causal", "scaled", "bias", "tie_embeddings", "final_norm"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "a bool", getattr(self, name))

    # derived sizes ------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, or ``d_model // n_heads`` when unset."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        """``d_ff``, or ``4 * d_model`` when unset (0: no feed-forward)."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    # serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build from :meth:`to_dict` output; unknown keys raise ``ValueError`` naming them."""
        if not isinstance(data, dict):
            raise TypeError(
                f"TransformerConfig.from_dict: expected a dict, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"TransformerConfig: unknown field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        return cls.from_dict(json.loads(text))


@dataclass
class RWKV4Config:
    """Configuration of :class:`~aftlab.models.rwkv4.RWKV4LM` (Hugging Face's ``RwkvConfig``).

    Attributes:
        vocab_size: number of token ids (50277 for the released Pile models).
        d_model: width ``d`` (``hidden_size``).
        n_layers: number of blocks (``num_hidden_layers``).
        d_ff: the channel mix's hidden width (``intermediate_size``); defaults to ``4 * d_model``.
        max_seq_len: the context trained on (``context_length``): the window length of
            training and the chunk of a long prompt's prefill; not a limit, RWKV-4 runs any
            length.
        layer_norm_eps: LayerNorm epsilon (``layer_norm_epsilon``).
        rescale_every: in eval mode, halve the hidden state after every ``rescale_every``
            blocks (0: never), as Hugging Face does (:class:`~aftlab.models.rwkv4.RWKV4LM`).
        tie_embeddings: share the token embedding with the head (False for RWKV-4).
    """

    #: the ``architecture`` key of :meth:`to_dict`, which tells this config from a
    #: :class:`TransformerConfig` in a saved dict (:func:`model_config_from_dict`)
    architecture: ClassVar[str] = "rwkv4"

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    d_ff: int | None = None
    max_seq_len: int = 1024
    layer_norm_eps: float = 1e-5
    rescale_every: int = 6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        where = "RWKV4Config"
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
            if not _is_size(getattr(self, name)):
                _fail(name, "a positive int below 2**63", getattr(self, name), where)
        if self.d_ff is not None and not _is_size(self.d_ff):
            _fail("d_ff", "a positive int below 2**63, or None", self.d_ff, where)
        r = self.rescale_every
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            _fail("rescale_every", "an int >= 0 (0: never)", r, where)
        v = self.layer_norm_eps
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            _fail("layer_norm_eps", "a number > 0", v, where)
        if not isinstance(self.tie_embeddings, bool):
            _fail("tie_embeddings", "a bool", self.tie_embeddings, where)

    @property
    def resolved_d_ff(self) -> int:
        """``d_ff``, or ``4 * d_model`` when unset."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field, and ``"architecture": "rwkv4"``."""
        return {"architecture": self.architecture, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RWKV4Config:
        """Build from :meth:`to_dict` output; unknown keys raise ``ValueError`` naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"RWKV4Config.from_dict: expected a dict, got {type(data).__name__}")
        data = dict(data)
        arch = data.pop("architecture", cls.architecture)
        if arch != cls.architecture:
            raise ValueError(f"RWKV4Config: 'architecture' must be 'rwkv4', got {arch!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"RWKV4Config: unknown field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RWKV4Config:
        return cls.from_dict(json.loads(text))


#: the model configs by their ``architecture`` key
ARCHITECTURES: dict[str, type] = {"transformer": TransformerConfig, "rwkv4": RWKV4Config}


def model_config_from_dict(data: dict[str, Any]) -> TransformerConfig | RWKV4Config:
    """The config a saved dict describes: its ``"architecture"`` (default ``"transformer"``)."""
    arch = data.get("architecture", "transformer") if isinstance(data, dict) else "transformer"
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model config: 'architecture' must be one of {sorted(ARCHITECTURES)}, got {arch!r}"
        )
    if arch == "transformer" and isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != "architecture"}
    return ARCHITECTURES[arch].from_dict(data)
