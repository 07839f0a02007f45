"""Triton scan kernels: aft-simple (causal and not) and aft-decay (RWKV's WKV), forward and
backward, the same computation as ``csrc/scan.cpp`` (docs/kernels.md, "The kernels").

One program per (batch, block of channels) walks ``T`` keeping, per channel, the running
maximum ``m``, numerator ``n = sum exp(z - m) v 2^-e`` and denominator ``s = sum exp(z - m)``;
folding a key takes one exponential of a non-positive number. aft-decay keeps its maximum as an
anchor key and an age (``m = k_a - age lambda``, never ``t lambda``) and forms its exponent
differences in quarters. The forward saves, when a gradient will be taken, ``r_t`` (the newest
key's weight in the state) and, for aft-decay, ``w_t`` (the bonus term's weight); the backward
is one reverse pass with the gates ``1 - r_{t+1}`` (and ``1 - w_{t+1}``).

The ops ``aftlab::triton_<name>`` have the schemas of the C++ ops ``aftlab::<name>``, so that
their callers, fakes and autograd are those of :mod:`aftlab.kernels.scan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL, block, clamp_abs, sigmoid, value_scale

#: name -> schema, as ``csrc/scan.cpp`` defines them (tests/kernels/test_triton.py compares).
SCHEMAS = {
    "simple_causal": "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool save)"
    " -> (Tensor, Tensor)",
    "simple_causal_backward": "(Tensor gy, Tensor q, Tensor v, Tensor y, Tensor r)"
    " -> (Tensor, Tensor, Tensor)",
    "simple_global": "(Tensor q, Tensor k, Tensor v, Tensor? mask) -> (Tensor, Tensor)",
    "simple_global_backward": "(Tensor gy, Tensor q, Tensor k, Tensor v, Tensor stats,"
    " Tensor? mask) -> (Tensor, Tensor, Tensor)",
    "decay": "(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor bonus, Tensor? mask,"
    " bool save) -> (Tensor, Tensor, Tensor)",
    "decay_backward": "(Tensor gy, Tensor q, Tensor v, Tensor y, Tensor r, Tensor w)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "decay_state": "(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor bonus, Tensor? state)"
    " -> (Tensor, Tensor)",
}


# ---------------------------------------------------------------------------- aft-simple
@triton.jit
def _block(B, D, BB: tl.constexpr, BD: tl.constexpr):
    """This program's sequences ``b (BB, 1)`` (int64 offsets), channels ``c (1, BD)`` and
    their in-range mask ``(BB, BD)``."""
    b = (tl.program_id(0) * BB + tl.arange(0, BB)[:, None]).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    return b, c, (b < B) & (c < D)


@triton.jit
def _fold(k, vs, valid, m, n, s, vm):
    """Fold key ``k`` (scaled value ``vs``) into ``(m, n, s)`` and ``vm`` where ``valid``, with
    one exponential of ``-|k - m|``; also the new key's weight ``w`` (1 or that exponential)."""
    dk = k - m
    up = dk > 0
    e = tl.exp(-tl.abs(dk))
    a = tl.where(up, e, 1.0)
    w = tl.where(up, 1.0, e)
    n = tl.where(valid, n * a + w * vs, n)
    s = tl.where(valid, s * a + w, s)
    m = tl.where(valid & up, k, m)
    vm = tl.where(valid, tl.maximum(vm, tl.abs(vs)), vm)
    return m, n, s, vm, w


@triton.jit
def _simple_causal_fwd(Q, K, V, M, Y, R, B, T, D, sc, unsc, LOWEST: tl.constexpr,
                       HAS_MASK: tl.constexpr, SAVE: tl.constexpr, BB: tl.constexpr,
                       BD: tl.constexpr):
    b, c, cm = _block(B, D, BB, BD)
    dt = Y.dtype.element_ty
    m = tl.full([BB, BD], LOWEST, dt)  # the lowest finite number: no key yet
    n = tl.zeros([BB, BD], dt)
    s = tl.zeros([BB, BD], dt)
    vm = tl.zeros([BB, BD], dt)
    for t in range(0, T):
        o = (b * T + t) * D + c
        q = tl.load(Q + o, mask=cm, other=0.0)
        if HAS_MASK:
            valid = tl.load(M + b * T + t, mask=b < B, other=0) != 0
        else:
            valid = c >= 0
        k = tl.load(K + o, mask=cm, other=0.0)
        vs = tl.load(V + o, mask=cm, other=0.0) * sc
        m, n, s, vm, w = _fold(k, vs, valid, m, n, s, vm)
        inv = tl.where(s > 0, 1.0 / s, 0.0)
        tl.store(Y + o, sigmoid(q) * unsc * clamp_abs(n * inv, vm), mask=cm)
        if SAVE:
            tl.store(R + o, tl.where(valid, w * inv, 0.0), mask=cm)


