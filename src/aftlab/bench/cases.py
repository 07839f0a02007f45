"""The benchmark's case table: every mixer it measures, defined once.

Each :class:`OpCase` says how to build the op-level inputs of one mixer, how to run the fast op
and its float64 reference, which decoding mixer of the registry stands for it, and the cost
models the report divides by the machine's limits:

* ``flops(mode, s)``: floating-point operations the computation cannot avoid;
* ``bytes(mode, s)``: bytes that must cross the memory bus at least once (each input read once,
  each output written once; forward+backward is a forward pass followed by a backward pass);
* ``mem_estimate(mode, s)``: a generous estimate of the peak memory above the inputs, used only
  to skip cases that would not fit before running them.

The shape ``s`` is a :class:`Shape` ``(B, T, d, h, esize)``: batch, length, width, heads and the
element size in bytes. Modes: ``"forward"``, ``"train"`` (forward + backward) and
``"decode"`` (one incremental step of the module at position ``T``).

Op-level computations (``q, k, v`` are ``(B, T, d)`` unless stated; ``c = d / h``):

* ``attention-sdpa``: ``scaled_dot_product_attention(q, k, v)`` with q, k, v ``(B, h, T, c)``;
* ``attention-naive``: ``softmax(q k^T / sqrt(c) [+ causal mask]) v`` by einsum;
* ``aft-full``: ``aft_full(q, k, v, w)``, w ``(T, T)``;
* ``aft-local``: ``aft_local_band(q, k, v, w_band, 32)``, w_band ``(T, 2s - 1)`` (``(T, s)``
  causal), the band form the mixer uses;
* ``aft-simple``: ``aft_simple(q, k, v)``;
* ``aft-conv``: ``aft_conv(q, k, v, w)``, q, v ``(B, T, h, c)``, k ``(B, T, h, 1)``, w ``(h, 31)``;
* ``aft-decay``: ``aft_decay(q, k, v, decay, bonus)``, decay and bonus ``(d,)``, causal only;
* ``aft-full-matmul`` (:data:`MATMUL_CASE`): the dense products aft-full needs.

In ``train`` mode every floating input requires a gradient (activations and learned biases
alike), so the backward pass computes all of them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Shape", "OpCase", "CASES", "MATMUL_CASE", "default_cases", "MODES"]

MODES = ("forward", "train", "decode")

AFT_LOCAL_WINDOW = 32
AFT_CONV_KERNEL = 31


@dataclass(frozen=True)
class Shape:
    """Sizes of one case: batch ``B``, length ``T``, width ``d``, heads ``h``, element bytes."""

    B: int
    T: int
    d: int
    h: int
    esize: int = 4

    @property
    def c(self) -> int:
        """Channels per head, ``d / h``."""
        return self.d // self.h


Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class OpCase:
    """One benchmarked mixer.

    Attributes:
        name: name in the benchmark's tables (``"attention-sdpa"``, ``"aft-local"``, ...).
        make_inputs: ``(shape, causal, dtype, device, generator) -> {name: tensor}``.
        op: ``(inputs, causal) -> y``, the fast op under test.
        reference: ``(inputs, causal) -> y`` in float64, or ``None`` if not available yet;
            found lazily through ``reference_path`` when given.
        flops: ``(mode, shape, causal) -> float``, the FLOP model.
        bytes: ``(mode, shape, causal) -> float``, the memory-traffic model.
        mem_estimate: ``(mode, shape, causal) -> float``, bytes of peak memory (upper estimate).
        mixer: registry name of the module used for ``decode`` (``None``: no decode case).
        mixer_options: extra keyword options for :func:`aftlab.mixers.build_mixer`.
        causal_only: the op exists only in its causal form.
        description: one line for the docs and the report.
    """

    name: str
    make_inputs: Callable[[Shape, bool, torch.dtype, torch.device, torch.Generator], Inputs]
    op: Callable[[Inputs, bool], torch.Tensor]
    reference: Callable[[Inputs, bool], torch.Tensor] | None
    flops: Callable[[str, Shape, bool], float]
    bytes: Callable[[str, Shape, bool], float]
    mem_estimate: Callable[[str, Shape, bool], float]
    mixer: str | None = None
    mixer_options: dict[str, Any] = field(default_factory=dict)
    causal_only: bool = False
    description: str = ""


# ----------------------------------------------------------------------------- helpers
def _randn(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(
        dtype=dtype, device=device
    )


def _lazy_op(module: str, attr: str) -> Callable[..., torch.Tensor]:
    """Resolve ``module.attr`` at call time, so the table imports before the ops exist."""

    def call(*args, **kwargs):
        fn = getattr(importlib.import_module(module), attr, None)
        if fn is None:
            raise NotImplementedError(f"{module}.{attr} does not exist yet")
        return fn(*args, **kwargs)

    call.__qualname__ = f"{module}.{attr}"
    return call


def _qkv_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    return {n: _randn((s.B, s.T, s.d), dtype, device, gen) for n in ("q", "k", "v")}


def _io_bytes(n_in: float, n_out: float, mode: str, n_grad_in: float | None = None) -> float:
    """Memory-traffic model in elements: forward reads the inputs and writes the outputs;
    backward reads the inputs again plus ``dy`` and writes one gradient per input."""
    fwd = n_in + n_out
    if mode == "forward":
        return fwd
    g = n_in if n_grad_in is None else n_grad_in
    return fwd + n_in + n_out + g


# ----------------------------------------------------------------------------- attention
def _attn_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    # (B, h, T, c): the layout scaled_dot_product_attention takes.
    return {n: _randn((s.B, s.h, s.T, s.c), dtype, device, gen) for n in ("q", "k", "v")}


def _sdpa(x: Inputs, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)


def _naive_attention(x: Inputs, causal: bool) -> torch.Tensor:
    """``softmax(q k^T / sqrt(c) + M) v`` with ``M = -inf`` above the diagonal if causal."""
    q, k, v = x["q"], x["k"], x["v"]
    scores = torch.einsum("bhtc,bhsc->bhts", q, k) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhts,bhsc->bhtc", scores.softmax(-1), v)


def _attention_reference(x: Inputs, causal: bool) -> torch.Tensor:
    """Float64 per-query loop: ``y_t = sum_s softmax_s(q_t . k_s / sqrt(c)) v_s``.

    The sum runs over ``s <= t`` when causal.
    """
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    T = q.shape[-2]
    rows = []
    for t in range(T):
        end = t + 1 if causal else T
        p = (
            torch.einsum("bhc,bhsc->bhs", q[:, :, t], k[:, :, :end]) / math.sqrt(q.shape[-1])
        ).softmax(-1)
        rows.append(torch.einsum("bhs,bhsc->bhc", p, v[:, :, :end]))
    return torch.stack(rows, 2)


def _attn_flops(mode: str, s: Shape, causal: bool) -> float:
    # q k^T and p v: 2 * 2 * B * T^2 * d; backward needs 4 more products of the same size.
    f = 4.0 * s.B * s.T * s.T * s.d * (0.5 if causal else 1.0)
    if mode == "decode":
        return (
            4.0 * s.B * s.T * s.d + 8.0 * s.B * s.d * s.d
        )  # one query against T keys + 4 projections
    return f if mode == "forward" else 3.0 * f


def _attn_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    if mode == "decode":  # read the K and V cache and the four d x d projections
        return (2.0 * n + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(3 * n, n, mode) * s.esize


def _sdpa_mem(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d * s.esize
    return (4 if mode == "forward" else 12) * n + 64 * 2**20


def _naive_mem(mode: str, s: Shape, causal: bool) -> float:
    scores = s.B * s.h * s.T * s.T * s.esize
    n = s.B * s.T * s.d * s.esize
    return (2 if mode == "forward" else 5) * scores + 6 * n + 64 * 2**20


# ----------------------------------------------------------------------------- AFT
def _w_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    x = _qkv_inputs(s, causal, dtype, device, gen)
    x["w"] = _randn((s.T, s.T), dtype, device, gen, scale=0.5)
    return x


def _full_flops(mode: str, s: Shape, causal: bool) -> float:
    # exp(w) @ [exp(k) v, exp(k)]: 2 * T^2 * 2Bd. Backward: exp(w)^T @ g and g @ x^T, twice that.
    f = 4.0 * s.B * s.T * s.T * s.d * (0.5 if causal else 1.0)
    if mode == "decode":
        return 4.0 * s.B * s.T * s.d + 8.0 * s.B * s.d * s.d
    return f if mode == "forward" else 3.0 * f


def _full_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    ww = s.T * s.T * (0.5 if causal else 1.0)
    if mode == "decode":  # the running exp(k) v and exp(k) of every past token, and a row of w
        return (2.0 * n + s.T + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(3 * n + ww, n, mode) * s.esize


def _full_mem(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d * s.esize
    ww = s.T * s.T * s.esize
    return (3 * ww + 6 * n if mode == "forward" else 6 * ww + 16 * n) + 64 * 2**20


def _band(s: Shape, causal: bool, window: int) -> int:
    """Band width ``W`` of AFT-local: ``s' = min(window, T)``; ``2 s' - 1``, or ``s'`` causal."""
    w = min(window, s.T)
    return w if causal else 2 * w - 1


