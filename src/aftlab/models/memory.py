"""A model's memory from its config alone, checked before anything is built.

:func:`parameter_count` is exact for the built-in mixers (the shapes their constructors make,
in Python ints, so no size overflows); a mixer registered elsewhere is counted by building one
of it on the meta device, which allocates nothing. :func:`estimate_memory` adds what training
holds. :func:`check_memory` refuses what cannot fit; ``AFTLAB_MEMORY_CHECK=0`` switches it off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .._system import available_memory, env_off, format_bytes
from ..mixers import SequenceMixer, get_mixer_class
from ..mixers.aft.conv import AFTConvMixer
from ..mixers.aft.decay import AFTDecay
from ..mixers.aft.full import AFTFull
from ..mixers.aft.local import AFTLocal
from ..mixers.aft.simple import AFTSimple
from ..mixers.attention import MultiHeadAttention, NaiveMultiHeadAttention
from .blocks import mixer_from_config
from .config import RWKV4Config, TransformerConfig

__all__ = [
    "parameter_count",
    "estimate_memory",
    "check_memory",
    "check_model_fits",
    "BLOCK_OVERHEAD",
]

#: bytes of Python and torch objects per block beyond its tensors: a lower bound (measured
#: 36-48 KB for the built-in mixers, torch 2.13), so a deep stack of tiny blocks is counted
BLOCK_OVERHEAD = 32 * 2**10


def _option(config: TransformerConfig, cls: type[SequenceMixer], name: str) -> object:
    """``config.mixer_options[name]``, else the default of ``cls``'s constructor."""
    if name in config.mixer_options:
        return config.mixer_options[name]
    return inspect.signature(cls.__init__).parameters[name].default