@triton.jit
def _simple_causal_bwd(G, Q, V, Y, R, DQ, DK, DV, B, T, D, BB: tl.constexpr,
                       BD: tl.constexpr):
    # P^A_t = h_t + (1 - r_{t+1}) P^A_{t+1}, P^e_t = -g_t y_t + (1 - r_{t+1}) P^e_{t+1},
    # h = g sigma(q); dv = r P^A, dk = r (P^e + v P^A), dq = g y (1 - sigma(q)).
    b, c, cm = _block(B, D, BB, BD)
    dt = Y.dtype.element_ty
    pa = tl.zeros([BB, BD], dt)
    pe = tl.zeros([BB, BD], dt)
    gate = tl.zeros([BB, BD], dt)
    for i in range(0, T):
        o = (b * T + (T - 1 - i)) * D + c
        g = tl.load(G + o, mask=cm, other=0.0)
        sq = sigmoid(tl.load(Q + o, mask=cm, other=0.0))
        gy = g * tl.load(Y + o, mask=cm, other=0.0)
        r = tl.load(R + o, mask=cm, other=0.0)
        v = tl.load(V + o, mask=cm, other=0.0)
        pa = g * sq + gate * pa
        pe = -gy + gate * pe
        tl.store(DV + o, r * pa, mask=cm)
        tl.store(DK + o, r * (pe + v * pa), mask=cm)
        tl.store(DQ + o, gy * (1.0 - sq), mask=cm)
        gate = 1.0 - r


@triton.jit
def _simple_global_fwd(Q, K, V, M, Y, S3, B, T, D, sc, unsc, LOWEST: tl.constexpr,
                       HAS_MASK: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr):
    # Pass 1 folds every valid key into (m, n, s); pass 2 writes y = sigma(q) A, A = n / s.
    # S3 (3, B, d) = (m, s, A) for the backward.
    b, c, cm = _block(B, D, BB, BD)
    dt = Y.dtype.element_ty
    m = tl.full([BB, BD], LOWEST, dt)
    n = tl.zeros([BB, BD], dt)
    s = tl.zeros([BB, BD], dt)
    vm = tl.zeros([BB, BD], dt)
    for t in range(0, T):
        o = (b * T + t) * D + c
        if HAS_MASK:
            valid = tl.load(M + b * T + t, mask=b < B, other=0) != 0
        else:
            valid = c >= 0
        k = tl.load(K + o, mask=cm, other=0.0)
        vs = tl.load(V + o, mask=cm, other=0.0) * sc
        m, n, s, vm, w = _fold(k, vs, valid, m, n, s, vm)
    avg = tl.where(s == 0, 0.0, unsc * clamp_abs(n / tl.where(s == 0, 1.0, s), vm))
    tl.store(S3 + b * D + c, m, mask=cm)
    tl.store(S3 + (B + b) * D + c, s, mask=cm)
    tl.store(S3 + (2 * B + b) * D + c, avg, mask=cm)
    for t in range(0, T):
        o = (b * T + t) * D + c
        tl.store(Y + o, sigmoid(tl.load(Q + o, mask=cm, other=0.0)) * avg, mask=cm)


