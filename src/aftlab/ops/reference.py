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

from .state import RunningSums

__all__ = ["biased_average_reference", "running_sums_past", "running_sums_reference"]

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


def running_sums_past(state: RunningSums, decay: torch.Tensor | None = None) -> PastRow:
    """The :data:`PastRow` of a :class:`~aftlab.ops.state.RunningSums`, in float64: query ``t``
    weighs the state's keys by ``exp(L - t lambda)`` (``lambda = 0`` without ``decay``) with
    ``L = p + log b``, and their average is ``A = a / b`` (``L = -inf``, ``A = 0``: empty)."""
    s64 = RunningSums(state.a.double(), state.b.double(), state.p.double())
    L, A = s64.log_sum(), s64.average()
    if decay is None:
        return lambda t: (L, A)
    lam = decay.double().to(L.device)
    return lambda t: (L - t * lam, A)


def running_sums_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    decay: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    initial_state: RunningSums | None = None,
) -> RunningSums:
    """Float64 state after the tokens ``k, v: (B, T, d)`` (slow, obvious; for tests)::

        L = log [sum_{t' valid} exp(K_t' - (T-1-t') lambda) + exp(L_0 - T lambda)]
        A = [sum_{t' valid} exp(K_t' - (T-1-t') lambda - L) V_t' + exp(L_0 - T lambda - L) A_0]

    with ``(L_0, A_0)`` the ``initial_state``'s log-sum and average (no term without one),
    ``lambda = 0`` without ``decay``. Returned as ``RunningSums(a=A, b=1, p=L)`` (``a = b = 0``,
    ``p = -inf`` when no key is seen), ``position`` = the initial one + ``T``: compare states
    through :meth:`~RunningSums.log_sum` and :meth:`~RunningSums.average` (``(p, a, b)`` of one
    state is not unique).
    """
    k, v = k.double(), v.double()
    B, T, d = k.shape
    lam = torch.zeros(d, dtype=torch.float64, device=k.device)
    if decay is not None:
        lam = decay.double().to(k.device)
    terms = []  # (exponent, value) pairs, (B, d) each
    if initial_state is not None:
        L0, A0 = running_sums_past(initial_state, lam)(T)  # L_0 - T lambda
        terms.append((L0, A0))
    for t in range(T):
        ok = torch.ones(B, 1, dtype=torch.bool, device=k.device)
        if padding_mask is not None:
            ok = padding_mask[:, t, None].to(k.device)
        z = torch.where(ok, k[:, t] - (T - 1 - t) * lam, float("-inf"))
        terms.append((z, torch.where(ok, v[:, t], 0.0)))
    if not terms:
        L, A = k.new_full((B, d), float("-inf")), v.new_zeros(B, d)
    else:
        Z = torch.stack([z for z, _ in terms], 1)  # (B, n, d)
        L = torch.logsumexp(Z, 1)
        shift = torch.where(torch.isfinite(L), L, 0.0)[:, None]
        A = (torch.exp(Z - shift) * torch.stack([a for _, a in terms], 1)).sum(1)
    empty = L == float("-inf")
    position = T + (0 if initial_state is None else initial_state.position)
    b = torch.where(empty, 0.0, torch.ones_like(L))
    return RunningSums(a=torch.where(empty, 0.0, A), b=b, p=L, position=position)
