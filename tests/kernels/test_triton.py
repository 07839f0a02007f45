"""The Triton kernels' machinery: their ops' schemas, the dispatch per device, the state they
carry, and ``torch.compile``. On a machine without a GPU they run on CPU tensors through
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``); on a GPU
(benchmarks/run_cuda.sh) the same tests run them compiled, on CUDA tensors.

Their values against the float64 references are tested in tests/ops (test_aft_simple.py,
test_aft_decay.py), where every test runs on each implementation (tests/conftest.py, ``impl``).
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from aftlab import kernels
from aftlab.ops import aft_conv, aft_decay, aft_local, aft_simple
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.testing import assert_close

needs_triton = pytest.mark.skipif(
    not kernels.triton.load(), reason=f"Triton kernels unavailable: {kernels.triton.error()}"
)
pytestmark = needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64


def _inputs(B=2, T=13, d=5, dtype=F64):
    q, k, v = (torch.randn(B, T, d, dtype=dtype, device=DEVICE) for _ in range(3))
    lam = torch.rand(d, dtype=dtype, device=DEVICE)
    u = torch.randn(d, dtype=dtype, device=DEVICE)
    return q, k * 3, v, lam, u


def _has_node(fn, name: str) -> bool:
    """Whether the autograd graph from ``fn`` has a node named like ``name``."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if name in f.name():
            return True
        todo.extend(g for g, _ in f.next_functions)
    return False


def _cuda_tensor():
    """Something :func:`aftlab.kernels.implementation` reads as a CUDA tensor (its device)."""
    return SimpleNamespace(device=torch.device("cuda"))


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels are not built")
def test_schemas_are_those_of_the_cpp_ops():
    from aftlab.kernels.triton import scan as triton_scan

    for name in triton_scan.SCHEMAS:
        cpp = str(getattr(torch.ops.aftlab, name).default._schema)
        tri = str(getattr(torch.ops.aftlab, "triton_" + name).default._schema)
        assert tri == cpp.replace(f"aftlab::{name}(", f"aftlab::triton_{name}(", 1), name


def test_cuda_tensors_run_triton_where_an_op_has_a_kernel(monkeypatch):
    monkeypatch.delenv("AFTLAB_KERNELS", raising=False)
    for op in kernels.OPS:
        expected = "triton" if op in kernels.triton.OPS else "torch"
        assert kernels.implementation(op, _cuda_tensor()) == expected, op
        impl, why = kernels.status("cuda")[op]
        assert impl == expected and why, op
    monkeypatch.setenv("AFTLAB_KERNELS", "0")
    assert kernels.implementation("aft_simple", _cuda_tensor()) == "torch"
    with kernels.use_kernels(False):
        off = ("torch", "switched off by use_kernels(False)")
        assert kernels.status("cuda")["aft_decay"] == off


def test_forcing_triton_runs_its_ops(monkeypatch):
    q, k, v, lam, u = (t.requires_grad_() for t in _inputs())
    monkeypatch.setenv("AFTLAB_KERNELS", "triton")
    assert kernels.implementation("aft_simple", q) == "triton"
    assert "triton_simple_causal" in aft_simple(q, k, v, causal=True).grad_fn.name()
    assert "triton_simple_global" in aft_simple(q, k, v).grad_fn.name()
    assert "triton_decay" in aft_decay(q, k, v, lam, u).grad_fn.name()
    monkeypatch.delenv("AFTLAB_KERNELS")
    with kernels.use_kernels("triton"):
        assert "triton_decay" in aft_decay(q, k, v, lam, u).grad_fn.name()
        w = torch.randn(13, 13, dtype=F64, device=DEVICE, requires_grad=True)
        y = aft_local(q, k, v, w, 3)
        (g,) = torch.autograd.grad(y.sum(), w)
        assert _has_node(y.grad_fn, "triton_band_dot") and g.abs().sum() > 0
    with pytest.raises(ValueError, match="'triton'"):
        with kernels.use_kernels("tritn"):
            pass
    with pytest.raises(ValueError, match="'op' must be one of"):
        kernels.implementation("aft_mystery", q)


