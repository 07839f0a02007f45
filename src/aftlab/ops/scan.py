"""Stable prefix sums of exponentials: the primitive behind every causal AFT sum.

For keys ``k`` and values ``v`` of shape ``(B, T, d)`` and an optional per-channel decay
``lambda >= 0`` of shape ``(d,)`` it returns, for every position t (elementwise over d):

    L_t = log sum_{t' <= t} exp(k_t' - (t - t') * lambda)
    A_t = sum_{t' <= t} exp(k_t' - (t - t') * lambda - L_t) * v_t'

so that ``sum_{t'<=t} exp(k_t' - (t-t') lambda) v_t' = exp(L_t) * A_t`` without ever forming
the (possibly overflowing) sum itself. ``A_t`` is a convex combination of values, hence bounded.
With ``reverse=True`` the sums run over ``t' >= t`` with ``(t' - t) * lambda``.
Keys where ``padding_mask`` is False contribute nothing; where no key contributes,
``L_t = -inf`` and ``A_t = 0``.

TODO(scan helper): replace the sequential loop with a fast chunked scan; keep this loop as
:func:`stable_prefix_average_reference`.
"""

from __future__ import annotations

import torch

__all__ = ["stable_prefix_average", "stable_prefix_average_reference"]


def stable_prefix_average_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    decay: torch.Tensor | None = None,
    reverse: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential recurrence (slow, obvious). Shapes: k, v ``(B, T, d)``; returns ``(L, A)``.

    L_t = logaddexp(L_{t-1} - lambda, k_t);  A_t = exp(L_{t-1} - lambda - L_t) A_{t-1} + exp(k_t - L_t) v_t
    """
    B, T, d = k.shape
    if reverse:
        L, A = stable_prefix_average_reference(
            k.flip(1), v.flip(1), decay=decay,
            padding_mask=None if padding_mask is None else padding_mask.flip(1),
        )
        return L.flip(1), A.flip(1)
    lam = torch.zeros(d, dtype=k.dtype, device=k.device) if decay is None else decay.to(k.dtype)
    neg_inf = torch.full((B, d), float("-inf"), dtype=k.dtype, device=k.device)
    l_prev, a_prev = neg_inf, torch.zeros(B, d, dtype=v.dtype, device=v.device)
    Ls, As = [], []
    for t in range(T):
        kt = k[:, t]
        if padding_mask is not None:
            kt = torch.where(padding_mask[:, t, None], kt, neg_inf)
        carried = l_prev - lam
        l_t = torch.logaddexp(carried, kt)
        safe = torch.where(torch.isfinite(l_t), l_t, torch.zeros_like(l_t))
        a_t = torch.exp(carried - safe).nan_to_num(0.0) * a_prev + torch.exp(kt - safe).nan_to_num(0.0) * v[:, t]
        Ls.append(l_t)
        As.append(a_t)
        l_prev, a_prev = l_t, a_t
    return torch.stack(Ls, 1), torch.stack(As, 1)


stable_prefix_average = stable_prefix_average_reference
