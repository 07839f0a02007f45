"""The sequence-mixer interface every token mixer implements.

A mixer maps ``x: (B, T, d_model)`` to ``(B, T, d_model)``, mixing information across the
time axis (attention, or an AFT variant); the rest of a Transformer block (norms, residuals,
feed-forward) is shared. A model is built as ``mixer="<name>"`` through the registry in
:mod:`aftlab.mixers.registry`, everything else unchanged.

Conventions:
    * ``padding_mask`` is a bool tensor ``(B, T)``, **True for real tokens**, False for padding
      (the Hugging Face ``attention_mask`` convention). Padded keys contribute nothing; a query
      with no valid key yields zeros (after the output projection), never NaN.
    * A causal mixer decodes incrementally: ``state = init_state(B)`` then
      ``y_t, state = step(x_t, state)`` with ``x_t: (B, d_model)``; feeding tokens one by one
      must reproduce ``forward`` on the whole sequence.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_padding_mask, check_positive_int, check_tensor

__all__ = ["SequenceMixer", "MixerState"]

MixerState = Any  # each mixer defines its own state type (a small dataclass of tensors)


class SequenceMixer(nn.Module):
    """Base class of token mixers.

    Subclasses implement :meth:`forward`, and causal ones :meth:`init_state` and :meth:`step`.
    Every subclass accepts the common keyword-only constructor arguments below (and may ignore
    those it has no use for) plus its own options.

    Args:
        d_model: model width ``d``.
        n_heads: number of heads (attention, AFT-conv); ignored by mixers without heads.
        causal: if True, output ``t`` depends only on inputs ``<= t``.
        max_seq_len: longest sequence (``T_max``); required by mixers with a ``T_max x T_max``
            position bias, ignored by the others.
        dropout: dropout probability on the mixer output.
        bias: whether the projections have biases.
    """

    #: registry name, set by :func:`aftlab.mixers.register_mixer`
    name: ClassVar[str] = ""
    #: True for mixers that cannot see past ``max_seq_len`` positions, forward or decoding
    #: (a ``T_max x T_max`` position bias); callers such as ``generate`` check it up front.
    length_limited: ClassVar[bool] = False

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int = 1,
        causal: bool = False,
        max_seq_len: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        self.d_model = check_positive_int(where, "d_model", d_model)
        self.n_heads = check_positive_int(where, "n_heads", n_heads)
        if max_seq_len is not None:
            check_positive_int(where, "max_seq_len", max_seq_len)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"{where}: 'dropout' must be in [0, 1), got {dropout}")
        self.causal = bool(causal)
        self.max_seq_len = max_seq_len
        self.dropout_p = float(dropout)
        self.bias = bool(bias)

    # ----------------------------------------------------------------- validation
    def _check_input(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate ``x: (B, T, d_model)`` and ``padding_mask: (B, T)`` bool; return them."""
        where = type(self).__name__
        check_tensor(where, "x", x, shape=(None, None, self.d_model), floating=True)
        if padding_mask is not None:
            check_padding_mask(where, padding_mask, tuple(x.shape[:2]), "x", x)
        if self.length_limited and self.max_seq_len is not None and x.shape[1] > self.max_seq_len:
            raise ValueError(
                f"{where}: sequence length {x.shape[1]} of 'x' exceeds max_seq_len "
                f"(T_max) = {self.max_seq_len}"
            )
        return x, padding_mask

    def _check_step_input(self, x: torch.Tensor) -> torch.Tensor:
        where = type(self).__name__
        if not self.causal:
            raise RuntimeError(f"{where}: step() needs a causal mixer; this one has causal=False")
        return check_tensor(where, "x", x, shape=(None, self.d_model), floating=True)

    # ----------------------------------------------------------------- interface
    def forward(self, x: torch.Tensor, *, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mix ``x: (B, T, d_model)`` over time; returns ``(B, T, d_model)``."""
        raise NotImplementedError

    def init_state(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MixerState:
        """Return the empty decoding state for ``batch_size`` sequences (causal mixers only)."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """Process one token ``x: (B, d_model)`` at the state's position; return ``(y, state)``.

        ``y`` has shape ``(B, d_model)`` and equals row ``t`` of :meth:`forward` on the
        sequence so far. The returned state may be the same object, updated in place.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, causal={self.causal}"
