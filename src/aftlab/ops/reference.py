"""The one float64 reference every AFT op is checked against: a loop over query positions.

Every AFT variant is the same biased average with its own bias ``b_{t,t'}`` (AFT paper eq. 2)::

    Y_t = sigma(Q_t) * sum_{t' in S_t} exp(K_t' + b_{t,t'}) V_t'
                     / sum_{t' in S_t} exp(K_t' + b_{t,t'})

with ``S_t`` the keys query ``t`` sees (all, or ``t' <= t`` causal, minus padding). Each
``*_reference`` of :mod:`aftlab.ops` only says what its bias is:

========================  =====================================================================
op                        ``b_{t,t'}``
========================  =====================================================================
``aft_full``              ``w_{t,t'}``
``aft_local``             ``w_{t,t'}`` inside ``|t - t'| < s``, else 0
``aft_simple``            0
``aft_conv`` (1-D, 2-D)   the head's kernel ``w[t' - t + l]`` inside the kernel, else 0
``aft_decay``             ``-(t - 1 - t') lambda`` for ``t' < t``, ``u`` at ``t' = t`` (causal)
========================  =====================================================================

The loop is slow on purpose: one query at a time, in float64, each row shifted by its own
maximum over the keys it sees (``exp(z - max z)`` leaves the ratio unchanged and is at most 1),
so nothing a query does not see can reach it, not even through a shift.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["biased_average_reference"]

BiasRow = Callable[[int], torch.Tensor]
#: ``t -> (L_t, A_t)``: the log-sum ``(B, *Fk)`` and average ``(B, *F)`` of the keys before the
#: sequence (a state's summary, as query ``t`` weighs it); ``L = -inf`` for none
PastRow = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def biased_average_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias_row: BiasRow | None = None,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    past: PastRow | None = None,
) -> torch.Tensor:
    """Float64 ``Y_t = sigma(Q_t) * sum_{t' in S_t} softmax_t'(K_t' + b_{t,t'}) V_t'``, row by row.

    Args:
        q: ``(B, T, *F)``; ``F`` the feature dims, e.g. ``(d,)`` or ``(h, c)``.
        k: ``(B, T, *Fk)``, broadcastable against ``v`` (aft-conv: one key per head).
        v: ``(B, T, *F)``.
        bias_row: ``t -> b_{t, :}``, a tensor of shape ``(T, ...)`` broadcastable against
            ``k[0]`` (``(T, 1)`` for a bias shared by the channels, ``(T, d)`` per channel,
            ``(T, h, 1)`` per head); None for no bias. Entries of unseen keys are ignored.
        causal: query ``t`` sees only ``t' <= t``.
        padding_mask: ``(B, T)`` bool, True where a key is real.
        past: ``t -> (L_t, A_t)``, the keys that came before the sequence (a chunk's initial
            state) as one more term of every row: ``exp(L_t)`` joins the denominator and
            ``exp(L_t) A_t`` the numerator. None: no past.

    Returns:
        ``(B, T, *F)`` float64, differentiable. A query that sees no key gives 0; a NaN or inf
        among the inputs it sees gives NaN in the channels it reaches.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, T = q.shape[:2]
    extra = (1,) * (v.dim() - 2)
    valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
    if padding_mask is not None:
        valid = valid & padding_mask.to(q.device)
    pos = torch.arange(T, device=q.device)
    rows = []
    for t in range(T):
        seen = valid & (pos <= t) if causal else valid  # (B, T)
        seen = seen.view(B, T, *extra)
        z = k if bias_row is None else k + bias_row(t).double()
        z = z.masked_fill(~seen, float("-inf"))  # an unseen NaN never enters
        m = z.amax(1, keepdim=True).detach()
        if past is not None:
            Lp, Ap = (x.double() for x in past(t))
            m = torch.maximum(m, Lp[:, None].detach())
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # nothing seen: 0, not NaN
        e = torch.exp(z - m)
        den = e.sum(1)  # >= 1 when a key is seen, 0 when none is, NaN when a NaN is
        num = (e * v.masked_fill(~seen, 0.0)).sum(1)
        if past is not None:
            ep = torch.exp(Lp - m[:, 0])  # 0 for no past (L = -inf)
            den, num = den + ep, num + ep * Ap
        empty = den == 0
        avg = torch.where(empty, 0.0, num / torch.where(empty, 1.0, den))
        rows.append(torch.sigmoid(q[:, t]) * avg)
    return torch.stack(rows, 1) if rows else q.new_zeros(q.shape)
