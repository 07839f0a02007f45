"""What ``aftlab bench`` runs: a case per registered mixer (its op in :data:`OPS`, with the cost
model of its floors), ``aft-full-matmul``, and the peers. See docs/benchmarks.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import import_module
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..mixers import available_mixers, build_mixer
from ..ops import aft_conv, aft_decay, aft_full, aft_simple
from ..ops.aft_conv import aft_conv_reference
from ..ops.aft_decay import aft_decay_reference
from ..ops.aft_full import aft_full_reference
from ..ops.aft_local import aft_local_band, aft_local_reference
from ..ops.aft_simple import aft_simple_reference
from ..ops.signatures import SIGNATURES

MODES = ("forward", "train", "decode")
WINDOW, KERNEL = 32, 31  # aft-local's window, aft-conv's kernel size


@dataclass(frozen=True)
class Shape:
    """Sizes of one case: batch ``B``, length ``T``, width ``d``, heads ``h``, element bytes."""

    B: int
    T: int
    d: int
    h: int
    esize: int = 4

    c = property(lambda self: self.d // self.h, doc="Channels per head, ``d / h``.")
    n = property(lambda self: self.B * self.T * self.d, doc="Elements of a ``(B, T, d)`` tensor.")


class Spec(NamedTuple):
    """One case, picklable: ``name`` is a case of :func:`cases` or a peer's module
    ``"<peer>:<impl>:<variant>"``; ``cfg`` is the run's ``BenchConfig``."""

    name: str
    mode: str
    causal: bool
    shape: Shape
    cfg: Any