_NO_INTERPRETER = """
import torch
from aftlab import kernels
from aftlab.ops import aft_simple
print(kernels.status()["aft_simple"])
q = torch.randn(1, 4, 3)
try:
    aft_simple(q, q, q, causal=True)
except RuntimeError as e:
    print("RuntimeError", e)
"""


def test_forced_triton_on_cpu_without_the_interpreter_says_so():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["AFTLAB_KERNELS"] = "triton"
    out = subprocess.run(
        [sys.executable, "-c", _NO_INTERPRETER], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout
    assert "('torch', \"the Triton kernels on CPU tensors need Triton's interpreter" in out, out
    assert "RuntimeError aftlab: aft_simple: the Triton kernels on CPU tensors need" in out, out
    assert "TRITON_INTERPRET=1" in out


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_decay_state_continues_across_calls(dtype):
    """Chunks carrying the state (the one-pass ``triton_decay_state``) equal one call; the
    state after equals the C++ kernel's, and the outputs the float64 reference."""
    q, k, v, lam, u = _inputs(B=2, T=23, d=7, dtype=dtype)
    tol = {} if dtype == F64 else {"atol": 1e-5, "rtol": 1e-5}
    with kernels.use_kernels("triton"), torch.no_grad():
        whole, s_whole = aft_decay(q, k, v, lam, u, return_state=True)
        ys, state = [], None
        for lo, hi in ((0, 1), (1, 9), (9, 23)):
            y, state = aft_decay(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], lam, u,
                                 initial_state=state, return_state=True)
            ys.append(y)
    assert state.position == 23
    assert_close("chunked", torch.cat(ys, 1), whole, **tol)
    assert_close("y", whole, aft_decay_reference(q, k, v, lam, u), **tol)
    for name in ("a", "b", "p"):
        assert_close(name, getattr(state, name), getattr(s_whole, name), **tol)
    if DEVICE == "cpu" and kernels.load():
        with kernels.use_kernels(True), torch.no_grad():
            _, s_cpp = aft_decay(q, k, v, lam, u, return_state=True)
        for name in ("a", "b", "p"):
            assert_close(name, getattr(s_whole, name), getattr(s_cpp, name), **tol)


def test_forward_without_gradient_saves_nothing():
    q, k, v, lam, u = _inputs()
    with kernels.use_kernels("triton"), torch.no_grad():
        y, r = torch.ops.aftlab.triton_simple_causal(q, k, v, None, False)
        assert r.numel() == 0 and torch.equal(y, aft_simple(q, k, v, causal=True))
        y, r, w = torch.ops.aftlab.triton_decay(q, k, v, lam, u, None, False)
        assert r.numel() == 0 and w.numel() == 0


def test_low_precision_inputs_are_refused_by_the_raw_op():
    q = torch.randn(1, 3, 2, device=DEVICE).half()
    with pytest.raises(TypeError, match="float32 or float64"):
        torch.ops.aftlab.triton_simple_causal(q, q, q, None, False)


@pytest.mark.slow
def test_compile_fullgraph_equals_eager():
    q, k, v, lam, u = (t.requires_grad_() for t in _inputs(B=1, T=9, d=3))
    g = torch.randn(1, 9, 3, dtype=F64, device=DEVICE)
    cases = {
        "simple causal": (lambda q, k, v, lam, u: aft_simple(q, k, v, causal=True), 3),
        "decay": (lambda q, k, v, lam, u: aft_decay(q, k, v, lam, u), 5),
    }
    with kernels.use_kernels("triton"):
        for name, (fn, n) in cases.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            ins = (q, k, v, lam, u)
            y, yc = fn(*ins), compiled(*ins)
            assert torch.equal(y, yc), name
            grads = torch.autograd.grad((y * g).sum(), ins[:n])
            grads_c = torch.autograd.grad((yc * g).sum(), ins[:n])
            for a, b in zip(grads, grads_c, strict=True):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("op", ["aft_local", "aft_conv", "aft_simple"])
