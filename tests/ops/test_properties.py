"""Property tests (hypothesis) of every AFT op against its float64 ``*_reference``.

For random sizes (zeros included), magnitudes from 1e-3 to the float32 maximum, padding masks
(rows without a real token included), causal or not, and float64/float32/float16/bfloat16:

* forward: the output is finite and within the tolerance model of ``strategies.tolerance`` of
  the reference computed on the same (rounded) inputs;
* gradients (float64, small): every input's gradient matches the reference's, via autograd;
* causality: changing inputs at position ``p`` (to NaN, inf, the largest float, anything)
  leaves every output before ``p`` unchanged, bit for bit.

The example budget is the hypothesis profile's (tests/conftest.py: ``ci`` by default; run
``pytest tests/ops/test_properties.py --hypothesis-profile=dev`` for many more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aftlab.kernels import OPS as KERNEL_OPS  # ops with a C++ kernel: test the PyTorch path too
from aftlab.kernels import use_kernels
from aftlab.ops import (
    aft_conv,
    aft_conv2d,
    aft_decay,
    aft_full,
    aft_local,
    aft_simple,
    stable_prefix_average,
)
from aftlab.ops.aft_conv import aft_conv2d_reference, aft_conv_reference
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.ops.aft_full import aft_full_reference
from aftlab.ops.aft_local import aft_local_reference
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.ops.scan import stable_prefix_average_reference
from aftlab.ops.signatures import SIGNATURES
from aftlab.testing import assert_close

from .strategies import (
    F64,
    Recipe,
    Spread,
    assert_same_bits,
    assert_within,
    first_index,
    fit,
    hull_tolerance,
    log_tolerance,
    make_mask,
    pattern_keys,
    randn,
    recipes,
    tolerance,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # small sizes (conftest)


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """An op call built from a recipe: ``op(**tensors, **options)``, likewise the reference."""

    op: Callable
    ref: Callable
    tensors: dict[str, torch.Tensor]  # the op's tensor arguments, in the recipe's dtype
    options: dict  # causal, window, padding_mask, ...
    positions: dict[str, tuple[int, ...]]  # the position dims of each positional tensor
    spread: Callable[[dict[str, torch.Tensor]], Spread]  # from float64 tensors
    reverse: bool = False  # outputs depend on later positions (reverse scan)

    def run(self, fn, tensors=None, **options):
        out = fn(**(self.tensors if tensors is None else tensors), **{**self.options, **options})
        return list(out) if isinstance(out, tuple) else [out]


def _generator(r: Recipe) -> torch.Generator:
    return torch.Generator().manual_seed(r.seed)


_EXP = {"q": "q_exp", "k": "k_exp", "v": "v_exp", "decay": "lam_exp"}  # others: w_exp


def _draw(r: Recipe, gen, skip=()) -> dict[str, torch.Tensor]:
    """Float64 arguments of ``r.op`` (shapes from its signature), in order, ``randn * 10**exp``:
    ``k`` patterned along the positions (an image's in raster order), ``decay = |randn|``. An
    op without ``q`` (the scan) draws one all the same: its ``k, v`` are the others'."""
    sig, dt = SIGNATURES[r.op], r.torch_dtype
    sizes = dict(zip(sig.dims, r.shape, strict=True), ck=r.ck, s=r.s, Tw=r.shape[1] + r.w_extra)
    shapes = sig.shapes(sizes, skip)
    if "q" not in shapes:
        randn(gen, shapes["k"], r.q_exp, dt)
    out = {}
    for name, shape in shapes.items():
        x = randn(gen, shape, getattr(r, _EXP.get(name, "w_exp")), dt)
        if name == "k":
            n_pos = sum(dim in ("T", "H", "W") for dim in sig.args["k"].split())  # T, or H and W
            x = pattern_keys(x.flatten(1, n_pos), r.keys, dt).reshape(shape)
        out[name] = x.abs() if name == "decay" else x
    return out


def _case(r: Recipe, op, ref, tensors, options, spread, **kw) -> Case:
    """``r.op``'s case: ``tensors`` cast to the recipe's dtype, positions from its signature."""
    fitted = {n: fit(x, r.torch_dtype) for n, x in tensors.items()}
    return Case(op, ref, fitted, options, SIGNATURES[r.op].positions(), spread, **kw)


def _flat(x: torch.Tensor, n_lead: int) -> torch.Tensor:
    """``(B, *positions, *channels)`` -> ``(B, N, D)``."""
    return x.reshape(x.shape[0], -1, *x.shape[n_lead:]).flatten(2)


def _bias(w: torch.Tensor) -> float:
    return w.abs().max().item() if w.numel() else 0.0


def _full_like(r: Recipe, op, ref, extra: dict):
    """aft_full / aft_local: ``w`` is ``(T + w_extra, T + w_extra)``."""
    gen, T = _generator(r), r.shape[1]
    tensors = _draw(r, gen)
    mask = make_mask(gen, r.mask, T)

    def spread(t):
        return Spread(t["q"].sigmoid(), t["k"], t["v"], mask, r.causal, _bias(t["w"][:T, :T]))

    return _case(r, op, ref, tensors, {"causal": r.causal, "padding_mask": mask, **extra}, spread)


def build_full(r: Recipe) -> Case:
    return _full_like(r, aft_full, aft_full_reference, {})


def build_local(r: Recipe) -> Case:
    return _full_like(r, aft_local, aft_local_reference, {"window": r.window})


def build_simple(r: Recipe) -> Case:
    gen = _generator(r)
    tensors = _draw(r, gen)
    mask = make_mask(gen, r.mask, r.shape[1])
    return _case(
        r,
        aft_simple,
        aft_simple_reference,
        tensors,
        {"causal": r.causal, "padding_mask": mask},
        lambda t: Spread(t["q"].sigmoid(), t["k"], t["v"], mask, r.causal),
    )


def build_decay(r: Recipe) -> Case:
    gen, T = _generator(r), r.shape[1]
    tensors = _draw(r, gen)
    mask = make_mask(gen, r.mask, T)

    def spread(t):  # scores -(t - 1 - t') lambda + K_t' and u + K_t
        bias = T * t["decay"] + t["bonus"].abs()
        return Spread(t["q"].sigmoid(), t["k"], t["v"], mask, True, bias)

    return _case(r, aft_decay, aft_decay_reference, tensors, {"padding_mask": mask}, spread)


def build_conv(r: Recipe) -> Case:
    gen, (B, T, h, c) = _generator(r), r.shape
    tensors = _draw(r, gen)
    mask = make_mask(gen, r.mask, T)

    def spread(t):
        kk = t["k"].expand(B, T, h, c)
        return Spread(
            _flat(t["q"].sigmoid(), 2), _flat(kk, 2), _flat(t["v"], 2), mask, r.causal,
            _bias(t["w"]), log_dtype=F64,  # scores and log-sums are carried in float64
        )

    options = {"causal": r.causal, "padding_mask": mask}
    return _case(r, aft_conv, aft_conv_reference, tensors, options, spread)


def build_conv2d(r: Recipe) -> Case:
    gen, (B, H, W, h, c) = _generator(r), r.shape
    tensors = _draw(r, gen)
    flat_mask = make_mask(gen, r.mask, H * W)
    mask = None if flat_mask is None else flat_mask.reshape(B, H, W)

    def spread(t):
        kk = t["k"].expand(B, H, W, h, c)
        return Spread(
            _flat(t["q"].sigmoid(), 3), _flat(kk, 3), _flat(t["v"], 3), flat_mask, False,
            _bias(t["w"]), log_dtype=F64,
        )

    return _case(r, aft_conv2d, aft_conv2d_reference, tensors, {"padding_mask": mask}, spread)


def build_scan(r: Recipe) -> Case:
    """stable_prefix_average, with ``decay`` if the recipe says so; returns ``(L, A)``."""
    gen, T = _generator(r), r.shape[1]
    tensors = _draw(r, gen, skip=() if r.decay else ("decay",))
    mask = make_mask(gen, r.mask, T)

    def spread(t):
        bias = T * t["decay"] if r.decay else 0.0
        return Spread(None, t["k"], t["v"], mask, True, bias, reverse=r.reverse, ref_steps=T)

    return _case(
        r,
        stable_prefix_average,
        stable_prefix_average_reference,
        tensors,
        {"reverse": r.reverse, "padding_mask": mask},
        spread,
        reverse=r.reverse,
    )


BUILD = {
    "aft_full": build_full,
    "aft_local": build_local,
    "aft_simple": build_simple,
    "aft_conv": build_conv,
    "aft_conv2d": build_conv2d,
    "aft_decay": build_decay,
    "stable_prefix_average": build_scan,
}
IMPLS = [(op, "default") for op in BUILD] + [(op, "pytorch") for op in KERNEL_OPS]
CAUSAL_IMPLS = [(op, impl) for op, impl in IMPLS if op != "aft_conv2d"]


@pytest.fixture
def impl(request):
    """Runs the test with the op's default implementation, or its pure-PyTorch one."""
    if request.param == "default":
        yield request.param
    else:
        with use_kernels(False):
            yield request.param


def _reference(case: Case, tensors: dict[str, torch.Tensor], outputs):
    """The float64 reference's outputs; an empty output is empty (no reference call)."""
    if outputs[0].numel() == 0:
        return [torch.zeros(o.shape, dtype=F64) for o in outputs]
    return case.run(case.ref, tensors)


def _finite(L: torch.Tensor) -> torch.Tensor:
    """``L`` with -inf (no key seen) replaced by 0."""
    return torch.where(torch.isfinite(L), L, torch.zeros_like(L))


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("op, impl", IMPLS, indirect=["impl"])
@given(data=st.data())
def test_forward_matches_reference(op, impl, data):
    check_forward(data.draw(recipes(op), label="recipe"))


def check_forward(r: Recipe) -> None:
    op, case = r.op, BUILD[r.op](r)
    dt = r.torch_dtype
    outputs = case.run(case.op)
    ref_tensors = {n: x.double() for n, x in case.tensors.items()}
    expected = _reference(case, ref_tensors, outputs)
    first = next(iter(case.tensors.values()))
    for o in outputs:
        assert o.dtype == dt and o.shape == first.shape, (o.dtype, tuple(o.shape))
    if outputs[0].numel() == 0:
        return
    sp = case.spread(ref_tensors)
    y, y0 = outputs[-1], expected[-1]  # the scan's A, the others' Y
    if op == "stable_prefix_average":
        # A log-sum at (or beyond) the edge of the dtype's range has only -inf (or a rounding
        # of the edge) in it; A is then checked within the seen values' range only
        # (docs/aft-scan.md, "Range").
        edge = expected[0].abs() > torch.finfo(dt).max * (1 - 1e-4)
        y0 = y0.masked_fill(edge, float("inf"))
    name = "A" if op == "stable_prefix_average" else "y"
    assert_within(name, y, y0, tolerance(sp, y0, dt))
    assert_within(f"{name} (within the seen values' range)", y, *hull_tolerance(sp, y, dt))
    if op == "stable_prefix_average":
        L, L0 = outputs[0], expected[0].masked_fill(edge, float("inf"))
        differ = (torch.isfinite(L) != torch.isfinite(L0)) & ~edge
        assert not differ.any(), (
            f"L: finite where the reference is not or back, first at {first_index(differ)}: "
            f"got {L[first_index(differ)].item()}, reference {L0[first_index(differ)].item()}"
        )
        L = L.masked_fill(edge, 0.0)  # not compared at the edge (L0 is 0 there too)
        assert_within("L", _finite(L), _finite(L0), log_tolerance(sp, _finite(L0), dt))


# ----------------------------------------------------------------------------- gradients
def _grads(outputs, tensors, upstream):
    """Gradients of ``sum_i (outputs_i * upstream_i).sum()``; an unused input gets zeros."""
    loss = sum((_finite(o).double() * g).sum() for o, g in zip(outputs, upstream, strict=True))
    xs = list(tensors.values())
    gs = [None] * len(xs)
    if loss.requires_grad:  # an empty output may not be connected to the inputs
        gs = torch.autograd.grad(loss, xs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, xs, strict=True)]


