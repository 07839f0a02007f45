"""The Transformer of the mathematical definition, as two plain functions.

The definition (docs/definition.md) works on a column matrix ``X ∈ R^{d×n}`` whose ``n`` columns
are the tokens. aftlab is batch-first: ``x`` has shape ``(..., n, d)`` and ``X = x[b].T``; every
formula below is written in both conventions.

Nothing here is scaled, normalised or masked: these are the definition's maps exactly
(no ``1/sqrt(m)``, no attention bias, no LayerNorm). The practical Transformer lives in
:mod:`aftlab.mixers.attention` and :mod:`aftlab.models.transformer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_compatible, check_tensor

__all__ = ["seed_attention", "seed_feedforward"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_x(where: str, x: object) -> torch.Tensor:
    """``x`` must be a floating tensor of shape ``(..., n, d)``."""
    x = check_tensor(where, "x", x, floating=True)
    if x.dim() < 2:
        raise ValueError(
            f"{where}: 'x' must have at least 2 dimensions (..., n, d), "
            f"got {x.dim()} with shape {_shape(x.shape)}"
        )
    return x


def _check_weight(
    where: str,
    name: str,
    value: object,
    symbols: str,
    expected: tuple[int | None, ...],
    source: str,
) -> torch.Tensor:
    """Check rank and shape of a weight, naming its symbolic shape (e.g. ``(H, m, d)``).

    ``source`` says where the expected sizes come from, e.g. ``"d from 'x'"``.
    """
    value = check_tensor(where, name, value)
    if value.dim() != len(expected):
        raise ValueError(
            f"{where}: '{name}' must have {len(expected)} dimension(s) {symbols}, "
            f"got {value.dim()} with shape {_shape(value.shape)}"
        )
    if any(e is not None and e != s for e, s in zip(expected, value.shape, strict=True)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected)
        want += ",)" if len(expected) == 1 else ")"
        raise ValueError(
            f"{where}: '{name}' must have shape {symbols} = {want} ({source}), "
            f"got {_shape(value.shape)}"
        )
    return value


def seed_attention(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
) -> torch.Tensor:
    r"""Multi-head self-attention with the residual, exactly as the definition states it.

    Column convention (``X ∈ R^{d×n}``, one token per column)::

        Attention(X) = X + Σ_{h=1}^{H} W_h^O (W_h^V X) Softmax[(W_h^K X)^T (W_h^Q X)]

    where ``Softmax`` applies ``softmax`` to each **column**, so every column of the ``n×n``
    attention matrix ``A_h = Softmax[(W_h^K X)^T (W_h^Q X)]`` sums to 1. Entry ``(i, j)`` is the
    weight of key ``i`` for query ``j``: ``A_h[i, j] = exp(k_i·q_j) / Σ_{i'} exp(k_{i'}·q_j)``
    with ``q_j = W_h^Q x_j``, ``k_i = W_h^K x_i``. There is no ``1/sqrt(m)`` scaling and no bias.

    Batch-first convention (``x[b] = X^T``, one token per row), for each head ``h``::

        q = x W_h^{Q T},  k = x W_h^{K T},  v = x W_h^{V T}           (n, m) each
        S = q k^T = ((W_h^K X)^T (W_h^Q X))^T                          (n, n), row j = query j
        out = x + Σ_h softmax_rows(S) v W_h^{O T}                      (n, d)

    so the definition's column softmax is a softmax over the last (key) axis of ``S``. It is
    computed shift-stably (``softmax(s) = softmax(s - max s)``), finite for any finite input;
    in float16/bfloat16 the softmax runs in float32.

    Args:
        x: input ``(..., n, d)``; any number of leading batch dimensions (or none).
        w_q: query matrices ``W_h^Q``, shape ``(H, m, d)``.
        w_k: key matrices ``W_h^K``, shape ``(H, m, d)``.
        w_v: value matrices ``W_h^V``, shape ``(H, m, d)``.
        w_o: output matrices ``W_h^O``, shape ``(H, d, m)``.

    Returns:
        ``Attention(X)`` batch-first, same shape and dtype as ``x``.

    Raises:
        TypeError: a non-tensor argument, a non-floating ``x``, or mixed dtypes.
        ValueError: wrong ranks, ``d`` not matching ``x``, inconsistent ``H``/``m``/``d`` across
            the weights, or tensors on different devices.

    Example:
        >>> import torch
        >>> from aftlab.functional import seed_attention
        >>> H, m, d, n = 2, 4, 8, 5
        >>> x = torch.randn(3, n, d)
        >>> w_q, w_k, w_v = (torch.randn(H, m, d) for _ in range(3))
        >>> seed_attention(x, w_q, w_k, w_v, torch.randn(H, d, m)).shape
        torch.Size([3, 5, 8])
    """
    where = "seed_attention"
    x = _check_x(where, x)
    d = x.shape[-1]
    w_q = _check_weight(where, "w_q", w_q, "(H, m, d)", (None, None, d), "d from 'x'")
    H, m, _ = w_q.shape
    hm = "H, m from 'w_q', d from 'x'"
    w_k = _check_weight(where, "w_k", w_k, "(H, m, d)", (H, m, d), hm)
    w_v = _check_weight(where, "w_v", w_v, "(H, m, d)", (H, m, d), hm)
    w_o = _check_weight(where, "w_o", w_o, "(H, d, m)", (H, d, m), hm)
    check_compatible(where, {"x": x, "w_q": w_q, "w_k": w_k, "w_v": w_v, "w_o": w_o})

    q = torch.einsum("...nd,hmd->...hnm", x, w_q)  # row j: (W_h^Q X)[:, j]
    k = torch.einsum("...nd,hmd->...hnm", x, w_k)  # row i: (W_h^K X)[:, i]
    v = torch.einsum("...nd,hmd->...hnm", x, w_v)  # row i: (W_h^V X)[:, i]
    s = torch.einsum("...hjm,...him->...hji", q, k)  # s[h, j, i] = k_i · q_j
    if x.dtype in _LOW_PRECISION:
        a = torch.softmax(s, dim=-1, dtype=torch.float32).to(x.dtype)
    else:
        a = torch.softmax(s, dim=-1)  # over keys i: column j of the definition's Softmax
    o = torch.einsum("...hji,...him->...hjm", a, v)  # row j: (W_h^V X) A_h[:, j]
    return x + torch.einsum("...hjm,hdm->...jd", o, w_o)  # Σ_h W_h^O (...)


def seed_feedforward(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
) -> torch.Tensor:
    r"""Position-wise feed-forward network with the residual, exactly as the definition states it.

    Column convention (``X ∈ R^{d×n}``, ``1 ∈ R^n`` all ones, ``b 1^T`` adds ``b`` to every
    column)::

        FF(X) = X + W_2 ReLU(W_1 X + b_1 1^T) + b_2 1^T

    Batch-first convention (``x[b] = X^T``)::

        FF(x) = x + ReLU(x W_1^T + b_1) W_2^T + b_2

    Args:
        x: input ``(..., n, d)``; any number of leading batch dimensions (or none).
        w1: ``W_1``, shape ``(r, d)``.
        b1: ``b_1``, shape ``(r,)``.
        w2: ``W_2``, shape ``(d, r)``.
        b2: ``b_2``, shape ``(d,)``.

    Returns:
        ``FF(X)`` batch-first, same shape and dtype as ``x``.

    Raises:
        TypeError: a non-tensor argument, a non-floating ``x``, or mixed dtypes.
        ValueError: wrong ranks, sizes inconsistent with ``d`` or ``r``, or mixed devices.

    Example:
        >>> import torch
        >>> from aftlab.functional import seed_feedforward
        >>> r, d = 16, 8
        >>> x = torch.randn(3, 5, d)
        >>> w1, b1, w2, b2 = torch.randn(r, d), torch.zeros(r), torch.randn(d, r), torch.zeros(d)
        >>> seed_feedforward(x, w1, b1, w2, b2).shape
        torch.Size([3, 5, 8])
    """
    where = "seed_feedforward"
    x = _check_x(where, x)
    d = x.shape[-1]
    w1 = _check_weight(where, "w1", w1, "(r, d)", (None, d), "d from 'x'")
    r = w1.shape[0]
    b1 = _check_weight(where, "b1", b1, "(r,)", (r,), "r from 'w1'")
    w2 = _check_weight(where, "w2", w2, "(d, r)", (d, r), "d from 'x', r from 'w1'")
    b2 = _check_weight(where, "b2", b2, "(d,)", (d,), "d from 'x'")
    check_compatible(where, {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2})

    return x + F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