@dataclass(frozen=True)
class Op:
    """How one mixer's op is benchmarked.

    Attributes:
        inputs: ``(shape, causal) -> {name: (size, scale)}``, the op's arguments in order:
            ``randn(size) * scale``, or ``U(0, 0.5)`` for ``scale="U"``; an aftlab op's from its
            signature, by :func:`_inputs`.
        fast, reference: ``(*inputs, causal=) -> y``: the op under test; float64, from the
            formula.
        flops: a forward's FLOPs.
        step: a decoding step's ``(FLOPs, elements read)`` besides the projections; None: none.
        mem: ``(forward, train)`` peak elements above the inputs, generous (to skip what won't fit).
        io: a forward's elements ``(read, written)``; None: the inputs and ``B T d``.
        options: the mixer's own options matching the inputs (aft-local's window).
        causal_only: the op has no non-causal form.
    """

    inputs: Callable[[Shape, bool], dict[str, tuple]]
    fast: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    flops: Callable[[Shape, bool], float]
    step: Callable[[Shape], tuple[float, float]] | None
    mem: Callable[[Shape, bool], tuple[float, float]]
    io: Callable[[Shape, bool], tuple[float, float]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    causal_only: bool = False

    def make(self, s: Shape, causal: bool, dtype, device, gen: torch.Generator) -> dict:
        """The inputs at shape ``s``: drawn in float64 from ``gen``, then cast."""
        out = {}
        for name, (size, scale) in self.inputs(s, causal).items():
            u = scale == "U"
            x = (torch.rand if u else torch.randn)(size, generator=gen, dtype=torch.float64)
            out[name] = (x * (0.5 if u else scale)).to(dtype=dtype, device=device)
        return out

    def floors(self, mode: str, s: Shape, causal: bool, limits: dict) -> dict:
        """The FLOPs and bytes one call in ``mode`` cannot avoid, the floors they imply
        ``max(bytes / bandwidth, FLOPs / GEMM rate)`` and the estimated peak bytes."""
        if mode == "decode":  # besides the four d x d projections of B tokens
            f, r = self.step(s)
            f, nbytes = f + 8.0 * s.B * s.d * s.d, (r + 4.0 * s.d * s.d) * s.esize
        else:
            sizes = [math.prod(size) for size, _ in self.inputs(s, causal).values()]
            f, (r, w) = self.flops(s, causal), self.io(s, causal) if self.io else (sum(sizes), s.n)
            if mode == "train":  # the backward: 2 products per product; inputs and dy read again,
                f, r, w = 3 * f, 2 * r + w, r + w  # a gradient written per input
            nbytes = (r + w) * s.esize
        fb, ff = nbytes / limits["bandwidth_bytes_per_s"], f / limits["gemm_flops_per_s"]
        return {
            "flops": f,
            "bytes": nbytes,
            "floor_bandwidth_s": fb,
            "floor_flops_s": ff,
            "floor_s": max(fb, ff),
            "floor_bound": "memory" if fb >= ff else "compute",
            "est_peak_bytes": self.mem(s, causal)[mode == "train"] * s.esize + 2**26,
        }


def _band(s: Shape, causal: bool) -> int:
    """Band width ``W`` of aft-local: ``2 s' - 1`` (``s'`` causal), ``s' = min(window, T)``."""
    w = min(WINDOW, s.T)
    return w if causal else 2 * w - 1


def _quadratic(s: Shape, causal: bool) -> float:
    """``q k^T`` and ``p v`` (or ``exp(w) @ [exp(k) v, exp(k)]``): ``4 B T^2 d``, half causal."""
    return 4.0 * s.B * s.T * s.T * s.d * (0.5 if causal else 1.0)


def _inputs(op: str, scales: dict, s: Shape, causal: bool) -> dict[str, tuple]:
    """``Op.inputs`` of ``op`` in :data:`~aftlab.ops.signatures.SIGNATURES` as
    ``partial(_inputs, op, scales)``: one key per head, kernels of size ``KERNEL``, ``w (T, T)``,
    aft-local's band; the scale of each name in ``scales``, else 1."""
    sizes = dict(B=s.B, T=s.T, d=s.d, h=s.h, c=s.c, ck=1, s=KERNEL, Tw=s.T, Wb=_band(s, causal))
    return {n: (x, scales.get(n, 1.0)) for n, x in SIGNATURES[op].shapes(sizes).items()}


def _naive_attention(q, k, v, *, causal: bool) -> torch.Tensor:
    """``softmax(q k^T / sqrt(c) + M) v`` by einsum, ``M = -inf`` above the diagonal if causal."""
    scores = torch.einsum("bhtc,bhsc->bhts", q, k) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhts,bhsc->bhtc", scores.softmax(-1), v)


def _attention_reference(q, k, v, *, causal: bool) -> torch.Tensor:
    """Float64 per query: ``y_t = sum_{s (<= t if causal)} softmax_s(q_t . k_s / sqrt(c)) v_s``."""
    q, k, v = q.double(), k.double(), v.double()
    rows = []
    for t in range(q.shape[-2]):
        end = t + 1 if causal else q.shape[-2]
        logits = torch.einsum("bhc,bhsc->bhs", q[:, :, t], k[:, :, :end]) / math.sqrt(q.shape[-1])
        rows.append(torch.einsum("bhs,bhsc->bhc", logits.softmax(-1), v[:, :, :end]))
    return torch.stack(rows, 2)


def _local_reference(q, k, v, w_band, *, causal: bool) -> torch.Tensor:
    """``aft_local_reference`` with ``w_band (T, W)`` scattered into ``w (T, T)`` (0 elsewhere)."""
    T, t = q.shape[1], torch.arange(q.shape[1])[:, None]
    cols = t + torch.arange(w_band.shape[1])[None, :] - (min(WINDOW, T) - 1)
    inside = (cols >= 0) & (cols < T)
    w = w_band.new_zeros(T, T).index_put((t.expand_as(cols)[inside], cols[inside]), w_band[inside])
    return aft_local_reference(q, k, v, w, WINDOW, causal=causal)


ATTENTION = Op(  # q, k, v (B, h, T, c): the layout scaled_dot_product_attention takes
    lambda s, causal: {n: ((s.B, s.h, s.T, s.c), 1.0) for n in "qkv"},
    lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    _attention_reference,
    _quadratic,
    lambda s: (4.0 * s.n, 2.0 * s.n),  # one query against the K and V cache
    lambda s, causal: (4 * s.n, 12 * s.n),
)
SIMPLE = Op(
    partial(_inputs, "aft_simple", {}),
    aft_simple,
    aft_simple_reference,
    lambda s, causal: 10.0 * s.n,  # exp, products, sums, sigmoid: a handful per element
    lambda s: (10.0 * s.B * s.d, 4.0 * s.B * s.d),  # the running sums
    lambda s, causal: (8 * s.n, 24 * s.n),
)

#: How the op of each registered mixer is benchmarked, by mixer name.
OPS: dict[str, Op] = {
    "attention": ATTENTION,
    "attention-naive": replace(  # the (B, h, T, T) scores are materialised
        ATTENTION,
        fast=_naive_attention,
        mem=lambda s, causal: (2 * s.B * s.h * s.T**2 + 6 * s.n, 5 * s.B * s.h * s.T**2 + 6 * s.n),
    ),
    "aft-full": Op(
        partial(_inputs, "aft_full", {"w": 0.5}),
        aft_full,
        aft_full_reference,
        _quadratic,
        lambda s: (4.0 * s.n, 2.0 * s.n + s.T),  # the past exp(k) v, exp(k); a row of w
        lambda s, causal: (3 * s.T**2 + 6 * s.n, 6 * s.T**2 + 16 * s.n),
        io=lambda s, causal: (3 * s.n + s.T * s.T * (0.5 if causal else 1.0), s.n),
    ),
    "aft-local": Op(  # the band form the mixer uses, no T x T
        partial(_inputs, "aft_local_band", {"w_band": 0.5}),
        partial(aft_local_band, window=WINDOW),
        _local_reference,
        lambda s, causal: s.n * (4.0 * _band(s, causal) + 10.0),  # global sums + band
        lambda s: (4.0 * s.B * s.d * _band(s, True), 2.0 * s.B * s.d * WINDOW),  # ring buffer
        lambda s, causal: ((_band(s, causal) + 12) * s.n, (2 * _band(s, causal) + 24) * s.n),
        options={"window": WINDOW},
    ),
    "aft-simple": SIMPLE,
    "aft-conv": replace(  # one key per head, kernels of size KERNEL
        SIMPLE,
        inputs=partial(_inputs, "aft_conv", {"w": 0.5}),
        fast=aft_conv,
        reference=aft_conv_reference,
        flops=lambda s, causal: 2.0 * KERNEL * s.B * s.T * (s.d + s.h) + 10.0 * s.n,
        step=lambda s: (2.0 * KERNEL * s.B * (s.d + s.h), 2.0 * s.B * KERNEL * (s.d + s.h)),
        options={"kernel_size": KERNEL},
    ),
    "aft-decay": replace(  # decays U(0, 0.5)
        SIMPLE,
        inputs=partial(_inputs, "aft_decay", {"decay": "U", "bonus": 0.5}),
        fast=lambda *x, causal: aft_decay(*x),
        reference=lambda *x, causal: aft_decay_reference(*x),
        causal_only=True,
    ),
}

#: ``e (T, T) @ x (T, 2Bd)``: ``exp(w) @ [exp(k) v, exp(k)]``, the products non-causal aft-full
#: cannot avoid, timed beside it; their backward is ``e^T @ g`` and ``g @ x^T``.
MATMUL = Op(
    lambda s, causal: {"e": ((s.T, s.T), 0.1), "x": ((s.T, 2 * s.B * s.d), 1.0)},
    lambda e, x, causal: e @ x,
    lambda e, x, causal: e.double() @ x.double(),
    lambda s, causal: _quadratic(s, False),
    None,
    lambda s, causal: (2 * s.T**2 + 6 * s.n,) * 2,
    io=lambda s, causal: (2 * s.n + s.T * s.T, 2 * s.n),
)


def cases() -> dict[str, Op | None]:
    """The cases by name: every registered mixer (its op, or None: decoding only) and
    ``aft-full-matmul`` (no decoding)."""
    return {m: OPS.get(m) for m in available_mixers()} | {"aft-full-matmul": MATMUL}


class WKV(torch.nn.Module):
    """RWKV's WKV on keys = values = ``x (B, T, d)``, by ``impl`` (``"aftlab"``, ``"hf-rwkv"``
    or ``"fla"``).

    ``Y_t = sum_{t'<t} e^{-(t-1-t') lambda + K_t'} V_t' + e^{u + K_t} V_t`` over the same sum of
    weights, ``lambda = exp(time_decay)``, ``u = time_first``: ``aft_decay(q = 30, x, x, lambda,
    u)`` (``sigma(30) = 1`` in float32), transformers' ``rwkv_linear_attention_cpu``, or
    flash-linear-attention's Triton ``fused_recurrent_rwkv4`` (from the empty state: sums 0,
    shift -1e38; a GPU, or Triton's interpreter).
    """

    def __init__(self, s: Shape, impl: str):
        super().__init__()
        self.impl = impl
        self.time_decay = torch.nn.Parameter(torch.linspace(-3.0, 0.0, s.d))
        self.time_first = torch.nn.Parameter(torch.linspace(-0.5, 0.5, s.d))
        self.register_buffer("q", torch.full((s.B, s.T, s.d), 30.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "hf-rwkv":
            from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

            return rwkv_linear_attention_cpu(self.time_decay, self.time_first, x, x)[0]
        if self.impl == "fla":
            from fla.ops.rwkv4 import fused_recurrent_rwkv4

            state = x.new_zeros(x.shape[0], 3, 1, x.shape[2])
            state[:, 2] = -1e38  # the shift of the empty state
            return fused_recurrent_rwkv4(self.time_decay, self.time_first, x, x, state)[0]
        return aft_decay(self.q, x, x, self.time_decay.exp(), self.time_first)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 per-position ``aft_decay_reference`` of the same WKV."""
        return aft_decay_reference(self.q, x, x, self.time_decay.exp(), self.time_first)


class Scan(torch.nn.Module):
    """A gated scan beside a causal AFT-simple, on ``x (B, T, d)``, by ``impl``: ``"aftlab"``
    (``aft_simple(q = 30, x, x)``, the prefix softmax average ``sum_{t'<=t} e^{x_t'} x_t' /
    sum_{t'<=t} e^{x_t'}``) or ``"fla"`` (HGRN's ``fused_recurrent_hgrn``, ``h_t = e^{g_t}
    h_{t-1} + x_t`` with ``g = log sigmoid(x)``): two one-pass scans over ``B T d``, not the
    same formula (a speed comparison; each checked against its own float64 reference)."""

    def __init__(self, s: Shape, impl: str):
        super().__init__()
        self.impl = impl
        self.register_buffer("q", torch.full((s.B, s.T, s.d), 30.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "fla":
            from fla.ops.hgrn import fused_recurrent_hgrn

            return fused_recurrent_hgrn(x, F.logsigmoid(x))[0]
        return aft_simple(self.q, x, x, causal=True)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 reference of the same scan (HGRN: its recurrence, step by step)."""
        if self.impl != "fla":
            return aft_simple_reference(self.q, x, x, causal=True)
        g, h, out = F.logsigmoid(x).exp(), torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = g[:, t] * h + x[:, t]
            out.append(h)
        return torch.stack(out, 1)


#: Peers: their package on PyPI, the module it installs, and their module beside each of ours
#: (aft-pytorch non-causal; hf-rwkv and fla causal, fla's Triton kernels on a GPU);
#: :func:`peer_module` builds them.
PEERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "aft-pytorch": (
        "aft-pytorch", "aft_pytorch", {"aft-full": "AFTFull", "aft-simple": "AFTSimple"},
    ),
    "hf-rwkv": ("transformers", "transformers", {"aft-decay": "rwkv_linear_attention_cpu"}),
    "fla": (
        "flash-linear-attention", "fla",
        {"aft-decay": "fused_recurrent_rwkv4", "aft-simple": "fused_recurrent_hgrn"},
    ),
}  # fmt: skip
#: The peers compared op to op, and the module of each of our ops there (the others: mixers).
OP_PEERS: dict[str, dict[str, type[torch.nn.Module]]] = {
    "hf-rwkv": {"aft-decay": WKV},
    "fla": {"aft-decay": WKV, "aft-simple": Scan},
}


def peer_module(peer: str, impl: str, variant: str, s: Shape) -> torch.nn.Module:
    """Module ``variant`` of ``impl`` (``"aftlab"`` or the peer) in the pairs of ``peer``."""
    if peer in OP_PEERS:  # op-level pairs: the module of our op, ours or theirs
        ours = {t: o for o, t in PEERS[peer][2].items()}.get(variant, variant)
        return OP_PEERS[peer][ours](s, impl)
    if impl == "aftlab":
        return build_mixer(variant, d_model=s.d, n_heads=1, causal=False, max_seq_len=s.T)
    return getattr(import_module("aft_pytorch"), variant)(max_seqlen=s.T, dim=s.d, hidden_dim=s.d)


def decoding_mixer(name: str, op: Op | None, s: Shape) -> torch.nn.Module:
    """The causal mixer ``name`` of a decoding case at shape ``s`` (``max_seq_len = s.T``), with
    the options of its op (aft-local's window, aft-conv's kernel)."""
    kw = dict(d_model=s.d, n_heads=s.h, causal=True, max_seq_len=s.T)
    return build_mixer(name, **kw, **(op.options if op else {}))


def prepare(spec: Spec, op: Op | None, dtype, device, *, seed: int, reference: bool = False):
    """``(f, x, leaves)``: ``f(x)`` is one forward of the op, peer module or (decode) mixer of
    ``spec`` (``reference``: in float64 from the formula, None if none; a mixer's is its own
    forward); ``leaves`` by name. Inputs and weights are drawn from ``seed``, then cast."""
    s, gen, _ = spec.shape, torch.Generator().manual_seed(seed), torch.manual_seed(seed)
    op = op or cases().get(spec.name)
    if ":" not in spec.name and spec.mode != "decode":
        x, f = op.make(s, spec.causal, dtype, device, gen), op.reference if reference else op.fast
        return (lambda x: f(*x.values(), causal=spec.causal)), x, x
    if decode := spec.mode == "decode":
        m = decoding_mixer(spec.name, op, s)
    else:
        m = peer_module(*spec.name.split(":"), s)
    m = m.eval().to(device=device, dtype=dtype)
    x = torch.randn(s.B, s.T, s.d, generator=gen, dtype=torch.float64).to(device, dtype)
    f = getattr(m, "reference", None) if reference and not decode else m
    return f, x, {"x": x, **dict(m.named_parameters())}