@pytest.mark.parametrize("op, impl", IMPLS, indirect=["impl"])
@given(data=st.data())
def test_gradients_match_reference(op, impl, data):
    check_gradients(data.draw(recipes(op, small=True), label="recipe"))


def check_gradients(r: Recipe) -> None:
    case = BUILD[r.op](r)
    xs = {n: x.clone().requires_grad_() for n, x in case.tensors.items()}
    rs = {n: x.clone().requires_grad_() for n, x in case.tensors.items()}
    outputs = case.run(case.op, xs)
    gen = torch.Generator().manual_seed(r.seed + 1)
    upstream = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outputs]
    got = _grads(outputs, xs, upstream)
    if outputs[0].numel() == 0:
        want = [torch.zeros_like(x) for x in rs.values()]
    else:
        want = _grads(case.run(case.ref, rs), rs, upstream)
    for name, a, e in zip(xs, got, want, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        scale = 1.0 + (e.abs().max().item() if e.numel() else 0.0)
        assert_close(f"d{name}", a, e, atol=1e-10 * scale, rtol=1e-8)


# ----------------------------------------------------------------------------- causality
_VALUES = ("nan", "inf", "-inf", "max", "-max", "random")


def _perturb(x: torch.Tensor, dims, region: slice, value: str, gen) -> torch.Tensor:
    """``x`` with every index in ``region`` along each of ``dims`` set to ``value``."""
    x = x.clone()
    big = torch.finfo(x.dtype).max
    for dim in dims:
        idx = (slice(None),) * dim + (region,)
        if value == "random":
            x[idx] = fit(torch.randn(x[idx].shape, generator=gen, dtype=F64) * 1e3, x.dtype)
        else:
            x[idx] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                      "max": big, "-max": -big}[value]
    return x