def test_band_and_scan_states_carry_values_and_gradients(op):
    """Causal chunks carrying the state equal one pass on the Triton kernels, outputs and every
    gradient (through the states too): the state machinery around the kernels (the full
    matrix is in tests/ops/test_state.py, on the C++ and PyTorch paths)."""
    B, T, h, c = 2, 19, 2, 3
    x = [torch.randn(B, T, h * c, dtype=F64, device=DEVICE, requires_grad=True) for _ in range(3)]
    w_local = torch.randn(T, T, dtype=F64, device=DEVICE, requires_grad=True)
    w_conv = torch.randn(h, 4, dtype=F64, device=DEVICE, requires_grad=True)

    def run(q, k, v, **state):
        if op == "aft_local":
            return aft_local(q, k, v, w_local, 5, causal=True, **state)  # w: absolute positions
        if op == "aft_conv":
            split = [t.unflatten(-1, (h, c)) for t in (q, k, v)]
            out = aft_conv(*split, w_conv, causal=True, **state)
            return (out[0].flatten(-2), out[1]) if state.get("return_state") else out.flatten(-2)
        return aft_simple(q, k, v, causal=True, **state)

    params = [w_local] if op == "aft_local" else [w_conv] if op == "aft_conv" else []
    g = torch.randn(B, T, h * c, dtype=F64, device=DEVICE)
    with kernels.use_kernels("triton"):
        whole = run(*x)
        ys, state = [], None
        for lo, hi in ((0, 3), (3, 4), (4, 19)):
            y, state = run(*(t[:, lo:hi] for t in x), initial_state=state, return_state=True)
            ys.append(y)
        chunked = torch.cat(ys, 1)
        assert _has_node(chunked.grad_fn, "triton_"), "not the Triton kernels"
        grads = torch.autograd.grad((whole * g).sum(), x + params)
        grads_c = torch.autograd.grad((chunked * g).sum(), x + params)
    assert_close("y", chunked, whole)
    for i, (a, e) in enumerate(zip(grads_c, grads, strict=True)):
        assert_close(f"grad {i}", a, e)


def _full_exact(k, v, w, causal):
    """The exact-row mask ``(B, T, D)`` of ``aftlab::triton_full_core``."""
    return torch.ops.aftlab.triton_full_core(k, v, w, causal)[2]


@pytest.mark.parametrize("causal", [False, True])
def test_full_left_padding_stays_on_the_products(causal):
    """Padded keys (``-inf``) before the first real one neither make rows exact (the shift of a
    block without a key is 0) nor change the values: against the float64 reference."""
    from aftlab.kernels.triton.full import blocks
    from aftlab.ops import aft_full
    from aftlab.ops.aft_full import aft_full_reference

    B, T, d = 2, 90, 3
    bm = blocks(T, d, torch.device(DEVICE))[0]
    q, k, v = (torch.randn(B, T, d, dtype=F64, device=DEVICE) for _ in range(3))
    w = torch.randn(T, T, dtype=F64, device=DEVICE)
    pm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    pm[0, : bm + 5] = False  # a whole block of padding, and more
    kp = k.masked_fill(~pm[:, :, None], float("-inf"))
    assert not _full_exact(kp, v.masked_fill(~pm[:, :, None], 0.0), w, causal).any()
    with kernels.use_kernels("triton"):
        y = aft_full(q, k, v, w, causal=causal, padding_mask=pm)
    assert_close("y", y, aft_full_reference(q, k, v, w, causal=causal, padding_mask=pm))


def test_full_key_far_above_its_blocks_shift_makes_its_rows_exact():
    """Causal: a key more than ``MARGIN`` above its block's shift is left out of the products;
    the rows that see it (it and later, that channel) are exact, the rows before it are not, and
    every value and gradient matches the float64 reference."""
    from aftlab.kernels.triton.full import MARGIN, blocks
    from aftlab.ops import aft_full
    from aftlab.ops.aft_full import aft_full_reference

    B, T, d = 1, 90, 4
    bm = blocks(T, d, torch.device(DEVICE))[0]
    p = bm + 5  # inside the second block, after its start
    q, k, v = (torch.randn(B, T, d, dtype=F64, device=DEVICE) for _ in range(3))
    w = torch.randn(T, T, dtype=F64, device=DEVICE)
    k[0, p, 1] = k[0, : bm + 1, 1].max() + MARGIN + 10
    exact = _full_exact(k, v, w, True)
    assert exact[0, p:, 1].all() and not exact[0, :p, 1].any()
    assert not exact[..., [0, 2, 3]].any()
    xs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    rs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    with kernels.use_kernels("triton"):
        y = aft_full(*xs, causal=True)
    yr = aft_full_reference(*rs, causal=True)
    assert_close("y", y, yr)
    g = torch.randn_like(yr)
    grads, ref = torch.autograd.grad(y, xs, g), torch.autograd.grad(yr, rs, g)
    for name, a, e in zip("qkvw", grads, ref, strict=True):
        assert_close(f"d{name}", a, e)