@triton.jit
def _simple_global_bwd(G, Q, K, V, S3, M, DQ, DK, DV, B, T, D, HAS_MASK: tl.constexpr,
                       BB: tl.constexpr, BD: tl.constexpr):
    # H = sum_t g_t sigma(q_t); rho_t = exp(k_t - m) / s (0 if padded);
    # dv = rho H, dk = rho (v - A) H, dq = g A sigma (1 - sigma).
    b, c, cm = _block(B, D, BB, BD)
    m = tl.load(S3 + b * D + c, mask=cm, other=0.0)
    s = tl.load(S3 + (B + b) * D + c, mask=cm, other=0.0)
    avg = tl.load(S3 + (2 * B + b) * D + c, mask=cm, other=0.0)
    inv = tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0)
    h = tl.zeros_like(m)
    for t in range(0, T):
        o = (b * T + t) * D + c
        g = tl.load(G + o, mask=cm, other=0.0)
        sq = sigmoid(tl.load(Q + o, mask=cm, other=0.0))
        h += g * sq
        tl.store(DQ + o, g * avg * sq * (1.0 - sq), mask=cm)
    for t in range(0, T):
        o = (b * T + t) * D + c
        if HAS_MASK:
            valid = tl.load(M + b * T + t, mask=b < B, other=0) != 0
        else:
            valid = c >= 0
        rho = tl.exp(tl.load(K + o, mask=cm, other=0.0) - m) * inv
        rho = tl.where(valid, rho, 0.0)
        tl.store(DV + o, rho * h, mask=cm)
        tl.store(DK + o, rho * (tl.load(V + o, mask=cm, other=0.0) - avg) * h, mask=cm)


# ---------------------------------------------------------------------------- aft-decay
@triton.jit
def _decay_fwd(Q, K, V, LAM, U, M, Y, R, W, S0, S1, B, T, D, sc, unsc,
               HAS_MASK: tl.constexpr, SAVE: tl.constexpr, HAS_S0: tl.constexpr,
               HAS_S1: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr):
    # Output at t from the past state and the bonus term exp(u + k_t): with
    # o = max(m, u + k_t), y = sigma(q) (n e^{m-o} + e^{u+k-o} v) / (s e^{m-o} + e^{u+k-o});
    # then the state decays by lambda (age + 1) and folds k_t. In quarters, with
    # dd = k/4 - ka/4: (u + k - m)/4 = (dd + u/4) + age lambda/4 and
    # (k - m')/4 = dd + (age + 1) lambda/4.
    # S0/S1 (3, B, d) = (a, b, p): the state continued (anchor p, age 0, n = a 2^-e, s = b) and
    # the state after the last token (p = 4 (ka/4 - age lambda/4), a = n 2^e).
    b, c, cm = _block(B, D, BB, BD)
    dt = Y.dtype.element_ty
    lam4 = 0.25 * tl.load(LAM + c, mask=c < D, other=0.0)
    u4 = 0.25 * tl.load(U + c, mask=c < D, other=0.0)
    ka4 = tl.full([BB, BD], float("-inf"), dt)  # no key yet
    age = tl.zeros([BB, BD], dt)
    n = tl.zeros([BB, BD], dt)
    s = tl.zeros([BB, BD], dt)
    vm = tl.zeros([BB, BD], dt)
    if HAS_S0:
        a0 = tl.load(S0 + b * D + c, mask=cm, other=0.0)
        b0 = tl.load(S0 + (B + b) * D + c, mask=cm, other=0.0)
        p0 = tl.load(S0 + (2 * B + b) * D + c, mask=cm, other=0.0)
        some = b0 > 0
        ka4 = tl.where(some, 0.25 * p0, ka4)
        n = tl.where(some, a0 * sc, n)
        s = tl.where(some, b0, s)
        vm = tl.where(some, tl.abs(a0 / tl.where(some, b0, 1.0)) * sc, vm)
    for t in range(0, T):
        o = (b * T + t) * D + c
        q = tl.load(Q + o, mask=cm, other=0.0)
        if HAS_MASK:
            valid = tl.load(M + b * T + t, mask=b < B, other=0) != 0
        else:
            valid = c >= 0
        k4 = 0.25 * tl.load(K + o, mask=cm, other=0.0)
        vs = tl.load(V + o, mask=cm, other=0.0) * sc
        dd = k4 - ka4
        dz = 4.0 * ((dd + u4) + age * lam4)
        e = tl.exp(-tl.abs(dz))
        up = dz > 0
        pw = tl.where(up, e, 1.0)
        cw = tl.where(up, 1.0, e)
        den = s * pw + cw  # >= 1
        wt = cw / den
        vm_new = tl.maximum(vm, tl.abs(vs))
        y_valid = clamp_abs((n * pw + cw * vs) / den, vm_new)
        y_pad = clamp_abs(n * tl.where(s > 0, 1.0 / tl.where(s > 0, s, 1.0), 0.0), vm)
        tl.store(Y + o, sigmoid(q) * unsc * tl.where(valid, y_valid, y_pad), mask=cm)
        # fold k_t into the decayed state
        dk4 = dd + (age + 1.0) * lam4
        ef = tl.exp(-tl.abs(4.0 * dk4))
        moved = dk4 > 0
        fa = tl.where(moved, ef, 1.0)
        fw = tl.where(moved, 1.0, ef)
        n = tl.where(valid, n * fa + fw * vs, n)
        s = tl.where(valid, s * fa + fw, s)
        vm = tl.where(valid, vm_new, vm)
        ka4 = tl.where(valid & moved, k4, ka4)
        age = tl.where(valid & moved, 0.0, age + 1.0)
        if SAVE:
            tl.store(R + o, tl.where(valid, fw / s, 0.0), mask=cm)
            tl.store(W + o, tl.where(valid, wt, 0.0), mask=cm)
    if HAS_S1:
        anyk = s > 0
        tl.store(S1 + b * D + c, tl.where(anyk, n * unsc, 0.0), mask=cm)
        tl.store(S1 + (B + b) * D + c, s, mask=cm)
        tl.store(S1 + (2 * B + b) * D + c,
                 tl.where(anyk, 4.0 * (ka4 - age * lam4), float("-inf")), mask=cm)


