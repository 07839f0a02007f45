"""AFT-decay, the RWKV form of AFT: ``w_{t,t'} = -(t - 1 - t') lambda``, bonus ``u`` at ``t' = t``.

Causal only. Elementwise over the channel, with per-channel decay ``lambda >= 0`` and bonus
``u`` (both ``(d,)``)::

    Y_t = sigma(Q_t) * [sum_{t'<t} exp(-(t-1-t') lambda + K_t') V_t' + exp(u + K_t) V_t]
                     / [sum_{t'<t} exp(-(t-1-t') lambda + K_t')        + exp(u + K_t)]

The past part is the prefix ``(L_{t-1}, A_{t-1})`` of
:func:`aftlab.ops.scan.stable_prefix_average` with decay ``lambda`` (``exp(L_{t-1}) A_{t-1}``
is the numerator's sum over ``t' <= t - 1``), so with ``w_t = sigmoid(u + K_t - L_{t-1})``::

    Y_t = sigma(Q_t) * ((1 - w_t) A_{t-1} + w_t V_t)

(``w_0 = 1``: the first token only sees itself). Time and memory ``O(B T d)``; finite and
exact for any finite input, since only sigmoids and the scan's non-positive exponents are
evaluated: the sigmoid's argument is formed in halves, ``2 ((u/2 + K_t/2) - L_{t-1}/2)``, so
that it never meets ``inf - inf`` (``u + K_t`` and ``L_{t-1}`` may each lie beyond the float
range), and the average is the convex form above, never ``V - A`` (which overflows for values
of opposite signs near the largest float).

On CPU tensors the op runs the fused C++ kernel ``torch.ops.aftlab.decay`` (RWKV's WKV
recurrence with a running maximum, one pass forward and one reverse pass backward;
:mod:`aftlab.kernels`) when it is available, else the PyTorch implementation below.

The op continues a :class:`~aftlab.ops.state.RunningSums` (``initial_state``: the sums over
the keys before the call, ``t' < 0``, weighed as query 0 sees them, ``exp((1 + t') lambda +
K_t')``: what the mixer's decoding ``fold`` reaches), returns the one after its last position
(``return_state``) and restarts at the documents of ``cu_seqlens``
(:mod:`aftlab.ops._scan_state`, docs/aft.md "State across calls").
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import check_qkv, check_tensor
from ._numerics import compute_dtype
from ._scan_state import run_scan
from ._state_checks import check_running_sums, check_state_keywords
from .reference import biased_average_reference, running_sums_past
from .scan import _stable_prefix_average, check_decay
from .state import RunningSums

__all__ = ["aft_decay", "aft_decay_reference"]


def _check_decay_bonus(where: str, q: torch.Tensor, decay, bonus) -> None:
    check_decay(where, decay, "q", q)
    check_tensor(where, "bonus", bonus, shape=(q.shape[-1],), floating=True)
    if bonus.device != q.device:
        raise ValueError(f"{where}: 'bonus' is on {bonus.device} but 'q' is on {q.device}")


def aft_decay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    bonus: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    initial_state: RunningSums | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, RunningSums]:
    """Causal AFT with exponential decay (RWKV's WKV), gated by ``sigma(Q)``.

    Args:
        q: queries ``Q`` (RWKV's receptance), ``(B, T, d)``.
        k: keys ``K``, ``(B, T, d)``; any finite magnitude.
        v: values ``V``, ``(B, T, d)``.
        decay: per-channel ``lambda >= 0``, ``(d,)`` (any float dtype; differentiable).
        bonus: per-channel bonus ``u`` of the current token, ``(d,)`` (differentiable).
        padding_mask: bool ``(B, T)``, True for real tokens; padded keys contribute nothing and a
            position with no valid key (itself included) gets 0.
        initial_state: the :class:`~aftlab.ops.state.RunningSums` ``(B, d)`` of the keys
            before this call: at query ``t`` its keys ``t' < 0`` weigh
            ``exp(-(t-1-t') lambda + K_t')`` (no bonus); None: none.
        return_state: also return the state after the last position.
        cu_seqlens: int32 offsets ``[0, n_1, ..., T]`` of documents packed into a batch of one
            row; each restarts from the empty state at position 0 (``initial_state`` continues
            the first, the state returned is the last's).

    Returns:
        ``Y``, ``(B, T, d)`` in the dtype of ``q`` (float16/bfloat16 are computed in float32);
        ``(Y, state)`` with ``return_state``, the state in the compute dtype, its ``position``
        advanced by ``T``.

    Raises:
        ValueError: a negative or non-finite ``decay`` (its values are read only on the CPU
            outside ``torch.compile``: :func:`~aftlab.ops.scan.check_decay`); wrong ranks,
            shapes or devices; a state of another batch size, width or device; bad
            ``cu_seqlens`` (:func:`~aftlab.ops._packed.check_cu_seqlens`).
        TypeError: non-tensor or non-float inputs, mismatched dtypes of ``q, k, v``; a state
            of another type, or with a non-floating field.
    """
    where = "aft_decay"
    check_qkv(where, q, k, v, padding_mask)
    _check_decay_bonus(where, q, decay, bonus)
    return _aft_decay(q, k, v, decay, bonus, padding_mask=padding_mask,
                      initial_state=initial_state, return_state=return_state,
                      cu_seqlens=cu_seqlens)


def _aft_decay(q, k, v, decay, bonus, *, padding_mask, initial_state=None, return_state=False,
               cu_seqlens=None, check_state=True):
    """:func:`aft_decay` without the checks of ``q, k, v, decay, bonus`` (the mixer's call: its
    input is validated); the state (unless ``check_state=False``: the mixer's caller checked
    it) and ``cu_seqlens`` are checked."""
    if check_state_keywords("aft_decay", True, initial_state, return_state, cu_seqlens):
        if initial_state is not None and check_state:
            check_running_sums("aft_decay", initial_state, q)
        impl = _carry_in_kernel(q, k, v, decay, bonus, padding_mask, initial_state, cu_seqlens)
        if impl:
            y, state = kernels.scan.aft_decay_state(q, k, v, decay, bonus, initial_state,
                                                    backend=impl)
            return (y, state) if return_state else y

        def core(q, k, v, mask):
            return _aft_decay(q, k, v, decay, bonus, padding_mask=mask)

        return run_scan(
            "aft_decay", core, q, k, v, decay, padding_mask=padding_mask,
            initial_state=initial_state, return_state=return_state, cu_seqlens=cu_seqlens,
            check_state=False,  # checked above
        )
    impl = kernels.implementation("aft_decay", q, decay, bonus)
    if impl != "torch":
        return kernels.scan.aft_decay(q, k, v, decay, bonus, padding_mask=padding_mask,
                                      backend=impl)
    return _aft_decay_torch(q, k, v, decay, bonus, padding_mask=padding_mask)


def _carry_in_kernel(q, k, v, decay, bonus, padding_mask, state, cu_seqlens) -> str:
    """The kernel (``"cpp"``, ``"triton"``) that runs a call with a state in one pass (no
    virtual token and no second reduction for the state after), or ``""``: one sequence without
    padding, and no gradient to take (the kernels have no backward for the state)."""
    if padding_mask is not None or cu_seqlens is not None:
        return ""
    tensors = [q, k, v, decay, bonus]
    if state is not None:
        tensors += [state.a, state.b, state.p]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return ""
    impl = kernels.implementation("aft_decay", q, decay, bonus)
    return "" if impl == "torch" else impl


def _aft_decay_torch(q, k, v, decay, bonus, *, padding_mask):
    """The pure-PyTorch implementation of :func:`aft_decay` (inputs already validated)."""
    out_dtype = q.dtype
    cdt = compute_dtype(out_dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    lam, u = decay.to(cdt), bonus.to(cdt)
    B, T, d = q.shape
    # (L_t, A_t) over t' <= t with decay lambda; shifted by one they are the past of t.
    L, A = _stable_prefix_average(k, v, decay=lam, padding_mask=padding_mask)
    L_prev = torch.cat([L.new_full((B, 1, d), float("-inf")), L[:, :-1]], 1)
    A_prev = torch.cat([A.new_zeros(B, 1, d), A[:, :-1]], 1)
    # w_t = exp(u + K_t) / (exp(L_{t-1}) + exp(u + K_t)) = sigmoid(u + K_t - L_{t-1}), the
    # argument in halves (see the module docstring); an empty past (-inf) gives w = 1.
    w = torch.sigmoid(torch.sub(k / 2 + u / 2, L_prev / 2).mul_(2))
    if padding_mask is not None:
        pad = ~padding_mask[:, :, None]
        w, v = w.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    A = A_prev.addcmul(w, A_prev, value=-1.0).addcmul_(w, v)  # (1 - w) A_{t-1} + w V_t
    return (torch.sigmoid(q) * A).to(out_dtype)


def aft_decay_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    bonus: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    initial_state: RunningSums | None = None,
) -> torch.Tensor:
    """Float64 per-position loop straight from the formula (slow; for tests).

    :func:`~aftlab.ops.reference.biased_average_reference`, causal, with the per-channel bias
    ``b_{t,t'} = -(t - 1 - t') lambda`` for ``t' < t`` and ``b_{t,t} = u``: ``Y_t = sigma(Q_t) *
    sum_{t' <= t} exp(K_t' + b_{t,t'}) V_t' / sum_{t' <= t} exp(K_t' + b_{t,t'})``, 0 if no
    ``t'`` is valid. An ``initial_state`` adds its keys ``t' < 0`` as one term per row, their
    log-sum decayed by ``t``: ``L - t lambda`` with ``L = p + log b``, average ``A = a / b``.
    Returns float64 ``(B, T, d)``.
    """
    lam, u = decay.double().to(q.device), bonus.double().to(q.device)
    pos = torch.arange(q.shape[1], dtype=torch.float64, device=q.device)[:, None]

    def bias_row(t: int) -> torch.Tensor:  # (T, d); rows t' > t are never seen
        return torch.where(pos < t, -(t - 1 - pos) * lam, u)

    past = None if initial_state is None else running_sums_past(initial_state, lam)
    return biased_average_reference(
        q, k, v, bias_row, causal=True, padding_mask=padding_mask, past=past
    )
