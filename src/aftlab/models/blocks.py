"""The Transformer block around any registered token mixer: norms, feed-forward, residuals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._checks import check_tensor
from ..mixers import MixerState, SequenceMixer, build_mixer, get_mixer_class
from ..mixers.base import COMMON_ARGS, mark_residual_projection
from .config import TransformerConfig

__all__ = ["CONFIG_OPTIONS", "FeedForward", "TransformerBlock", "mixer_from_config"]

#: The mixer options a model fills from its config, by the names a mixer declares in
#: ``config_options``: ``(config, layer_idx) -> value``.
CONFIG_OPTIONS: dict[str, Callable[[TransformerConfig, int], Any]] = {
    "head_dim": lambda c, i: c.resolved_head_dim,
    "scaled": lambda c, i: c.scaled,
    "rotary": lambda c, i: c.positional == "rotary",
    "layer_idx": lambda c, i: i,  # depth-dependent initialisation (aft-decay)
    "n_layers": lambda c, i: c.n_layers,
}

#: Config fields only some mixers honour: how each shows and whether the config asks for it
#: (a value a mixer without the option could not deliver).
_ASKED = {
    "head_dim": lambda c: (f"head_dim={c.head_dim}", c.n_heads * c.resolved_head_dim != c.d_model),
    "scaled": lambda c: ("scaled=False", not c.scaled),
    "rotary": lambda c: ("positional='rotary'", c.positional == "rotary"),
}


def mixer_from_config(config: TransformerConfig, *, layer_idx: int = 0) -> SequenceMixer:
    """The mixer of block ``layer_idx`` of a model configured by ``config``.

    :func:`~aftlab.mixers.build_mixer` with the common arguments (``COMMON_ARGS``) from the
    config fields of the same names, the options the mixer declares in ``config_options``
    (:data:`CONFIG_OPTIONS`) and the mixer's own ``config.mixer_options``. The config's attention
    fields reach only a mixer that takes them; with any other, ``positional="rotary"``,
    ``scaled=False`` or a ``head_dim`` other than ``d_model / n_heads`` ask for what it cannot do.

    Raises:
        ValueError: ``mixer_options`` repeating an argument the config sets; an attention
            field the mixer does not take; an option the mixer does not know.
    """
    cls = get_mixer_class(config.mixer)
    unknown = sorted(set(cls.config_options) - set(CONFIG_OPTIONS))
    if unknown:
        raise ValueError(
            f"mixer {config.mixer!r}: config_options {unknown} are not config options; known: "
            f"{sorted(CONFIG_OPTIONS)}"
        )
    own = dict(config.mixer_options)
    clash = sorted(set(own) & {*COMMON_ARGS, *_ASKED, *cls.config_options})
    if clash:
        raise ValueError(
            f"TransformerConfig: mixer_options {clash} are TransformerConfig fields "
            "(or derived from 'positional'); set them there, not in mixer_options"
        )
    for name, asked in _ASKED.items():
        shown, needed = asked(config)
        if needed and name not in cls.config_options:
            raise ValueError(
                f"TransformerConfig: {shown} needs a mixer that accepts '{name}' "
                f"(e.g. 'attention'); mixer {config.mixer!r} does not"
            )
    common = {name: getattr(config, name) for name in COMMON_ARGS}
    derived = {name: CONFIG_OPTIONS[name](config, layer_idx) for name in cls.config_options}
    return build_mixer(config.mixer, **common, **own, **derived)


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``FF(x) = dropout(act(x W_1 + b_1) W_2 + b_2)``.

    ``W_1: d -> r``, ``W_2: r -> d``; ``act`` is ReLU, GELU (erf) or GELU (tanh approximation,
    GPT-2's ``gelu_new``). Shapes: ``(..., d) -> (..., d)``. ``fc2`` (``W_2``) is marked a
    residual projection (:func:`~aftlab.mixers.base.mark_residual_projection`).
    """

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str, dropout: float, bias: bool
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.act = {
            "relu": nn.ReLU(),
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),
        }[activation]
        self.fc2 = mark_residual_projection(nn.Linear(d_ff, d_model, bias=bias))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class TransformerBlock(nn.Module):
    """One block: a token mixer and a feed-forward, each in a residual branch (``d_ff = 0``: the
    mixer's alone, ``out = h``).

    With ``Mix`` the mixer (its output dropout included) and ``LN`` LayerNorm:

    * ``norm="pre"`` (GPT-2): ``h = x + Mix(LN_1(x))``; ``out = h + FF(LN_2(h))``
    * ``norm="post"`` (Vaswani et al.): ``h = LN_1(x + Mix(x))``; ``out = LN_2(h + FF(h))``
    * ``norm="none"`` (the definition): ``h = x + Mix(x)``; ``out = h + FF(h)``

    Args:
        config: the model config; the mixer is
            ``mixer_from_config(config, layer_idx=layer_idx)`` (:func:`mixer_from_config`).
        layer_idx: the block's index in the stack (depth-dependent mixer initialisation).

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` -> ``(B, T, d)``;
        ``prefill``: ``x (B, T, d)`` and a mixer state (or None) -> ``(B, T, d)`` and the mixer
        state after the ``T`` tokens;
        ``step``: ``x (B, d)`` and the mixer state -> ``(B, d)`` and the state.
    """

    def __init__(self, config: TransformerConfig, *, layer_idx: int = 0) -> None:
        super().__init__()
        d = self.d_model = config.d_model
        self.norm = config.norm
        self.mixer: SequenceMixer = mixer_from_config(config, layer_idx=layer_idx)
        ff = config.resolved_d_ff  # 0: no feed-forward and no second norm, the mixer's branch
        self.ff = None
        if ff:
            self.ff = FeedForward(
                d, ff, activation=config.activation, dropout=config.dropout, bias=config.bias
            )
        make_norm = (
            (lambda: nn.LayerNorm(d, eps=config.layer_norm_eps))
            if config.norm != "none"
            else nn.Identity
        )
        self.norm1 = make_norm()
        self.norm2 = make_norm() if ff else None

    def _residual(
        self, x: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if self.norm == "post":
            h = self.norm1(x + mix(x))
            return h if self.ff is None else self.norm2(h + self.ff(h))
        h = x + mix(self.norm1(x))
        return h if self.ff is None else h + self.ff(self.norm2(h))

    def forward(
        self,
        x: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block on ``x: (B, T, d)``; the mixer gets ``padding_mask`` or ``cu_seqlens``
        (packed documents, :meth:`~aftlab.mixers.SequenceMixer.forward`)."""
        check_tensor("TransformerBlock", "x", x, shape=(None, None, self.d_model), floating=True)
        return self._residual(
            x, lambda u: self.mixer(u, padding_mask=padding_mask, cu_seqlens=cu_seqlens)
        )

    def _residual_with_state(
        self, x: torch.Tensor, mix: Callable[[torch.Tensor], tuple[torch.Tensor, MixerState]]
    ) -> tuple[torch.Tensor, MixerState]:
        """:meth:`_residual` around a mixer call that also returns its decoding state."""
        out: list[MixerState] = []

        def keep(u: torch.Tensor) -> torch.Tensor:
            y, new_state = mix(u)
            out.append(new_state)
            return y

        return self._residual(x, keep), out[0]

    def prefill(
        self, x: torch.Tensor, state: MixerState | None = None
    ) -> tuple[torch.Tensor, MixerState]:
        """The block on ``x: (B, T, d)`` after the mixer state ``state`` (None: the empty one),
        and the mixer state after the ``T`` tokens.

        The mixer's :meth:`~aftlab.mixers.SequenceMixer.prefill`: one parallel pass for every
        built-in mixer from the empty state. Checks ``x`` (before the first norm reads it); the
        mixer its own input and ``state``.
        """
        shape = (None, None, self.d_model)
        check_tensor("TransformerBlock.prefill", "x", x, shape=shape, floating=True)
        return self._residual_with_state(x, lambda u: self.mixer.prefill(u, state))

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One decoding step of the block; norms and feed-forward act per token.

        Checks ``x``; the mixer its own input and ``state``
        (:meth:`~aftlab.mixers.SequenceMixer.step`).
        """
        check_tensor("TransformerBlock.step", "x", x, shape=(None, self.d_model), floating=True)
        return self._residual_with_state(x, lambda u: self.mixer.step(u, state))

    # the backbone's calls, on inputs its model validated: the mixer's hooks, unchecked
    def _prefill(
        self, x: torch.Tensor, state: MixerState | None = None
    ) -> tuple[torch.Tensor, MixerState]:
        """:meth:`prefill` unchecked: the mixer's :meth:`~aftlab.mixers.SequenceMixer._prefill`."""
        return self._residual_with_state(x, lambda u: self.mixer._prefill(u, state))

    def _step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """:meth:`step` unchecked: the mixer's :meth:`~aftlab.mixers.SequenceMixer._step`."""
        return self._residual_with_state(x, lambda u: self.mixer._step(u, state))
