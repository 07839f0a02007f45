"""Causality bit for bit, and NaN in / NaN out, for every causal op on every implementation.

A causal output at ``t`` may depend on the inputs at ``t' <= t`` only: changing ``q``, ``k`` or
``v`` at position ``p`` (to NaN, +inf, -inf or another finite number) must leave every output
before ``p`` bit-identical (``torch.equal``). The sizes make the ops' blocks matter: causal
AFT-full cuts T = 600 into query blocks of 256 rows (``p = 300`` is inside one, ``p = 256`` its
first row), AFT-local's band into blocks of 64.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from aftlab.ops import (
    aft_conv,
    aft_decay,
    aft_full,
    aft_local,
    aft_simple,
    stable_prefix_average,
)
from aftlab.ops.aft_full import aft_full_reference
from aftlab.ops.aft_local import aft_local_reference
from aftlab.testing import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # small sizes (conftest)

try:  # ops with a fused C++ kernel also have a pure-PyTorch implementation: test both
    from aftlab.kernels import OPS as KERNEL_OPS
    from aftlab.kernels import load as kernels_load
    from aftlab.kernels import use_kernels
except ImportError:  # pragma: no cover - a tree without aftlab.kernels
    KERNEL_OPS, use_kernels, kernels_load = (), None, None

aft_full_module = importlib.import_module("aftlab.ops.aft_full")
lse_module = importlib.import_module("aftlab.ops.lse_average")

B, T, D = 2, 600, 4
BAD = [float("nan"), float("inf"), float("-inf"), 1e3]


def _qkv(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, B, T, D, generator=g).unbind(0)
    return {"q": q, "k": k * scale, "v": v}


_W = torch.randn(T, T, generator=torch.Generator().manual_seed(1))
_LAM, _U = torch.rand(2, D, generator=torch.Generator().manual_seed(2))
_KER = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))


def _conv(q, k, v):  # 2 heads of 2 channels, one key channel per head
    h = lambda x: x.reshape(B, T, 2, 2)  # noqa: E731
    return aft_conv(h(q), h(k)[..., :1], h(v), _KER, causal=True).reshape(B, T, D)


#: every causal op of aftlab.ops, as ``f(q, k, v) -> outputs (B, T, ...)``
OPS = {
    "aft_full": lambda q, k, v: aft_full(q, k, v, _W, causal=True),
    "aft_full_huge": lambda q, k, v: aft_full(q, k * 1e4, v, _W * 1e4, causal=True),
    "aft_local_32": lambda q, k, v: aft_local(q, k, v, _W, 32, causal=True),
    "aft_local_1": lambda q, k, v: aft_local(q, k, v, _W, 1, causal=True),
    "aft_local_huge": lambda q, k, v: aft_local(q, k * 1e4, v, _W * 1e4, 40, causal=True),
    "aft_simple": lambda q, k, v: aft_simple(q, k, v, causal=True),
    "aft_decay": lambda q, k, v: aft_decay(q, k, v, _LAM, _U),
    "aft_conv": _conv,
    "stable_prefix_average": lambda q, k, v: torch.cat(stable_prefix_average(k, v), -1),
}
IMPLS = [(op, "default") for op in OPS] + [(op, "pytorch") for op in OPS if op in KERNEL_OPS]
IMPL_NAMES = ["default", "pytorch"] if use_kernels is not None else ["default"]


def _impl(impl: str):
    return use_kernels(False) if impl == "pytorch" else contextlib.nullcontext()


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("op, impl", IMPLS)
def test_an_input_at_p_changes_no_output_before_p(op, impl, which):
    """NaN, +inf, -inf or a large finite value at p: outputs before p are bit-identical."""
    f, x = OPS[op], _qkv()
    with _impl(impl):
        y0 = f(**x)
        for p in (256, 300, 1):
            for bad in BAD:
                xb = {n: t.clone() for n, t in x.items()}
                xb[which][:, p] = bad
                y = f(**xb)
                assert torch.equal(y[:, :p], y0[:, :p]), f"{which}[{p}] = {bad} moved y[:{p}]"


#: the ops whose gradients are bit-exact before p, as ``f(q, k, v, w)``
GRAD_OPS = {
    "aft_full": lambda q, k, v, w: aft_full(q, k, v, w, causal=True),
    "aft_full_huge": lambda q, k, v, w: aft_full(q, k * 1e4, v, w * 1e4, causal=True),
    "aft_local_32": lambda q, k, v, w: aft_local(q, k, v, w, 32, causal=True),
    "aft_local_band": lambda q, k, v, w: aft_local(q, k, v, w, T, causal=True),
}


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("op, impl", [(op, impl) for op in GRAD_OPS for impl in IMPL_NAMES])
def test_gradients_before_p_ignore_an_input_at_p(op, impl, which):
    """Gradients of the inputs before p from the outputs before p are bit-identical too; the
    other sequence's gradients and the bias rows before p stay finite and equal up to rounding.

    The value at p is changed in the first sequence only, whose loss reads its outputs before
    p, while the second sequence's loss reads all its outputs: the blocks after p are then
    computed for both, and the first sequence's factors there (shifted by a max that may be
    NaN) must still add exactly nothing. AFT-full: NaN and inf as well. AFT-local with a window
    shorter than T also sums the keys outside the window with the scan, whose backward turns
    ``0 * NaN`` into NaN; its band (``window >= T``) and every finite change are checked.
    """
    f = GRAD_OPS[op]
    bads = BAD if op.startswith("aft_full") or op == "aft_local_band" else [1e3, -7.5]

    def grads(x):
        xs = {n: t.clone().requires_grad_() for n, t in x.items()}
        w = _W.clone().requires_grad_()
        with _impl(impl):
            y = f(**xs, w=w)
            return torch.autograd.grad(y[0, :p].sum() + y[1].sum(), [*xs.values(), w])

    x, p = _qkv(), 300
    g0 = grads(x)
    for bad in bads:
        xb = {n: t.clone() for n, t in x.items()}
        xb[which][0, p] = bad
        *gx, gw = grads(xb)
        for name, a, b in zip("qkv", gx, g0[:3], strict=True):
            assert torch.equal(a[0, :p], b[0, :p]), f"d{name}[0, :{p}] moved, {which}[0, {p}]={bad}"
            # the other sequence: finite and unchanged up to rounding (the C++ kernel's blocks
            # may take another path for the whole batch, e.g. a shift formed again)
            assert_close(f"d{name}[1] with {which}[0, {p}]={bad}", a[1], b[1])
        assert_close(f"dw[:{p}] with {which}[0, {p}]={bad}", gw[:p], g0[-1][:p])


# ----------------------------------------------------------------------------- NaN in, NaN out
def _reference(op, q, k, v, w, causal):
    if op == "aft_full":
        return aft_full(q, k, v, w, causal=causal), aft_full_reference(q, k, v, w, causal=causal)
    return (
        aft_local(q, k, v, w, 3, causal=causal),
        aft_local_reference(q, k, v, w, 3, causal=causal),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("op", ["aft_full", "aft_local"])
def test_nan_in_gives_nan_out_where_the_reference_has_it(op, which, causal):
    """A NaN input is never hidden: NaN exactly where the float64 reference is NaN."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(3, 2, 40, 3, generator=g).unbind(0)
    w = torch.randn(40, 40, generator=g)
    x = {"q": q, "k": k, "v": v}
    x[which][0, 17, 1] = float("nan")
    y, ref = _reference(op, x["q"], x["k"], x["v"], w, causal)
    assert ref.isnan().any()
    assert torch.equal(y.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert_close("y where finite", y[ok], ref[ok])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["aft_full", "aft_local"])
