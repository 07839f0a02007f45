"""AFT-full (Zhai et al. 2021, eq. 2): exact, stable for any finite key and bias, memory-linear.

For ``Q, K, V`` of shape ``(B, T, d)`` and pairwise position biases ``w`` (``T x T``, shared by
the channels), elementwise over the channel ``c``::

    Y_t = sigma(Q_t) * sum_t' exp(K_t' + w_{t,t'}) V_t' / sum_t' exp(K_t' + w_{t,t'})

(causal: ``t' <= t``). Written with ``P_{t,t',c} = exp(K_{t',c} + w_{t,t'} - L_{t,c})`` and
``L_{t,c} = log sum_t' exp(K_{t',c} + w_{t,t'})``, the bracket is the average
``A_t = sum_t' P_{t,t'} V_t'``, so ``Y = sigma(Q) * A``.

Two implementations compute it. On CPU tensors (kernels on, :mod:`aftlab.kernels`) the fused
C++ kernel ``aftlab::full`` (``csrc/full.cpp``, docs/kernels.md) keeps the matrix products on
BLAS and fuses everything around them, forward and backward (causal query blocks of ``T/4``
rows, clamped to 256..1024). Its causal key shift is the running max of the keys ``[0, i0]``
kept while within 20 of it, so ``E^K`` is formed once (and again only when a shift moves). Its
exact fallback runs *in the kernel, in the compute dtype*: a row whose factorised ``den``
underflows (or whose ``num`` overflows, or that follows an unsafe diagonal key) is recomputed
with its own per-``(t, c)`` max over the keys it sees, scores formed as ``K/2 + w/2`` (never
overflowing). Such a fallback is mathematically necessary: the
factorised shift ``m^w_t + m^K_c`` can exceed the true ``max_t' (K_t' + w_{t,t'})`` by any
amount when the two maximisers differ, which no factorised product can detect in advance. The
float64 rescue of the PyTorch implementation is gone from the kernel path.

The PyTorch implementation (CUDA, ``AFTLAB_KERNELS=0``) is
:func:`aftlab.ops.lse_average.lse_average` over every key (causal: ``t' <= t``), the engine it
shares with AFT-local's band: two matrix products, causal blocks of 256-512 rows that are causal
bit for bit, an exact float64 rescue, one opaque custom op forward and backward (its module says
how). Memory is ``O(B T d + T^2)``: nothing of size ``B x T x T x d`` is ever formed. float16
and bfloat16 inputs are computed in float32 (autocast disabled inside) and returned in their
dtype.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import check_compatible, check_qkv, check_tensor
from ._numerics import compute_dtype
from .lse_average import Geometry, causal_block_size, lse_average
from .reference import biased_average_reference

__all__ = ["aft_full", "aft_full_reference"]

_KERNEL_CAUSAL_BLOCK = (256, 1024)  # rows per causal block of the C++ kernel: T//4, clamped


# ----------------------------------------------------------------------------- public API
def check_aft_inputs(where, q, k, v, w, padding_mask):
    """Validate ``q, k, v (B, T, d)`` and ``padding_mask (B, T)`` (:func:`check_qkv`), and
    ``w (T', T')`` with ``T' >= T`` unless None."""
    check_qkv(where, q, k, v, padding_mask)
    if w is not None:
        T = q.shape[1]
        check_tensor(where, "w", w, ndim=2, floating=True)
        if w.shape[0] < T or w.shape[1] < T:
            raise ValueError(
                f"{where}: 'w' must have shape (T', T') with T' >= T = {T} (the length of 'q'), "
                f"got {tuple(w.shape)}"
            )
        check_compatible(where, {"q": q, "w": w})


def aft_full(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """AFT-full (causal: ``t' <= t``)::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + w_{t,t'}) V_t' / sum_t' exp(K_t' + w_{t,t'})

    Elementwise over channels; ``w`` is shared by the channels. Exact for any finite key and
    bias, finite for values up to ``finfo.max / 2`` on every path (up to ``finfo.max`` on the
    kernel; see the module docstring for the method), ``O(B T^2 d)`` time in two matrix products
    (about half of that when causal), ``O(B T d + T^2)`` memory.

    Args:
        q, k, v: ``(B, T, d)`` (the paper's ``Q = X W^Q``, ``K``, ``V``).
        w: ``(T', T')`` pairwise position biases with ``T' >= T``; ``w[:T, :T]`` is used.
        causal: restrict every sum to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens; padded keys contribute
            nothing, and a query that sees no valid key gets 0.

    Returns:
        ``Y``: ``(B, T, d)`` in the dtype of ``q``.

    Example:
        >>> q, k, v = torch.randn(3, 2, 5, 4).unbind(0)
        >>> aft_full(q, k, v, torch.zeros(8, 8), causal=True).shape
        torch.Size([2, 5, 4])
    """
    check_aft_inputs("aft_full", q, k, v, w, padding_mask)
    return _aft_full(q, k, v, w, causal=causal, padding_mask=padding_mask)


def _aft_full(q, k, v, w, *, causal: bool, padding_mask):
    """:func:`aft_full` without the checks (the mixer's call: its input is validated)."""
    T = q.shape[1]
    if T == 0:
        return q * 0.0  # empty, still connected to the graph
    impl = kernels.implementation("aft_full", q) if q.numel() else "torch"
    if impl != "torch":
        block = causal_block_size(T, _KERNEL_CAUSAL_BLOCK)
        return kernels.full.aft_full(
            q, k, v, w, causal=bool(causal), padding_mask=padding_mask, block=block,
            backend=impl,
        )
    return _aft_full_torch(q, k, v, w, causal=causal, padding_mask=padding_mask)


def _aft_full_torch(q, k, v, w, *, causal: bool, padding_mask):
    """The pure-PyTorch AFT-full (CUDA, ``AFTLAB_KERNELS=0``): :func:`lse_average`."""
    T = q.shape[1]
    cd = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc, wc = (x.to(cd) for x in (q, k, v, w))
        geo = Geometry(T, T, 0, 0, bool(causal))
        _, A = lse_average(kc, vc, wc[:T, :T], geo, padding_mask, with_log=False)
        return (torch.sigmoid(qc) * A).to(q.dtype)


def aft_full_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow float64 AFT-full, one query position at a time, straight from the formula.

    Returns ``(B, T, d)`` float64 (differentiable, for checking gradients).
    """
    T = q.shape[1]
    wt = w[:T, :T].unsqueeze(-1)  # (T, T, 1): shared by the channels
    return biased_average_reference(
        q, k, v, wt.__getitem__, causal=causal, padding_mask=padding_mask
    )
