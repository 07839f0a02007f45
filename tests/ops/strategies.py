"""Hypothesis strategies and checks for the property tests of the AFT ops (test_properties.py).

A strategy draws a small :class:`Recipe` (sizes, dtype, seed, magnitudes as powers of ten, a key
pattern, a padding pattern); the test builds the tensors from it, so a falsifying example prints
as one short line that rebuilds the same tensors.

Tolerance model (:func:`tolerance`). Every AFT output is ``Y_t = gate_t * A_t`` with ``A_t`` a
softmax-weighted average of the values ``V_t'`` over the keys ``t'`` that ``t`` sees. A correct
op in precision ``eps`` computes each score ``K_t' + bias`` (and the log-sums it is shifted by)
to an absolute error of about ``eps * S`` with ``S`` the largest score magnitude involved, so
the weights are off by about that (relative) and ``A_t`` by about ``eps * S * (max V - min V)``
over the seen values -- never more than that range, since ``A_t`` stays a convex combination.
To this come the rounding of the weighted sum (``eps * max |V|``), of a gate that underflows,
and of the output dtype (``aftlab.testing.default_tolerance``). Where ``eps * S`` is of order 1
(keys of 1e30 in float32) the check is that ``A_t`` is within the seen values' range of the
reference; below, it is tight (about 1e-5 relative at moderate magnitudes in float32). Apart
from the reference, every output must lie in ``gate * [min V, max V]`` (:func:`hull_tolerance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from aftlab.ops.signatures import SIGNATURES
from aftlab.testing import default_tolerance

F64 = torch.float64
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
KEY_PATTERNS = ("randn", "increasing", "max_last", "ties")
MASK_ROWS = ("all", "none", "random", "left", "right")  # per batch row; see make_mask
KAPPA = 16  # score error, in units of the log-domain epsilon times the score magnitude S
C_SUM = 64  # rounding of the weighted sum, in units of epsilon times the largest |V| seen


@dataclass(frozen=True)
class Recipe:
    """Everything a property test builds its tensors from (exponents are log10 magnitudes)."""

    op: str
    shape: tuple[int, ...]  # the op's leading shape, SIGNATURES[op].dims: (B, T, d), ...
    dtype: str
    causal: bool
    seed: int
    q_exp: int
    k_exp: int
    v_exp: int
    w_exp: int  # the bias w (full, local), kernel (conv), bonus u (decay)
    lam_exp: int = 0  # the decay lambda (decay, scan)
    keys: str = "randn"  # KEY_PATTERNS
    mask: tuple[str, ...] | None = None  # one MASK_ROWS entry per batch row
    window: int = 0  # aft_local
    s: int = 1  # kernel size (conv)
    ck: int = 1  # key channels per head (conv): 1 or c
    w_extra: int = 0  # w is (T + w_extra, T + w_extra) (full, local)
    decay: bool = False  # scan: with a decay
    reverse: bool = False  # scan: suffix sums

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def magnitudes(lo: int, hi: int) -> st.SearchStrategy[int]:
    """log10 magnitudes: half of the draws moderate (tight tolerance), half large, a quarter of
    those ``hi`` itself (values clamped at the dtype's largest finite number)."""
    return st.one_of(st.integers(lo, 4), st.sampled_from([*range(5, hi + 1), *[hi] * 10]))


@st.composite
def recipes(
    draw,
    op: str,
    *,
    dtypes: tuple[str, ...] = ("float64", "float32") * 2 + ("float16", "bfloat16"),
    causal: bool | None = None,
    small: bool = False,
    empty_length: bool = True,
) -> Recipe:
    """A recipe for ``op``. ``small``: float64, T <= 12, d <= 4, magnitudes 1e-2..1e2 (gradients).

    ``dtypes`` is sampled uniformly (the default: a third of the examples in float16/bfloat16).

    About a third of the examples have one size 0 (B, T, d, H, W, heads, channels; the length
    only if ``empty_length``).
    """
    max_b, max_t, max_d, max_side, max_c = (2, 12, 4, 3, 2) if small else (3, 40, 9, 6, 3)
    high = {"B": max_b, "T": max_t, "d": max_d, "H": max_side, "W": max_side, "h": 3, "c": max_c}
    names = SIGNATURES[op].dims
    shape = [draw(st.integers(1, high[n])) for n in names]
    zero = draw(st.sampled_from([None] * 6 + [n for n in names if empty_length or n not in "THW"]))
    if zero is not None:
        shape[names.index(zero)] = 0
    shape = tuple(shape)
    t = math.prod(shape[1:3]) if op == "aft_conv2d" else shape[1]
    kw = {}
    if op in ("aft_conv", "aft_conv2d"):
        kw["ck"] = draw(st.sampled_from([1, shape[-1]]))
    if op in ("aft_decay", "stable_prefix_average"):
        causal = True
    elif op == "aft_conv2d":
        causal = False
    elif causal is None:
        causal = draw(st.booleans())
    if op == "aft_conv":
        kw["s"] = draw(st.integers(1, 9) if causal else st.sampled_from([1, 3, 5, 7, 9]))
    if op == "aft_conv2d":
        kw["s"] = draw(st.sampled_from([1, 3, 5, 7]))
    if op == "aft_local":
        kw["window"] = draw(st.integers(0, t + 2))
    if op in ("aft_full", "aft_local"):
        kw["w_extra"] = draw(st.integers(0, 2))
    if op == "stable_prefix_average":
        kw["decay"], kw["reverse"] = draw(st.booleans()), draw(st.booleans())
    mags = st.integers(-2, 2) if small else magnitudes(-3, 38)
    patterns = [p for p in KEY_PATTERNS if not (small and p == "max_last")]
    return Recipe(
        op=op,
        shape=shape,
        dtype="float64" if small else draw(st.sampled_from(dtypes)),
        causal=causal,
        seed=draw(st.integers(0, 2**32 - 1)),
        q_exp=draw(mags),
        k_exp=draw(mags),
        v_exp=draw(mags),
        w_exp=draw(mags),
        lam_exp=draw(mags) if op in ("aft_decay", "stable_prefix_average") else 0,
        keys=draw(st.sampled_from(patterns)),
        mask=draw(st.none() | st.tuples(*[st.sampled_from(MASK_ROWS)] * shape[0])),
        **kw,
    )


# ----------------------------------------------------------------------------- tensors
def randn(gen: torch.Generator, shape, exp: int, dtype: torch.dtype) -> torch.Tensor:
    """float64 standard normals times ``10**exp`` (capped at the dtype's largest power of 10)."""
    cap = math.floor(math.log10(torch.finfo(dtype).max))
    return torch.randn(shape, generator=gen, dtype=F64) * 10.0 ** min(exp, cap)


def fit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` clamped to the finite range of ``dtype`` and cast to it."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def pattern_keys(k: torch.Tensor, pattern: str, dtype: torch.dtype) -> torch.Tensor:
    """Keys ``(B, N, ...)`` rearranged along positions (dim 1) as ``pattern`` says.

    ``increasing``: sorted, every key the largest so far; ``max_last``: the last key is the
    dtype's largest finite number; ``ties``: every position has the first one's keys.
    """
    if k.shape[1] == 0 or pattern == "randn":
        return k
    if pattern == "increasing":
        return k.sort(1).values
    if pattern == "ties":
        return k[:, :1].expand_as(k).clone()
    k = k.clone()
    k[:, -1] = torch.finfo(dtype).max
    return k


def make_mask(gen: torch.Generator, rows: tuple[str, ...] | None, n: int) -> torch.Tensor | None:
    """Padding mask ``(B, n)``, True for real tokens, one MASK_ROWS pattern per row.

    ``left`` pads the first ``m`` positions, ``right`` the last ``m`` (``m`` random in
    ``[0, n]``), ``random`` half of them, ``none`` all (a row with no real token).
    """
    if rows is None:
        return None
    pos = torch.arange(n)
    out = []
    for kind in rows:
        r = torch.rand(n, generator=gen) < 0.5
        m = int(torch.randint(0, n + 1, (), generator=gen))
        out.append(
            {
                "all": torch.ones(n, dtype=torch.bool),
                "none": torch.zeros(n, dtype=torch.bool),
                "random": r,
                "left": pos >= m,
                "right": pos < n - m,
            }[kind]
        )
    return torch.stack(out) if out else torch.ones(0, n, dtype=torch.bool)


# ----------------------------------------------------------------------------- tolerance
@dataclass
class Spread:
    """What an AFT output's error depends on, as float64 ``(B, N, D)`` (positions on dim 1).

    ``gate``: ``sigma(Q)`` (None: no gate); ``k``: the keys each channel sees; ``v``: values;
    ``mask``: ``(B, N)`` or None; ``causal``: a position sees ``t' <= t`` (with ``reverse``,
    ``t' >= t``); ``bias``: the largest ``|bias|`` a score may carry (broadcastable);
    ``log_dtype``: the dtype the op computes scores and log-sums in, if not its compute dtype.
    ``ref_steps``: a reference that is a float64 recurrence (the scan's) carries its own score
    error, growing with the steps: ``ref_steps * eps64 * S``.
    """

    gate: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    bias: torch.Tensor | float = 0.0
    reverse: bool = False
    log_dtype: torch.dtype | None = None
    ref_steps: int = 0  # the reference is a recurrence over this many steps (see tolerance)


def _seen_max(x: torch.Tensor, mask, causal: bool) -> torch.Tensor:
    """Max of ``x (B, N, D)`` over the unpadded positions each position sees; -inf where none."""
    if mask is not None:
        x = x.masked_fill(~mask[..., None], float("-inf"))
    return torch.cummax(x, 1).values if causal else x.amax(1, keepdim=True).expand_as(x)


def _epsilons(sp: Spread, dtype: torch.dtype) -> tuple[float, float]:
    compute = F64 if dtype == F64 else torch.float32  # fp16/bf16 are computed in float32
    return torch.finfo(compute).eps, torch.finfo(sp.log_dtype or compute).eps


def _flip(sp: Spread, x: torch.Tensor) -> torch.Tensor:
    return x.flip(1) if sp.reverse else x


def _score(sp: Spread) -> torch.Tensor:
    """``S``: the largest score magnitude a position's sums involve, ``(B, N, D)``."""
    k, mask = _flip(sp, sp.k), None if sp.mask is None else _flip(sp, sp.mask)
    kmax = _flip(sp, _seen_max(k.abs(), mask, sp.causal).clamp_min(0.0))
    return kmax + sp.bias + math.log(k.shape[1] + 1) + 1.0


def tolerance(sp: Spread, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element tolerance of an output in ``dtype`` against the float64 ``expected``.

    ``atol + rtol |expected| + gate (C_SUM eps max|V| + min(1, KAPPA (eps_log S + eps)) R)
    + tiny max|V|`` with ``max|V|`` and ``R = max V - min V`` over the values the position sees
    (see the module docstring), plus ``max|V| expm1(KAPPA ref_steps eps64 S)`` for a recurrent
    reference.
    """
    if expected.numel() == 0:
        return torch.zeros(expected.shape, dtype=F64)
    eps, eps_log = _epsilons(sp, dtype)
    vmin, vmax = seen_range(sp)
    spread, vabs = vmax - vmin, torch.maximum(vmax.abs(), vmin.abs())
    score = _score(sp)
    g = (KAPPA * (eps_log * score + eps)).clamp(max=1.0)
    e = expected.detach().double().reshape(vmax.shape)
    tol = _rounding(sp, dtype, vabs, e) + _gate(sp) * g * spread
    if sp.ref_steps:  # the reference's weights: each off by up to exp(+-ref_steps eps64 S)
        x = (KAPPA * sp.ref_steps * torch.finfo(F64).eps * score).clamp(max=700.0)
        tol = tol + torch.where(vabs > 0, vabs * torch.expm1(x), 0.0)
    return tol.reshape(expected.shape)


def seen_range(sp: Spread) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min V, max V)`` over the values each position sees, ``(B, N, D)``; 0 where none."""
    v, mask = _flip(sp, sp.v), None if sp.mask is None else _flip(sp, sp.mask)
    vmax = _flip(sp, _seen_max(v, mask, sp.causal))
    vmin = -_flip(sp, _seen_max(-v, mask, sp.causal))
    seen = torch.isfinite(vmax)
    return torch.where(seen, vmin, 0.0), torch.where(seen, vmax, 0.0)


def _gate(sp: Spread) -> torch.Tensor | float:
    return 1.0 if sp.gate is None else sp.gate


def _rounding(sp: Spread, dtype: torch.dtype, vabs: torch.Tensor, e: torch.Tensor):
    """Rounding alone: the output dtype's ``atol + rtol |e|``, the weighted sum's
    ``C_SUM eps max|V|`` and a gate ``sigma(Q)`` that underflows (``finfo.tiny max|V|``)."""
    compute = F64 if dtype == F64 else torch.float32
    atol, rtol = default_tolerance(dtype)
    fi = torch.finfo(compute)
    return atol + rtol * e.abs() + (_gate(sp) * C_SUM * fi.eps + fi.tiny) * vabs


def hull_tolerance(sp: Spread, actual: torch.Tensor, dtype: torch.dtype):
    """``(nearest, tol)``: the nearest point of ``gate * [min V, max V]`` (the seen values' range,
    in which every output lies: ``A_t`` is a convex combination) to ``actual``, and the rounding
    tolerance there. A position that sees no value must give 0."""
    vmin, vmax = seen_range(sp)
    gate = _gate(sp)
    a = actual.detach().double().reshape(vmax.shape)
    nearest = torch.minimum(torch.maximum(a, gate * vmin), gate * vmax)
    vabs = torch.maximum(vmax.abs(), vmin.abs())
    tol = _rounding(sp, dtype, vabs, nearest)
    return nearest.reshape(actual.shape), tol.reshape(actual.shape)


def log_tolerance(sp: Spread, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tolerance of a log-sum ``L`` (finite entries): ``atol + rtol |L| + KAPPA eps_log S``."""
    if expected.numel() == 0:
        return torch.zeros(expected.shape, dtype=F64)
    _, eps_log = _epsilons(sp, dtype)
    atol, rtol = default_tolerance(dtype)
    e = expected.detach().double()
    eps_ref = sp.ref_steps * torch.finfo(F64).eps
    return atol + rtol * e.abs() + KAPPA * (eps_log + eps_ref) * _score(sp).reshape(e.shape)


# ----------------------------------------------------------------------------- checks
def first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(mask.nonzero()[0].tolist())


def assert_within(name: str, actual, expected, tol) -> None:
    """``actual`` is finite and ``|actual - expected| <= tol`` elementwise where ``expected`` is
    finite (where the float64 reference overflowed, finiteness is all that is checked).

    Like :func:`aftlab.testing.assert_close` but with a per-element tolerance; names ``name``.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    bad = ~torch.isfinite(a)
    if bad.any():
        i = first_index(bad)
        raise AssertionError(
            f"{name}: {int(bad.sum())} non-finite value(s) from finite input, first at {i}: "
            f"got {a[i].item()}, reference {e[i].item()}"
        )
    excess = torch.where(torch.isfinite(e), (a - e).abs() - tol, float("-inf"))
    over = excess > 0
    if over.any():
        i = tuple(int(j) for j in torch.unravel_index(excess.flatten().argmax(), a.shape))
        raise AssertionError(
            f"{name}: {int(over.sum())}/{a.numel()} elements out of tolerance; worst at {i}: "
            f"got {a[i].item():.10g}, reference {e[i].item():.10g}, tolerance {tol[i].item():.3g}"
        )


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(name: str, before: torch.Tensor, after: torch.Tensor) -> None:
    """``before`` and ``after`` are equal bit for bit (NaN included), naming ``name``."""
    x, y = (t.detach().contiguous() for t in (before, after))
    differ = x.view(_INT[x.element_size()]) != y.view(_INT[y.element_size()])
    if differ.any():
        i = first_index(differ)
        raise AssertionError(
            f"{name}: {int(differ.sum())} element(s) changed, first at {i}: "
            f"{x[i].item()!r} -> {y[i].item()!r}"
        )