def test_largest_finite_keys_and_biases_give_finite_outputs(op, causal):
    """|k|, |w| up to 0.9 * finfo(float32).max: finite, as the float64 reference."""
    big = 0.9 * torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(5)
    q, v = torch.randn(2, 2, 40, 3, generator=g).unbind(0)
    # uniform in (-big, big): no ties among the huge values, which float64 could not resolve
    k = (torch.rand(2, 40, 3, generator=g) * 2 - 1) * big
    w = (torch.rand(40, 40, generator=g) * 2 - 1) * big
    k[0, 5], w[:, 7] = big, -big
    y, ref = _reference(op, q, k, v, w, causal)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(y).all()
    # AFT-full is exact there. AFT-local's sums outside its window (bias 0) are the scan's,
    # which resolves log-sums to float32's spacing (not log 2 at 1e8) and takes keys down to
    # -finfo.max / 8 (aftlab.ops.scan); its band, with these biases, is exact.
    k_ok = k if op == "aft_full" else k / 1e34
    y, ref = _reference(op, q, k_ok, v, w, causal)
    assert_close("y", y, ref)


def _exact_rows(impl, monkeypatch, q, k, v, w):
    """Rows causal AFT-full computes on its exact path: the kernel's output ``fb`` (C++), the
    calls of the float64 rescue (PyTorch)."""
    if impl == "kernel":
        block = lse_module.causal_block_size(q.shape[1], aft_full_module._KERNEL_CAUSAL_BLOCK)
        fb = torch.ops.aftlab.full(q, k, v, w, None, True, block, False)[3]
        return int(fb.sum())
    calls = []
    real = lse_module._rescue_forward
    monkeypatch.setattr(lse_module, "_rescue_forward", lambda *a: calls.append(1) or real(*a))
    with use_kernels(False):
        aft_full(q, k, v, w, causal=True)
    monkeypatch.undo()
    return len(calls)