@pytest.mark.parametrize("op, impl", CAUSAL_IMPLS, indirect=["impl"])
@given(data=st.data())
def test_causal_outputs_ignore_later_positions(op, impl, data):
    """Inputs at position ``p`` (or at every position from ``p`` on) change no output before
    ``p``, bit for bit (reverse scan: no output after ``p``), even when they become NaN/inf."""
    r = data.draw(recipes(op, causal=True, empty_length=False), label="recipe")
    case = BUILD[op](r)
    T = r.shape[1]
    p = data.draw(st.integers(0, T - 1), label="p")
    value = data.draw(st.sampled_from(_VALUES), label="value")
    names = sorted(case.positions) + ([] if r.mask is None else ["padding_mask"])
    targets = data.draw(st.sets(st.sampled_from(names), min_size=1), label="targets")
    to_end = data.draw(st.booleans(), label="to the end")
    region = slice(p, T if to_end else p + 1)
    kept = slice(0, p)
    if case.reverse:  # suffix sums: position p and before change no output after p
        region, kept = slice(0 if to_end else p, p + 1), slice(p + 1, T)
    gen = torch.Generator().manual_seed(r.seed + 2)
    tensors = {
        n: _perturb(x, case.positions[n], region, value, gen) if n in targets else x
        for n, x in case.tensors.items()
    }
    options = {}
    if "padding_mask" in targets:
        mask = case.options["padding_mask"].clone()
        mask[:, region] = torch.rand(mask[:, region].shape, generator=gen) < 0.5
        options["padding_mask"] = mask
    before, after = case.run(case.op), case.run(case.op, tensors, **options)
    for i, (y0, y1) in enumerate(zip(before, after, strict=True)):
        assert_same_bits(f"output {i}[:, {kept.start}:{kept.stop}]", y0[:, kept], y1[:, kept])
