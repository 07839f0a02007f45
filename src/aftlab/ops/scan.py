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

How it is computed (:func:`stable_prefix_average`, see docs/aft-scan.md): the recurrence

    L_t = logaddexp(L_{t-1} - lambda, k_t),   r_t = exp(k_t - L_t) in [0, 1]
    A_t = (1 - r_t) A_{t-1} + r_t v_t

(the carried weight ``exp(L_{t-1} - lambda - L_t) = 1 - r_t``; the convex form, evaluated as
``A - r A + r v``, never forms ``v - A``, which overflows for values of opposite signs near
the largest float), run chunk-wise: positions are
split into chunks of ``C``; inside every chunk the recurrence runs from an empty state, one
position at a time but vectorised across all chunks; the chunk summaries
``(L_end, A_end)`` form the same problem again with decay ``C * lambda`` (solved recursively);
each chunk then merges its carry ``(L_c, A_c)`` (the previous chunk's end) with

    L_t = logaddexp(L_c - (j + 1) lambda, l_t)
    A_t = (1 - g_t) a_t + g_t A_c,   g_t = exp(L_c - (j + 1) lambda - L_t)

for the position ``j`` inside the chunk and the chunk-local ``(l_t, a_t)``. Only exponents of
non-positive numbers are taken, no maximum over positions an output must not see is used, and
``lambda`` only appears multiplied by offsets inside a chunk (never ``t * lambda``).

Range: exact for every finite key, value and decay. The empty state is ``L = -inf`` (a first
key ``k`` gives ``L = k``, ``r = 1`` whatever its size); ``r`` and ``g`` are taken against
``max(L, lowest)`` so that ``-inf - -inf`` never occurs; a decayed log-sum ``L - m lambda``
(``m`` a chunk offset, up to ``T``) is formed as ``(L / 2^p - (m / 2^p) lambda) 2^p`` with
``2^p >= m``, so that ``m lambda`` never overflows on its own (only a result below ``-max``
becomes ``-inf``, its rounding).

The backward pass is one reverse gated scan of the same shape,
``P_t = z_t + (1 - r_{t+1}) P_{t+1}``, on two signals at once (see :func:`_scan_backward`).
Forward and backward are the custom ops ``aftlab::stable_prefix_average`` and
``aftlab::stable_prefix_average_backward`` (``torch.library.custom_op``, as every hand-written
backward in aftlab): ``torch.compile`` calls them whole. Time ``O(B T d)``, memory
``O(B T d)``; float16/bfloat16 inputs are computed in float32 and returned in their own dtype.
"""

from __future__ import annotations

import torch

from .._autograd import register_autograd_once
from .._checks import check_compatible, check_padding_mask, check_tensor
from ._numerics import compute_dtype

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

    L_t = logaddexp(L_{t-1} - lambda, k_t)
    A_t = exp(L_{t-1} - lambda - L_t) A_{t-1} + exp(k_t - L_t) v_t
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
        empty = torch.isinf(carried) & torch.isinf(kt)  # no key yet: keep -inf, NaN-free grads
        l_t = torch.where(
            empty, neg_inf, torch.logaddexp(carried.masked_fill(empty, 0), kt.masked_fill(empty, 0))
        )
        safe = torch.where(torch.isfinite(l_t), l_t, torch.zeros_like(l_t))
        a_t = (
            torch.exp(carried - safe).nan_to_num(0.0) * a_prev
            + torch.exp(kt - safe).nan_to_num(0.0) * v[:, t]
        )
        Ls.append(l_t)
        As.append(a_t)
        l_prev, a_prev = l_t, a_t
    return torch.stack(Ls, 1), torch.stack(As, 1)


# ---------------------------------------------------------------------------- chunk size
def _chunk_size(T: int) -> int:
    """Chunk length ``C`` (16, or ``T`` if shorter).

    Each level of the recursion runs ``C`` steps of a few vectorised ops over ``1 / C`` of the
    positions and hands ``T / C`` summaries to the next level, so the work is about
    ``T (1 + 1/C + 1/C^2 + ...)`` while the number of ops is ``~ C log_C T``: a small ``C``
    means fewer (and larger) ops. See docs/aft-scan.md for the measurements.
    """
    return max(1, min(T, 16))


def _weight(x: torch.Tensor, L: torch.Tensor, *, out: torch.Tensor | None = None):
    """``exp(x - L)`` for ``x <= L``, 0 where both are ``-inf`` (no key: no NaN)."""
    lowest = torch.finfo(L.dtype).min
    return torch.sub(x, L.clamp_min(lowest), out=out).exp_()


def _decayed(L: torch.Tensor, lam: torch.Tensor, mult, span: int) -> torch.Tensor:
    """``L - mult * lambda`` for ``0 <= mult <= span`` (``span`` a power of two; ``mult`` a
    number or a tensor broadcasting against ``lam``), as ``(L / span - (mult / span) lambda)
    span``: exact scalings by powers of two, so no intermediate overflows."""
    if span == 1:
        return L - mult * lam
    return torch.sub(L / span, (mult / span) * lam).mul_(span)


# ---------------------------------------------------------------------------- forward
def _scan_forward(
    k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | None, step: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked forward of the recurrence. k, v ``(B, T, d)`` in the compute dtype, lam ``(d,)``.

    The decay between neighbours is ``step * lam`` (``step`` a power of two: the chunk levels
    of the recursion). Returns ``(L, A)``, ``(B, T, d)``; ``L = -inf`` and ``A = 0`` where no
    key has been seen.
    """
    B, T, d = k.shape
    C = _chunk_size(T)
    nC = -(-T // C)
    Tp = nC * C
    neg = float("-inf")
    if Tp != T:
        k = torch.nn.functional.pad(k, (0, 0, 0, Tp - T), value=float("-inf"))
        v = torch.nn.functional.pad(v, (0, 0, 0, Tp - T))
    kc, vc = k.view(B, nC, C, d), v.view(B, nC, C, d)
    l = torch.empty(B, nC, C, d, dtype=k.dtype, device=k.device)
    a = torch.empty_like(l)
    r = torch.empty(B, nC, d, dtype=k.dtype, device=k.device)
    # Chunk-local recurrence, vectorised over chunks: l_j = logaddexp(l_{j-1} - lambda, k_j),
    # r_j = exp(k_j - l_j), a_j = a_{j-1} - r_j a_{j-1} + r_j v_j, from l_{-1} = -inf, a_{-1} = 0.
    l_prev = torch.full((B, nC, d), neg, dtype=k.dtype, device=k.device)
    a_prev = torch.zeros(B, nC, d, dtype=k.dtype, device=k.device)
    for j in range(C):
        carried = l_prev if lam is None or j == 0 else _decayed(l_prev, lam, step, step)
        lj = torch.logaddexp(carried, kc[:, :, j])
        _weight(kc[:, :, j], lj, out=r)
        aj = torch.addcmul(a_prev, r, a_prev, value=-1.0).addcmul_(r, vc[:, :, j])
        # (no out= into the strided slices: torch.compile cannot trace that)
        l[:, :, j], a[:, :, j] = lj, aj
        l_prev, a_prev = lj, aj
    if nC > 1:
        # Chunk summaries are the same problem with decay C * step * lambda; their exclusive
        # prefix (L_c, A_c) is the carry each chunk starts from.
        Le, Ae = _scan_forward(
            l[:, :, C - 1].contiguous(), a[:, :, C - 1].contiguous(), lam, step * C
        )
        Lc = torch.cat([Le.new_full((B, 1, d), neg), Le[:, :-1]], 1)[:, :, None]
        Ac = torch.cat([Ae.new_zeros(B, 1, d), Ae[:, :-1]], 1)[:, :, None]
        if lam is None:
            X = Lc.expand(B, nC, C, d)
        else:  # L_c - (j + 1) step lambda, (B, nC, C, d)
            offs = torch.arange(1, C + 1, dtype=k.dtype, device=k.device)[:, None] * step
            X = _decayed(Lc, lam, offs, C * step)
        L = torch.logaddexp(X, l)
        w = _weight(X, L, out=l)  # weight of the carry
        A = a.addcmul_(w, a, value=-1.0).addcmul_(w, Ac)
        del w
    else:
        L, A = l, a
    L, A = L.view(B, Tp, d), A.view(B, Tp, d)
    if Tp != T:
        L, A = L[:, :T], A[:, :T]
    return L, A


# ---------------------------------------------------------------------------- backward
def _reverse_buffer(S: int, B: int, T: int, d: int, like: torch.Tensor):
    """Buffer for :func:`_scan_reverse_` with ``S`` signals; returns ``(p, C)``.

    ``p`` is ``(S + 1, B, Tp, d)`` with ``Tp`` the multiple of the chunk size ``C`` above ``T``;
    the caller fills ``p[:S, :, :T]``. The padded tail and channel ``S`` start at 0.
    """
    C = _chunk_size(T)
    Tp = -(-T // C) * C
    p = torch.empty(S + 1, B, Tp, d, dtype=like.dtype, device=like.device)
    p[S].zero_()
    if Tp != T:
        p[:S, :, T:].zero_()
    return p, C


def _scan_reverse_(p: torch.Tensor, gn: torch.Tensor, C: int) -> None:
    """In place, the reverse gated linear scan ``P_t = z_t + gn_t * P_{t+1}`` (``P_T = 0``).

    Args:
        p: ``(S + 1, B, Tp, d)`` from :func:`_reverse_buffer`, signals ``z`` in ``p[:S]``;
            overwritten with ``P``. Channel ``S`` is workspace: it accumulates the chunk-local
            gate products ``H_j = prod_{m=j}^{C-1} gn_m``.
        gn: gates in ``[0, 1]``, ``(B, Tp, d)`` (0 on the padded tail); ``gn_t`` multiplies the
            next position's state.
        C: chunk size (``Tp`` is a multiple of it).
    """
    S1, B, Tp, d = p.shape
    S, nC = S1 - 1, Tp // C
    pc, gc = p.view(S1, B, nC, C, d), gn.view(B, nC, C, d)
    pc[S, :, :, C - 1] = gc[:, :, C - 1]
    for j in range(C - 2, -1, -1):
        pc[:, :, :, j].addcmul_(gc[:, :, j], pc[:, :, :, j + 1])
    if nC > 1:
        # Chunk level: Pstart_c = p_0(c) + H_0(c) Pstart_{c+1}, the same scan on nC positions.
        q, C2 = _reverse_buffer(S, B, nC, d, p)
        q[:S, :, :nC] = pc[:S, :, :, 0]
        g2 = torch.zeros(B, q.shape[2], d, dtype=p.dtype, device=p.device)
        g2[:, :nC] = pc[S, :, :, 0]
        _scan_reverse_(q, g2, C2)
        Pnext = torch.cat([q[:S, :, 1:nC], q.new_zeros(S, B, 1, d)], 2)
        pc[:S].addcmul_(pc[S:], Pnext[:, :, :, None])


def _scan_backward(dL, dA, k, v, lam, L, A, grad_k: bool, grad_v: bool, grad_lam: bool):
    """``(p, dlambda)`` of the prefix average: the reverse scan's buffer ``p (3, B, Tp, d)``,
    in which ``dv = p[0, :, :T]`` and ``dk = p[1, :, :T]`` are built (each when asked for), and
    ``dlambda (d,)`` (empty unless ``grad_lam``).

    With ``r_t = exp(k_t - L_t)``, ``g_t = 1 - r_t = exp(L_{t-1} - lambda - L_t)`` and the
    upstream gradients ``dL``, ``dA``, let ``e_t = dL_t - dA_t A_t`` and run backwards

        P^A_t = dA_t + g_{t+1} P^A_{t+1},   P^e_t = e_t + g_{t+1} P^e_{t+1}

    (``P^A_t = exp(L_t) * d loss / d N_t`` for the unnormalised numerator
    ``N_t = exp(L_t) A_t``, likewise ``P^e`` for the denominator). Then

        dv_t = r_t P^A_t,   dk_t = r_t (P^e_t + v_t P^A_t),
        dlambda = -sum_{b,t} g_t (P^e_t + P^A_t A_{t-1}).
    """
    B, T, d = k.shape
    r = _weight(k, L)
    p, C = _reverse_buffer(2, B, T, d, k)
    gn = torch.zeros(B, p.shape[2], d, dtype=k.dtype, device=k.device)
    # In place into the buffers' slices (no fresh full-size tensor).
    gn[:, : T - 1].copy_(r[:, 1:]).neg_().add_(1.0)  # gn_t = g_{t+1} = 1 - r_{t+1}
    p[0, :, :T] = dA
    p[1, :, :T].copy_(dL).addcmul_(dA, A, value=-1.0)  # e = dL - dA * A
    _scan_reverse_(p, gn, C)
    del gn
    PA, Pe, work = p[0, :, :T], p[1, :, :T], p[2, :, :T]
    dlam = k.new_empty(0)
    if grad_lam:
        # dlambda = -sum_t g_t (P^e_t + P^A_t A_{t-1}), g_t = 1 - r_t (A_{-1} = 0)
        work[:, 0] = Pe[:, 0]
        work[:, 1:].copy_(Pe[:, 1:]).addcmul_(PA[:, 1:], A[:, :-1])
        dlam = -work.addcmul_(work, r, value=-1.0).sum((0, 1))  # work * (1 - r), per element
    # In place in the scan's buffer: dk = r (P^e + v P^A), then dv = r P^A.
    if grad_k:
        Pe.addcmul_(v, PA).mul_(r)
    if grad_v:
        PA.mul_(r)
    return p, dlam


# The prefix average is one opaque operator, forward and backward, like lse_average and the C++
# kernels: torch.compile calls it whole instead of unrolling its chunk loops into its graph. Its
# fakes are the computation itself on fake tensors (strides exact; a value read on the host, a
# sync on a GPU, fails there, under torch.compile).
@torch.library.custom_op("aftlab::stable_prefix_average", mutates_args=())
def _scan_op(
    k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _scan_forward(k, v, lam)


_scan_op.register_fake(_scan_forward)


@torch.library.custom_op("aftlab::stable_prefix_average_backward", mutates_args=())
def _scan_backward_op(
    dL: torch.Tensor, dA: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lam: torch.Tensor | None, L: torch.Tensor, A: torch.Tensor,
    grad_k: bool, grad_v: bool, grad_lam: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # dk and dv are views of one buffer: it is returned whole (a custom op's outputs may not
    # alias each other)
    return _scan_backward(dL, dA, k, v, lam, L, A, grad_k, grad_v, grad_lam)


_scan_backward_op.register_fake(_scan_backward)


def _scan_setup(ctx, inputs, output):
    k, v, lam = inputs
    ctx.save_for_backward(k, v, lam, *output)


def _scan_grad(ctx, dL, dA):
    k, v, lam, L, A = ctx.saved_tensors
    grad_k, grad_v, grad_lam = ctx.needs_input_grad
    grad_lam = grad_lam and lam is not None
    dL = torch.zeros_like(L) if dL is None else dL
    dA = torch.zeros_like(A) if dA is None else dA
    p, dlam = _scan_backward_op(dL, dA, k, v, lam, L, A, grad_k, grad_v, grad_lam)
    T = k.shape[1]
    return (
        p[1, :, :T] if grad_k else None,
        p[0, :, :T] if grad_v else None,
        dlam if grad_lam else None,
    )


register_autograd_once("aftlab::stable_prefix_average", _scan_grad, _scan_setup, what="PyTorch")


def stable_prefix_average(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    decay: torch.Tensor | None = None,
    reverse: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable, exact prefix log-sum-exp ``L`` and prefix average ``A`` (see the module docstring).

    L_t = log sum_{t' <= t} exp(k_t' - (t - t') lambda)
    A_t = sum_{t' <= t} exp(k_t' - (t - t') lambda - L_t) v_t'

    Args:
        k: keys ``(B, T, d)``, floating point; any finite magnitude (a key of ``-inf`` weighs
            0).
        v: values ``(B, T, d)``, same dtype and device as ``k``; any finite magnitude (``A``
            stays within the seen values' range).
        decay: per-channel ``lambda >= 0`` (finite, any size), ``(d,)``; ``None`` for no decay.
            Differentiable.
        reverse: sum over ``t' >= t`` (with ``(t' - t) lambda``) instead.
        padding_mask: bool ``(B, T)``, True for real tokens; False keys contribute nothing.

    Returns:
        ``(L, A)``, both ``(B, T, d)`` in the input dtype (float16/bfloat16 are computed in
        float32). Where no key contributes, ``L = -inf`` and ``A = 0``.

    Raises:
        ValueError / TypeError: wrong ranks, shapes, dtypes or devices (naming the argument);
            a negative or non-finite ``decay`` (checked as :func:`check_decay` says).
    """
    where = "stable_prefix_average"
    check_tensor(where, "k", k, ndim=3, floating=True)
    check_tensor(where, "v", v, shape=tuple(k.shape), floating=True)
    check_compatible(where, {"k": k, "v": v})
    if decay is not None:
        check_decay(where, decay, "k", k)
    if padding_mask is not None:
        check_padding_mask(where, padding_mask, tuple(k.shape[:2]), "k", k)
    return _stable_prefix_average(k, v, decay=decay, reverse=reverse, padding_mask=padding_mask)


def check_decay(where: str, decay: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """``decay`` must be a float ``(d,)`` tensor on ``ref``'s device (``d = ref.shape[-1]``), with
    every ``lambda`` finite and ``>= 0``.

    The shape, dtype and device are checked always; the values outside ``torch.compile`` (a
    compiled graph would break there). The read syncs the host, but only at this public
    boundary: the mixers call the unchecked ops with ``lambda = exp(w)``, ``>= 0`` by
    construction.
    """
    check_tensor(where, "decay", decay, shape=(ref.shape[-1],), floating=True)
    assert isinstance(decay, torch.Tensor)
    if decay.device != ref.device:
        raise ValueError(
            f"{where}: 'decay' is on {decay.device} but '{ref_name}' is on {ref.device}"
        )
    if not torch.compiler.is_compiling() and bool((decay < 0).any() | ~torch.isfinite(decay).all()):
        raise ValueError(
            f"{where}: 'decay' must be finite and >= 0 in every channel, "
            f"got min {decay.min().item():g}"
        )
    return decay


def _stable_prefix_average(k, v, *, decay=None, reverse: bool = False, padding_mask=None):
    """:func:`stable_prefix_average` without the checks (the ops' call: inputs validated)."""
    out_dtype = k.dtype
    cdt = compute_dtype(out_dtype)
    B, T, d = k.shape
    if T == 0:
        return k.new_empty(B, 0, d), v.new_empty(B, 0, d)
    kk, vv = k.to(cdt), v.to(cdt)
    lam = None if decay is None else decay.to(cdt)
    mask = padding_mask
    if reverse:
        kk, vv = kk.flip(1), vv.flip(1)
        mask = None if mask is None else mask.flip(1)
    if mask is not None:
        keep = mask[:, :, None]
        kk = kk.masked_fill(~keep, float("-inf"))
        vv = vv.masked_fill(~keep, 0.0)
    L, A = _scan_op(kk.contiguous(), vv.contiguous(), lam)
    if reverse:
        L, A = L.flip(1), A.flip(1)
    return L.to(out_dtype), A.to(out_dtype)
