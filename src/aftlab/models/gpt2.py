"""Hugging Face GPT-2 state dicts -> :class:`~aftlab.models.TransformerLM` (no HF import).

:func:`load_gpt2_state_dict` (``TransformerLM.from_gpt2_state_dict``) infers the config
(:func:`gpt2_config_from_state_dict`), renames the tensors (:func:`convert_gpt2_state_dict`) and
loads them, checking every name and shape.

GPT-2 is the practical Transformer with ``norm="pre"``, ``activation="gelu_tanh"`` (``gelu_new``),
``positional="learned"``, biases, ``layer_norm_eps=1e-5`` and a tied head. Its ``Conv1D`` layers
store ``W`` as ``(in, out)`` (``y = x W + b``), so each is transposed into ``nn.Linear``'s
``(out, in)``; ``attn.c_attn`` is already our fused ``qkv`` (queries, keys, values, heads in
order). The causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .._checks import check_state_dtypes
from .config import TransformerConfig
from .transformer import TransformerLM

__all__ = ["gpt2_config_from_state_dict", "convert_gpt2_state_dict", "load_gpt2_state_dict"]

_WHERE = "from_gpt2_state_dict"
_LAYER = re.compile(r"^h\.(\d+)\.")
_IGNORED = (".attn.bias", ".attn.masked_bias")


def _strip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``transformer.`` prefix (GPT2LMHeadModel) and the mask buffers."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{_WHERE}: 'state_dict' must be a mapping of tensors, got {type(state_dict).__name__}"
        )
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if not key.endswith(_IGNORED):
            out[key] = value
    return out


def _get(sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"{_WHERE}: 'state_dict' has no key {key!r} (is it a GPT-2 state dict?)")
    return sd[key]


def gpt2_config_from_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, n_heads: int, layer_norm_eps: float = 1e-5
) -> TransformerConfig:
    """Infer the GPT-2 :class:`TransformerConfig` from tensor shapes.

    ``vocab_size, d`` from ``wte`` ``(V, d)``; ``max_seq_len`` from ``wpe`` ``(n_positions, d)``;
    ``n_layers`` from the ``h.<i>`` keys; ``d_ff`` from ``mlp.c_fc`` ``(d, r)``. The number of
    heads is not in the shapes: pass it (``n_head`` of the HF config; 12 for GPT-2 small).

    Raises:
        ValueError: a missing key, or ``n_heads`` not dividing ``d``.
    """
    sd = _strip(state_dict)
    wte, wpe = _get(sd, "wte.weight"), _get(sd, "wpe.weight")
    layers = {int(m.group(1)) for k in sd if (m := _LAYER.match(k))}
    if not layers:
        raise ValueError(f"{_WHERE}: 'state_dict' has no 'h.<i>.' block keys")
    d = wte.shape[1]
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0 or d % n_heads:
        raise ValueError(
            f"{_WHERE}: 'n_heads' must be a positive divisor of n_embd = {d} "
            f"(n_heads * head_dim = n_embd), got {n_heads!r}"
        )
    lm_head = sd.get("lm_head.weight")
    return TransformerConfig(
        vocab_size=wte.shape[0],
        d_model=d,
        n_layers=max(layers) + 1,
        n_heads=n_heads,
        d_ff=_get(sd, "h.0.mlp.c_fc.weight").shape[1],
        max_seq_len=wpe.shape[0],
        mixer="attention",
        causal=True,
        norm="pre",
        activation="gelu_tanh",
        positional="learned",
        scaled=True,
        dropout=0.0,
        bias=True,
        tie_embeddings=lm_head is None or lm_head is wte or torch.equal(lm_head, wte),
        layer_norm_eps=layer_norm_eps,
        final_norm=True,
    )


def convert_gpt2_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: TransformerConfig
) -> dict[str, torch.Tensor]:
    """Rename and transpose a GPT-2 state dict into :class:`TransformerLM` keys.

    Returns:
        A state dict for ``TransformerLM(config).load_state_dict``.

    Raises:
        ValueError: a missing or unexpected key.
    """
    sd = _strip(state_dict)
    used: set[str] = set()

    def take(key: str, transpose: bool = False) -> torch.Tensor:
        used.add(key)
        t = _get(sd, key)
        return t.t().contiguous() if transpose else t

    out = {
        "backbone.token_embedding.weight": take("wte.weight"),
        "backbone.position_embedding.weight": take("wpe.weight"),
        "backbone.final_norm.weight": take("ln_f.weight"),
        "backbone.final_norm.bias": take("ln_f.bias"),
    }
    for i in range(config.n_layers):
        src, dst = f"h.{i}.", f"backbone.blocks.{i}."
        for a, b, conv in (
            ("ln_1", "norm1", False),
            ("attn.c_attn", "mixer.qkv", True),
            ("attn.c_proj", "mixer.out_proj", True),
            ("ln_2", "norm2", False),
            ("mlp.c_fc", "ff.fc1", True),
            ("mlp.c_proj", "ff.fc2", True),
        ):
            out[f"{dst}{b}.weight"] = take(f"{src}{a}.weight", transpose=conv)
            out[f"{dst}{b}.bias"] = take(f"{src}{a}.bias")
    if "lm_head.weight" in sd:
        out["head.weight"] = take("lm_head.weight")
    elif config.tie_embeddings:
        out["head.weight"] = out["backbone.token_embedding.weight"]
    unexpected = sorted(set(sd) - used)
    if unexpected:
        raise ValueError(f"{_WHERE}: unexpected key(s) in 'state_dict': {unexpected[:8]}")
    return out


def load_gpt2_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    config: TransformerConfig | None = None,
    n_heads: int | None = None,
    layer_norm_eps: float = 1e-5,
) -> TransformerLM:
    """Build a :class:`~aftlab.models.TransformerLM` from a GPT-2 state dict.

    The config is inferred from the shapes (:func:`gpt2_config_from_state_dict`) unless given;
    the number of heads is not in the shapes, so pass ``n_heads`` or a ``config``.

    Raises:
        ValueError: ``n_heads`` missing or not dividing ``n_embd``; a missing, unexpected or
            wrongly shaped tensor (named with expected and received shape), or one of a dtype
            that is not floating point (:func:`aftlab._checks.check_state_dtypes`).
    """
    where = "TransformerLM.from_gpt2_state_dict"
    if config is None:
        if n_heads is None:
            raise ValueError(
                f"{where}: pass 'n_heads' (GPT2Config.n_head; not recoverable from the "
                "shapes) or 'config'"
            )
        config = gpt2_config_from_state_dict(
            state_dict, n_heads=n_heads, layer_norm_eps=layer_norm_eps
        )
    model = TransformerLM(config)
    converted = convert_gpt2_state_dict(state_dict, config)
    own = model.state_dict()
    for key, value in converted.items():
        if key not in own:
            raise ValueError(
                f"{where}: 'state_dict' has {key!r}, which the config's model does not"
            )
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(
                f"{where}: {key!r} must have shape {tuple(own[key].shape)} for this config, "
                f"got {tuple(value.shape)}"
            )
    missing = sorted(set(own) - set(converted))
    if missing:
        raise ValueError(f"{where}: 'state_dict' lacks {missing[:8]} for this config")
    if config.tie_embeddings and not torch.equal(
        converted["head.weight"], converted["backbone.token_embedding.weight"]
    ):
        raise ValueError(
            f"{where}: config.tie_embeddings=True but lm_head.weight differs from wte.weight"
        )
    check_state_dtypes(where, {k: v.dtype for k, v in converted.items()}, own)
    model.load_state_dict(converted)
    return model