FULL_IMPLS = ["kernel", "pytorch"] if "aft_full" in KERNEL_OPS else ["pytorch"]


@pytest.mark.parametrize("impl", FULL_IMPLS)
def test_unsafe_diagonal_keys_take_the_exact_path(monkeypatch, impl):
    """A diagonal key far above the block's shift (finite inputs) is recomputed exactly."""
    if impl == "kernel" and not kernels_load():
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(3, 1, 9, 2, generator=g, dtype=torch.float64).unbind(0)
    w = torch.randn(9, 9, generator=g, dtype=torch.float64)
    k[0, 0], k[0, 4] = -60.0, 60.0  # key 4 is e^120 times the block's shift (key 0)
    assert _exact_rows(impl, monkeypatch, q, k, v, w), "the exact path was not taken"
    xs = [x.requires_grad_() for x in (q, k, v, w)]
    with use_kernels(impl == "kernel"):
        y = aft_full(*xs, causal=True)
        assert_close("y", y, aft_full_reference(*xs, causal=True))
        assert torch.autograd.gradcheck(lambda *a: aft_full(*a, causal=True), xs)


@pytest.mark.parametrize("impl", FULL_IMPLS)
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_nan_input_is_not_recomputed_exactly(which, monkeypatch, impl):
    """NaN outputs are NaN from the fast path: the exact path (slow) is for finite inputs."""
    if impl == "kernel" and not kernels_load():
        pytest.skip("kernels unavailable")
    x = _qkv()
    x[which][0, 10, 1] = float("nan")  # before the 2nd and 3rd blocks' key shift
    assert _exact_rows(impl, monkeypatch, x["q"], x["k"], x["v"], _W) == 0
    with use_kernels(impl == "kernel"):
        y = aft_full(x["q"], x["k"], x["v"], _W, causal=True)
    assert y[0, 10:, 1].isnan().all() and not y[0, :10].isnan().any()
    assert not y[:, :, [0, 2, 3]].isnan().any() and not y[1].isnan().any()


@pytest.mark.parametrize("impl", FULL_IMPLS)
@pytest.mark.parametrize("op", ["aft_full", "aft_local"])
def test_rows_rescued_together_keep_causality(op, impl):
    """Short sequences of steep keys send most rows to the exact path, in one chunk: a later
    row that joins the chunk (its key made NaN, inf or huge) must not move an earlier row's
    bits. (The chunk's shift once held the headroom of the columns it read, which grow with
    its last row.)"""
    moved = []
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        n = 2 + seed % 4
        q, v = torch.randn(2, 1, n, 2, generator=g, dtype=torch.float64)
        k = torch.sort(torch.randn(1, n, 2, generator=g, dtype=torch.float64) * 100, 1).values
        w = torch.randn(n, n, generator=g, dtype=torch.float64)
        args = (q, v, w) if op == "aft_full" else (q, v, w, n)
        with use_kernels(impl == "kernel"):
            y = _full_or_local(op, k, *args)
            for p in range(1, n):
                for bad in (float("nan"), float("inf"), 1e300):
                    k2 = k.clone()
                    k2[:, p] = bad
                    if not torch.equal(_full_or_local(op, k2, *args)[:, :p], y[:, :p]):
                        moved.append((seed, p, bad))
    assert moved == [], f"{op}: earlier outputs moved for (seed, p, value) {moved[:5]}"


def _full_or_local(op, k, q, v, w, *window):
    fn = aft_full if op == "aft_full" else aft_local
    return fn(q, k, v, w, *window, causal=True)
