"""The ``rwkv4`` mixer: RWKV-4's time mixing, aft-decay with the token shift.

RWKV-4 (Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era", eqs. 11-16) with
``X'_t = X_{t-1}`` (zeros at ``t = 0``; the state's last input when continuing)::

    r_t = W_r (mu_r X_t + (1 - mu_r) X'_t),  k_t = W_k (mu_k ...),  v_t = W_v (mu_v ...)
    wkv_t = [sum_{t'<t} e^{-(t-1-t') w + k_t'} v_t' + e^{u + k_t} v_t]
            / [sum_{t'<t} e^{-(t-1-t') w + k_t'}     + e^{u + k_t}]
    Y_t = W_o (sigma(r_t) * wkv_t)

with per-channel decay ``w = exp(time_decay)`` and bonus ``u = time_first``: the ``aft-decay``
mixer (:class:`~aftlab.mixers.aft.decay.AFTDecay`, whose ``Q`` is RWKV's receptance ``r``) with
``token_shift=True`` (:class:`~aftlab.mixers.aft.common.AFTMixer`). Its parameters map to
Hugging Face's ``RwkvSelfAttention`` as ``to_q``/``to_k``/``to_v``/``proj`` = ``receptance``/
``key``/``value``/``output``, ``time_decay``, ``time_bonus`` = ``time_first``, ``mix_q``/``mix_k``/
``mix_v`` = ``time_mix_receptance``/``time_mix_key``/``time_mix_value``. The full model (with
RWKV-4's channel mix): :class:`aftlab.models.rwkv4.RWKV4LM`.
"""

from __future__ import annotations

from ..registry import register_mixer
from .decay import AFTDecay

__all__ = ["RWKV4TimeMix"]


@register_mixer("rwkv4")
class RWKV4TimeMix(AFTDecay):
    """RWKV-4's time mixing (causal only): :class:`AFTDecay` with the token shift always on.

    Args:
        **options: those of :class:`AFTDecay` (``layer_idx``, ``n_layers``, the common ones);
            ``token_shift`` is not one (always on: ``aft-decay`` is this mixer without it).

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``;
        ``step``: ``x (B, d)`` -> ``(B, d)``; the decoding state is a
        :class:`~aftlab.mixers.aft.common.ShiftedState` (the last input, RWKV's ``aa, bb, pp``).
    """

    def __init__(self, **options) -> None:
        if "token_shift" in options:
            raise TypeError(
                "RWKV4TimeMix: 'token_shift' is not an option (the rwkv4 mixer always shifts "
                "tokens; aft-decay is the same mixer without the shift)"
            )
        super().__init__(token_shift=True, **options)