def _local_flops(mode: str, s: Shape, causal: bool) -> float:
    # global sums (O(Td)) plus the band correction (exp(w) - 1) over numerator and denominator
    f = s.B * s.d * s.T * (4.0 * _band(s, causal, AFT_LOCAL_WINDOW) + 10.0)
    if mode == "decode":
        return 4.0 * s.B * s.d * _band(s, True, AFT_LOCAL_WINDOW) + 8.0 * s.B * s.d * s.d
    return f if mode == "forward" else 3.0 * f


def _local_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    wb = s.T * _band(s, causal, AFT_LOCAL_WINDOW)  # only the band of w is read
    if mode == "decode":  # ring buffer of the last s tokens, running sums, projections
        return (2.0 * s.B * s.d * AFT_LOCAL_WINDOW + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(3 * n + wb, n, mode) * s.esize


def _local_mem(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d * s.esize
    band = s.B * s.T * s.d * _band(s, causal, AFT_LOCAL_WINDOW) * s.esize  # if it unfolds the band
    return (band + 12 * n if mode == "forward" else 2 * band + 24 * n) + 64 * 2**20


def _simple_flops(mode: str, s: Shape, causal: bool) -> float:
    f = 10.0 * s.B * s.T * s.d  # exp, products, sums, sigmoid: a handful per element
    if mode == "decode":
        return 10.0 * s.B * s.d + 8.0 * s.B * s.d * s.d
    return f if mode == "forward" else 3.0 * f


def _simple_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    if mode == "decode":  # running sums and the projections
        return (4.0 * s.B * s.d + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(3 * n, n, mode) * s.esize


def _linear_mem(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d * s.esize
    return (8 if mode == "forward" else 24) * n + 64 * 2**20


def _conv_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    return {
        "q": _randn((s.B, s.T, s.h, s.c), dtype, device, gen),
        "k": _randn((s.B, s.T, s.h, 1), dtype, device, gen),
        "v": _randn((s.B, s.T, s.h, s.c), dtype, device, gen),
        "w": _randn((s.h, AFT_CONV_KERNEL), dtype, device, gen, scale=0.5),
    }


def _conv_flops(mode: str, s: Shape, causal: bool) -> float:
    f = 2.0 * AFT_CONV_KERNEL * s.B * s.T * (s.d + s.h) + 10.0 * s.B * s.T * s.d
    if mode == "decode":
        return 2.0 * AFT_CONV_KERNEL * s.B * (s.d + s.h) + 8.0 * s.B * s.d * s.d
    return f if mode == "forward" else 3.0 * f


def _conv_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    nk = s.B * s.T * s.h
    if mode == "decode":
        return (2.0 * s.B * AFT_CONV_KERNEL * (s.d + s.h) + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(2 * n + nk + s.h * AFT_CONV_KERNEL, n, mode) * s.esize


def _decay_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    x = _qkv_inputs(s, causal, dtype, device, gen)
    x["decay"] = (torch.rand((s.d,), generator=gen, dtype=torch.float64) * 0.5).to(
        dtype=dtype, device=device
    )
    x["bonus"] = _randn((s.d,), dtype, device, gen, scale=0.5)
    return x


def _decay_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = s.B * s.T * s.d
    if mode == "decode":
        return (4.0 * s.B * s.d + 4.0 * s.d * s.d) * s.esize
    return _io_bytes(3 * n + 2 * s.d, n, mode) * s.esize


_F = "aftlab.functional"


def _full_op(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op(_F, "aft_full")(x["q"], x["k"], x["v"], x["w"], causal=causal)


def _full_ref(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op("aftlab.ops.aft_full", "aft_full_reference")(
        x["q"], x["k"], x["v"], x["w"], causal=causal
    )


def _local_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    x = _qkv_inputs(s, causal, dtype, device, gen)
    x["w_band"] = _randn((s.T, _band(s, causal, AFT_LOCAL_WINDOW)), dtype, device, gen, scale=0.5)
    return x


def _local_op(x: Inputs, causal: bool) -> torch.Tensor:
    """The band form the mixer uses: ``w_band[t, j] = w_{t, t + j - (s - 1)}``, no ``T x T``."""
    fn = _lazy_op("aftlab.ops.aft_local", "aft_local_band")
    return fn(x["q"], x["k"], x["v"], x["w_band"], AFT_LOCAL_WINDOW, causal=causal)


def _band_to_full(w_band: torch.Tensor, T: int) -> torch.Tensor:
    """Scatter ``w_band (T, W)`` into a ``(T, T)`` bias (0 elsewhere), differentiably."""
    s = min(AFT_LOCAL_WINDOW, T)
    t = torch.arange(T)[:, None]
    cols = t + torch.arange(w_band.shape[1])[None, :] - (s - 1)
    inside = (cols >= 0) & (cols < T)
    rows = t.expand_as(cols)
    full = w_band.new_zeros(T, T)
    return full.index_put((rows[inside], cols[inside]), w_band[inside])


def _local_ref(x: Inputs, causal: bool) -> torch.Tensor:
    fn = _lazy_op("aftlab.ops.aft_local", "aft_local_reference")
    w = _band_to_full(x["w_band"], x["q"].shape[1])
    return fn(x["q"], x["k"], x["v"], w, AFT_LOCAL_WINDOW, causal=causal)


def _simple_op(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op(_F, "aft_simple")(x["q"], x["k"], x["v"], causal=causal)


def _simple_ref(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op("aftlab.ops.aft_simple", "aft_simple_reference")(
        x["q"], x["k"], x["v"], causal=causal
    )


def _conv_op(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op(_F, "aft_conv")(x["q"], x["k"], x["v"], x["w"], causal=causal)


def _conv_ref(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op("aftlab.ops.aft_conv", "aft_conv_reference")(
        x["q"], x["k"], x["v"], x["w"], causal=causal
    )


def _decay_op(x: Inputs, causal: bool) -> torch.Tensor:
    return _lazy_op(_F, "aft_decay")(x["q"], x["k"], x["v"], x["decay"], x["bonus"])


def _decay_ref(x: Inputs, causal: bool) -> torch.Tensor:
    fn = _lazy_op("aftlab.ops.aft_decay", "aft_decay_reference")
    return fn(x["q"], x["k"], x["v"], x["decay"], x["bonus"])


# ----------------------------------------------------------------------------- matmul floor
def _matmul_inputs(s: Shape, causal, dtype, device, gen) -> Inputs:
    return {
        "e": _randn((s.T, s.T), dtype, device, gen, scale=0.1),
        "x": _randn((s.T, 2 * s.B * s.d), dtype, device, gen),
    }


def _matmul_op(x: Inputs, causal: bool) -> torch.Tensor:
    """``exp(w) @ [exp(k) v, exp(k)]`` as one ``(T, T) @ (T, 2Bd)`` product; its backward is
    the two products ``e^T @ g`` and ``g @ x^T``: the matrix work aft-full cannot avoid."""
    return x["e"] @ x["x"]


def _matmul_ref(x: Inputs, causal: bool) -> torch.Tensor:
    return x["e"].double() @ x["x"].double()


def _matmul_flops(mode: str, s: Shape, causal: bool) -> float:
    return _full_flops(mode, s, False)


def _matmul_bytes(mode: str, s: Shape, causal: bool) -> float:
    n = 2 * s.B * s.T * s.d
    return _io_bytes(n + s.T * s.T, n, mode) * s.esize


def _matmul_mem(mode: str, s: Shape, causal: bool) -> float:
    return (2 * s.T * s.T + 6 * s.B * s.T * s.d) * s.esize + 64 * 2**20


#: The dense matrix products of non-causal aft-full, timed beside it (target: aft-full <= 1.5x).
MATMUL_CASE = OpCase(
    "aft-full-matmul",
    _matmul_inputs,
    _matmul_op,
    _matmul_ref,
    _matmul_flops,
    _matmul_bytes,
    _matmul_mem,
    description="the (T,T)@(T,2Bd) product aft-full needs (and its backward)",
)

CASES: dict[str, OpCase] = {
    c.name: c
    for c in (
        OpCase(
            "attention-sdpa",
            _attn_inputs,
            _sdpa,
            _attention_reference,
            _attn_flops,
            _attn_bytes,
            _sdpa_mem,
            mixer="attention",
            description="torch scaled_dot_product_attention, h heads of d/h",
        ),
        OpCase(
            "attention-naive",
            _attn_inputs,
            _naive_attention,
            _attention_reference,
            _attn_flops,
            _attn_bytes,
            _naive_mem,
            mixer="attention-naive",
            description="einsum scores (B,h,T,T), softmax, einsum",
        ),
        OpCase(
            "aft-full",
            _w_inputs,
            _full_op,
            _full_ref,
            _full_flops,
            _full_bytes,
            _full_mem,
            mixer="aft-full",
            description="aftlab.functional.aft_full, w (T, T)",
        ),
        OpCase(
            "aft-local",
            _local_inputs,
            _local_op,
            _local_ref,
            _local_flops,
            _local_bytes,
            _local_mem,
            mixer="aft-local",
            mixer_options={"window": AFT_LOCAL_WINDOW},
            description=f"aftlab.ops.aft_local.aft_local_band, window s={AFT_LOCAL_WINDOW}",
        ),
        OpCase(
            "aft-simple",
            _qkv_inputs,
            _simple_op,
            _simple_ref,
            _simple_flops,
            _simple_bytes,
            _linear_mem,
            mixer="aft-simple",
            description="aftlab.functional.aft_simple",
        ),
        OpCase(
            "aft-conv",
            _conv_inputs,
            _conv_op,
            _conv_ref,
            _conv_flops,
            _conv_bytes,
            _linear_mem,
            mixer="aft-conv",
            mixer_options={"kernel_size": AFT_CONV_KERNEL},
            description=f"aftlab.functional.aft_conv, h heads, kernel s={AFT_CONV_KERNEL}",
        ),
        OpCase(
            "aft-decay",
            _decay_inputs,
            _decay_op,
            _decay_ref,
            _simple_flops,
            _decay_bytes,
            _linear_mem,
            mixer="aft-decay",
            causal_only=True,
            description="aftlab.functional.aft_decay (RWKV form), causal only",
        ),
    )
}


def default_cases() -> dict[str, OpCase]:
    """A fresh copy of :data:`CASES` (the hook for adding or replacing cases, see ``run_bench``)."""
    return dict(CASES)