def _band_dot_exact(k, v, w_band, s):
    """The exact-row mask ``(B, T, D)`` of ``aftlab::triton_band_dot`` for causal aft-local
    (no prefix before position ``s``: ``lp`` from the prefix average as the op builds it)."""
    from aftlab.ops.scan import stable_prefix_average

    B, T, D = k.shape
    L, A = stable_prefix_average(k, v)
    lp = torch.cat([L.new_full((B, s, D), float("-inf")), L[:, : T - s]], 1)
    ap = torch.cat([A.new_zeros(B, s, D), A[:, : T - s]], 1)
    return torch.ops.aftlab.triton_band_dot(k, v, w_band[:, None, :], lp, ap, None, None,
                                            s - 1, 0)[2]


def test_band_dot_key_far_above_its_blocks_shift_makes_only_its_blocks_rows_exact():
    """Causal aft-local: a key more than ``MARGIN`` above its query block's shift (the largest
    key the block's first query sees) makes the rows of its own block from it on exact; the next
    block's shift includes it, so its rows stay on the products. Values and gradients against
    the float64 reference."""
    from aftlab.kernels.triton.full import MARGIN, blocks
    from aftlab.ops.aft_local import aft_local_reference

    B, T, d, s = 1, 90, 4, 8
    bm = blocks(T, d, torch.device(DEVICE))[0]
    p = bm - 3  # late in the first block, within the next block's first band
    q, k, v = (torch.randn(B, T, d, dtype=F64, device=DEVICE) for _ in range(3))
    w = torch.randn(T, T, dtype=F64, device=DEVICE)
    k[0, p, 2] = MARGIN + 20
    t = torch.arange(T)[:, None]
    w_band = w[t, (t - s + 1 + torch.arange(s)).clamp(min=0)]  # aft_local's band rows
    exact = _band_dot_exact(k, v, w_band, s)
    assert exact[0, p:bm, 2].all() and not exact[0, :p, 2].any() and not exact[0, bm:].any()
    assert not exact[..., [0, 1, 3]].any()
    xs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    rs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    with kernels.use_kernels("triton"):
        y = aft_local(*xs, s, causal=True)
        assert _has_node(y.grad_fn, "triton_band_dot")
    yr = aft_local_reference(*rs, s, causal=True)
    assert_close("y", y, yr)
    g = torch.randn_like(yr)
    grads, ref = torch.autograd.grad(y, xs, g), torch.autograd.grad(yr, rs, g)
    for name, a, e in zip("qkvw", grads, ref, strict=True):
        assert_close(f"d{name}", a, e)


@pytest.mark.parametrize("causal", [False, True])
def test_band_dot_one_row_for_every_query(causal):
    """aft-conv with one head is the band with one bias row for all queries (``w (1, 1, s)``):
    the products, their ``dw`` summed over the queries' diagonals, against the reference."""
    from aftlab.ops.aft_conv import aft_conv_reference

    B, T, c, s = 2, 41, 5, 7
    q, v = (torch.randn(B, T, 1, c, dtype=F64, device=DEVICE) for _ in range(2))
    k = torch.randn(B, T, 1, 1, dtype=F64, device=DEVICE)
    w = torch.randn(1, s, dtype=F64, device=DEVICE)
    pm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    pm[1, :9] = False
    xs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    rs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    with kernels.use_kernels("triton"):
        y = aft_conv(*xs, causal=causal, padding_mask=pm)
        assert _has_node(y.grad_fn, "triton_band_dot")
    yr = aft_conv_reference(*rs, causal=causal, padding_mask=pm)
    assert_close("y", y, yr)
    g = torch.randn_like(yr)
    grads, ref = torch.autograd.grad(y, xs, g), torch.autograd.grad(yr, rs, g)
    for name, a, e in zip("qkvw", grads, ref, strict=True):
        assert_close(f"d{name}", a, e)