@triton.jit
def _decay_bwd(G, Q, V, Y, R, W, DQ, DK, DV, DLAM, DU, B, T, D, BB: tl.constexpr,
               BD: tl.constexpr):
    # Reverse pass with G_{t+1} = 1 - r_{t+1}:
    #   P_t = h_{t+1} (1 - w_{t+1}) + G_{t+1} P_{t+1}    (P^A; P^e with -g y instead of h)
    #   Q_t = G_{t+1} (Q_{t+1} + P_{t+1})                 (offset-weighted, for dlambda)
    #   dv = h w + r P^A,  dk = w (h v - g y) + r (P^e + v P^A),  du = sum w (h v - g y),
    #   dlambda = -sum r (v Q^A + Q^e),  dq = g y (1 - sigma(q)).
    b, c, cm = _block(B, D, BB, BD)
    dt = Y.dtype.element_ty
    pa = tl.zeros([BB, BD], dt)
    pe = tl.zeros([BB, BD], dt)
    qa = tl.zeros([BB, BD], dt)
    qe = tl.zeros([BB, BD], dt)
    ia = tl.zeros([BB, BD], dt)
    ie = tl.zeros([BB, BD], dt)
    gate = tl.zeros([BB, BD], dt)
    du = tl.zeros([BB, BD], dt)
    dl = tl.zeros([BB, BD], dt)
    for i in range(0, T):
        o = (b * T + (T - 1 - i)) * D + c
        qa = gate * (qa + pa)
        qe = gate * (qe + pe)
        pa = ia + gate * pa
        pe = ie + gate * pe
        g = tl.load(G + o, mask=cm, other=0.0)
        sq = sigmoid(tl.load(Q + o, mask=cm, other=0.0))
        v = tl.load(V + o, mask=cm, other=0.0)
        h = g * sq
        gy = g * tl.load(Y + o, mask=cm, other=0.0)
        r = tl.load(R + o, mask=cm, other=0.0)
        w = tl.load(W + o, mask=cm, other=0.0)
        own = w * (h * v - gy)
        tl.store(DV + o, h * w + r * pa, mask=cm)
        tl.store(DK + o, own + r * (pe + v * pa), mask=cm)
        tl.store(DQ + o, gy * (1.0 - sq), mask=cm)
        du += own
        dl -= r * (v * qa + qe)
        ia = h * (1.0 - w)
        ie = -gy * (1.0 - w)
        gate = 1.0 - r
    tl.store(DLAM + b * D + c, dl, mask=cm)
    tl.store(DU + b * D + c, du, mask=cm)