def _size(value: object) -> int:
    """``value`` if it is an int > 0, else 0: a bad option is the mixer's to refuse."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else 0


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention(c: TransformerConfig, cls: type[SequenceMixer]) -> int:
    inner = c.n_heads * c.resolved_head_dim
    return _linear(c.d_model, 3 * inner, c.bias) + _linear(inner, c.d_model, c.bias)


def _aft(c: TransformerConfig, cls: type[SequenceMixer], key_dim: int | None = None) -> int:
    """``W^Q``, ``W^K`` (``key_dim`` wide), ``W^V`` and ``W^O`` of :class:`AFTMixer`, and the
    three mixes of its ``token_shift``."""
    d = c.d_model
    shift = 3 * d if c.mixer_options.get("token_shift") is True else 0
    return 3 * _linear(d, d, c.bias) + _linear(d, d if key_dim is None else key_dim, c.bias) + shift


def _position_bias(c: TransformerConfig, cls: type[SequenceMixer]) -> int:
    rank = _option(c, cls, "bias_rank")
    T = c.max_seq_len
    return _aft(c, cls) + (T * T if rank is None else 2 * T * _size(rank))


def _conv(c: TransformerConfig, cls: type[SequenceMixer]) -> int:
    s = _size(_option(c, cls, "kernel_size"))
    kernel = s * s if _option(c, cls, "grid") is not None else s
    return _aft(c, cls, key_dim=c.n_heads) + c.n_heads * (kernel + 2)  # w, gamma, beta


_MIXER_PARAMETERS: dict[type[SequenceMixer], Callable[..., int]] = {
    MultiHeadAttention: _attention,
    NaiveMultiHeadAttention: _attention,
    AFTSimple: _aft,
    AFTDecay: lambda c, cls: _aft(c, cls) + 2 * c.d_model,  # decays and bonus
    AFTFull: _position_bias,
    AFTLocal: _position_bias,
    AFTConvMixer: _conv,
}


def _mixer_parameters(config: TransformerConfig) -> int:
    cls = get_mixer_class(config.mixer)
    if cls in _MIXER_PARAMETERS:
        return _MIXER_PARAMETERS[cls](config, cls)
    with torch.device("meta"):
        return sum(p.numel() for p in mixer_from_config(config).parameters())


def _rwkv4_parameters(c: RWKV4Config) -> int:
    """:class:`~aftlab.models.RWKV4LM`: the embedding, ``ln0``, per block two norms, the time
    mix (``W_r, W_k, W_v, W_o``, decay, bonus, three mixes) and the channel mix (``W_k (r, d)``,
    ``W_r``, ``W_v (d, r)``, two mixes), ``ln_out`` and the head."""
    d, V, r = c.d_model, c.vocab_size, c.resolved_d_ff
    block = 4 * d + (4 * d * d + 5 * d) + (2 * d * r + d * d + 2 * d)
    return V * d + 2 * d + c.n_layers * block + 2 * d + (0 if c.tie_embeddings else V * d)


def parameter_count(
    config: TransformerConfig | RWKV4Config, *, num_classes: int | None = None
) -> int:
    """The parameters of the :class:`~aftlab.models.TransformerLM` ``config`` describes (an
    :class:`~aftlab.models.RWKV4LM` for an :class:`~aftlab.models.RWKV4Config`).

    With ``num_classes``: a :class:`~aftlab.models.TransformerClassifier`'s. A
    :class:`~aftlab.models.PixelTransformer` has ``d_model`` more (its start token). Exact for
    every registered mixer (tests/models/test_memory_estimate.py); a tied head is counted once.
    """
    if isinstance(config, RWKV4Config):
        if num_classes is not None:
            raise ValueError("parameter_count: an RWKV4Config has no classifier (num_classes)")
        return _rwkv4_parameters(config)
    d, V = config.d_model, config.vocab_size
    norm = 2 * d  # a LayerNorm's gain and bias
    r = config.resolved_d_ff
    ff = _linear(d, r, config.bias) + _linear(r, d, config.bias) if r else 0
    norms = (2 if r else 1) * norm if config.norm != "none" else 0
    block = _mixer_parameters(config) + ff + norms
    total = V * d + config.n_layers * block + (norm if config.final_norm else 0)
    if config.positional == "learned":
        total += config.max_seq_len * d
    if num_classes is not None:
        return total + _linear(d, num_classes, True)
    return total + (0 if config.tie_embeddings else V * d)


def estimate_memory(
    config: TransformerConfig | RWKV4Config,
    *,
    num_classes: int | None = None,
    dtype: torch.dtype | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_dtype: torch.dtype | None = None,
) -> int:
    """Bytes the model of ``config`` needs at least; with ``batch_size``, to train it.

    The parameters in ``dtype`` (default: torch's default dtype) and :data:`BLOCK_OVERHEAD`
    per block. Training adds a gradient and AdamW's two moments per parameter, and the
    activations autograd keeps for one micro-batch of ``batch_size`` sequences of ``seq_len``
    (default ``max_seq_len``) tokens in ``activation_dtype`` (default ``dtype``):
    ``B T (N (7 d + 2 d_ff) + d + 2 V)`` values (per block the norms' inputs, ``Q, K, V``, the
    mixer's output, both feed-forward activations; then the logits and their log-softmax). A
    lower bound: a run's peak also holds temporaries, the mixer's own saved tensors (e.g.
    attention-naive's ``B H T^2`` weights) and the allocator's slack. An
    :class:`~aftlab.models.RWKV4Config` is counted the same way (its blocks hold the same
    values: two norms' inputs, ``R, K, V``, the time mix's output, the channel mix's two).
    """
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    params = parameter_count(config, num_classes=num_classes)
    total = _model_bytes(config, params, itemsize)
    if batch_size is None:
        return total
    act = (activation_dtype or dtype or torch.get_default_dtype()).itemsize
    d, r = config.d_model, config.resolved_d_ff
    logits = 2 * config.vocab_size if num_classes is None else 0
    per_token = config.n_layers * (7 * d + 2 * r) + d + logits
    tokens = batch_size * (seq_len or config.max_seq_len)
    return total + 3 * params * itemsize + tokens * per_token * act


def _model_bytes(config: TransformerConfig, params: int, itemsize: int) -> int:
    """The weights of ``params`` parameters and :data:`BLOCK_OVERHEAD` per block."""
    return params * itemsize + config.n_layers * BLOCK_OVERHEAD


def check_memory(
    where: str, needed: int, what: str, *, device: torch.device | str | None = None
) -> None:
    """Refuse ``needed`` bytes (for ``what``) beyond the memory available on ``device``.

    ``device`` defaults to torch's default device (the meta device counts as RAM: its weights
    are loaded there later). Nothing is checked with ``AFTLAB_MEMORY_CHECK=0``, or where the
    available memory is unknown (:func:`aftlab._system.available_memory`).

    Raises:
        ValueError: one line with the estimate, the limit and the way out.
    """
    if env_off("AFTLAB_MEMORY_CHECK"):
        return
    device = torch.get_default_device() if device is None else torch.device(device)
    limit, source = available_memory(device if device.type == "cuda" else "cpu")
    if source != "unknown" and needed > limit:
        raise ValueError(
            f"{where}: {what} needs at least {format_bytes(needed)}, more than the "
            f"{format_bytes(limit)} available ({source}); make it smaller, or set "
            "AFTLAB_MEMORY_CHECK=0 to try anyway"
        )


def check_model_fits(
    where: str, config: TransformerConfig | RWKV4Config, *, num_classes: int | None = None
) -> None:
    """:func:`check_memory` of building the model of ``config`` (:func:`estimate_memory`)."""
    n, dtype = parameter_count(config, num_classes=num_classes), torch.get_default_dtype()
    what = f"the model ({n:,} parameters in {dtype}, {config.n_layers:,} blocks)"
    check_memory(where, _model_bytes(config, n, dtype.itemsize), what)