# ---------------------------------------------------------------------------- launchers
def _contig(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


def _grid(q: torch.Tensor) -> tuple[tuple[int, int], dict[str, int]]:
    """The grid over (batch, channel) blocks and the block sizes ``BB, BD``."""
    B, _, D = q.shape
    bb, bd = block(B, D, q.device)
    return (triton.cdiv(B, bb), triton.cdiv(D, bd)), {"BB": bb, "BD": bd}


def _mask(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The padding mask as contiguous bytes (a pointer the kernels read), or ``q`` as a dummy
    pointer that ``HAS_MASK=False`` never reads."""
    return q if mask is None else mask.to(torch.uint8).contiguous()


def _lowest(q: torch.Tensor) -> float:
    return torch.finfo(q.dtype).min


def _check(name: str, q: torch.Tensor) -> None:
    if q.dtype not in TL:
        raise TypeError(f"aftlab::triton_{name}: float32 or float64 tensors, got {q.dtype}")


def simple_causal(q, k, v, mask, save):
    _check("simple_causal", q)
    q, k, v = _contig(q, k, v)
    y = torch.empty_like(q)
    r = torch.empty_like(q) if save else q.new_empty(0)
    if q.numel():
        grid, bs = _grid(q)
        B, T, D = q.shape
        sc = value_scale(T)
        _simple_causal_fwd[grid](q, k, v, _mask(mask, q), y, r if save else y, B, T, D, sc,
                                 1.0 / sc, LOWEST=_lowest(q), HAS_MASK=mask is not None,
                                 SAVE=save, **bs)
    return y, r


def simple_causal_backward(gy, q, v, y, r):
    gy, q, v, y, r = _contig(gy, q, v, y, r)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    if q.numel():
        grid, bs = _grid(q)
        _simple_causal_bwd[grid](gy, q, v, y, r, dq, dk, dv, *q.shape, **bs)
    return dq, dk, dv


def simple_global(q, k, v, mask):
    _check("simple_global", q)
    q, k, v = _contig(q, k, v)
    B, T, D = q.shape
    y = torch.empty_like(q)
    stats = q.new_empty(3, B, D)
    if B * D:
        grid, bs = _grid(q)
        sc = value_scale(T)
        _simple_global_fwd[grid](q, k, v, _mask(mask, q), y, stats, B, T, D, sc, 1.0 / sc,
                                 LOWEST=_lowest(q), HAS_MASK=mask is not None, **bs)
    return y, stats


def simple_global_backward(gy, q, k, v, stats, mask):
    gy, q, k, v, stats = _contig(gy, q, k, v, stats)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    if q.numel():
        grid, bs = _grid(q)
        B, T, D = q.shape
        _simple_global_bwd[grid](gy, q, k, v, stats, _mask(mask, q), dq, dk, dv, B, T, D,
                                 HAS_MASK=mask is not None, **bs)
    return dq, dk, dv


def _decay(q, k, v, lam, u, mask, save, state):
    """``(y, r, w, state_after)`` of the forward; ``state`` (3, B, d) continued or None."""
    q, k, v = _contig(q, k, v)
    lam, u = (t.to(q.dtype).contiguous() for t in (lam, u))
    B, T, D = q.shape
    y = torch.empty_like(q)
    r = torch.empty_like(q) if save else q.new_empty(0)
    w = torch.empty_like(q) if save else q.new_empty(0)
    s1 = q.new_empty(3, B, D)
    if B * D:
        grid, bs = _grid(q)
        sc = value_scale(T)
        s0 = None if state is None else state.to(q.dtype).contiguous()
        _decay_fwd[grid](q, k, v, lam, u, _mask(mask, q), y, r if save else y,
                         w if save else y, y if s0 is None else s0, s1, B, T, D, sc, 1.0 / sc,
                         HAS_MASK=mask is not None, SAVE=save, HAS_S0=s0 is not None,
                         HAS_S1=True, **bs)
    return y, r, w, s1


def decay(q, k, v, lam, u, mask, save):
    _check("decay", q)
    y, r, w, _ = _decay(q, k, v, lam, u, mask, save, None)
    return y, r, w


def decay_state(q, k, v, lam, u, state):
    _check("decay_state", q)
    y, _, _, s1 = _decay(q, k, v, lam, u, None, False, state)
    return y, s1


def decay_backward(gy, q, v, y, r, w):
    gy, q, v, y, r, w = _contig(gy, q, v, y, r, w)
    B, T, D = q.shape
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    dlam, du = q.new_zeros(B, D), q.new_zeros(B, D)
    if q.numel():
        grid, bs = _grid(q)
        _decay_bwd[grid](gy, q, v, y, r, w, dq, dk, dv, dlam, du, B, T, D, **bs)
    return dq, dk, dv, dlam.sum(0), du.sum(0)


#: name -> implementation, registered for the CPU (the interpreter) and CUDA.
IMPLS = {
    "simple_causal": simple_causal,
    "simple_causal_backward": simple_causal_backward,
    "simple_global": simple_global,
    "simple_global_backward": simple_global_backward,
    "decay": decay,
    "decay_backward": decay_backward,
    "decay_state": decay_state,
}
