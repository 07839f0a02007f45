"""State across calls of the band ops (``aft_local``, ``aft_local_band``, ``aft_conv``; causal).

One table of cases (``CASES``) and one set of tests, as tests/ops/test_state.py for the scan ops:
a sequence run in chunks with the :class:`BandState` passed along gives the one-pass outputs,
final state and gradients; the float64 references take the same ``initial_state``; the state is
differentiable, ``.detach()`` cuts it; packed documents (``cu_seqlens``) equal separate calls;
bad states and offsets are refused by name. Both implementations (``impl``: kernel, PyTorch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from aftlab.ops.aft_conv import aft_conv, aft_conv_reference
from aftlab.ops.aft_local import aft_local, aft_local_band, aft_local_reference
from aftlab.ops.state import BandState, RunningSums
from aftlab.testing import assert_close

pytestmark = pytest.mark.usefixtures("impl", "one_thread")  # kernel and PyTorch (conftest.py)

F64 = torch.float64
S = 4  # aft-local's window and aft-conv's kernel size: a ring of 3 slots
H, C = 2, 3  # aft-conv's heads and channels per head


def _full_of_band(w_band: torch.Tensor, start: int) -> torch.Tensor:
    """The ``(start + T, start + T)`` bias whose causal band rows ``start ..`` are ``w_band``
    (``w[start + t, start + t + j - (S - 1)] = w_band[t, j]``; 0 elsewhere), differentiable."""
    T, n = w_band.shape[0], start + w_band.shape[0]
    t = torch.arange(T)[:, None].expand(T, S)
    cols = start + t + torch.arange(S)[None] - (S - 1)
    keep = cols >= 0
    rows = (start + t)[keep]
    return w_band.new_zeros(n, n).index_put((rows, cols[keep]), w_band[keep])


@dataclass(frozen=True)
class Case:
    """One op: its inputs ``[q, k, v, param]`` and how a chunk or a document reads ``param``.

    ``param(rows, dtype, g)``: the op's bias, covering ``rows`` absolute positions;
    ``piece(param, row0, n)``: what a call on positions ``row0 .. row0 + n - 1`` (absolute, or
    in-document with ``cu_seqlens``) is given; ``reference(q, k, v, p, padding_mask,
    initial_state, row0)``: the float64 reference of such a call.
    """

    name: str
    qkv: Callable[[int, int, torch.dtype, float, torch.Generator], list[torch.Tensor]]
    param: Callable[[int, torch.dtype, torch.Generator], torch.Tensor]
    op: Callable[..., object]
    reference: Callable[..., torch.Tensor]
    piece: Callable[[torch.Tensor, int, int], torch.Tensor]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]

    def inputs(self, B, T, *, dtype=F64, scale=1.0, seed=0, rows=None):
        g = torch.Generator().manual_seed(seed)
        q, k, v = self.qkv(B, T, dtype, scale, g)
        return [q, k, v, self.param(T if rows is None else rows, dtype, g)]

    def empty(self, B, dtype=F64) -> BandState:
        return BandState.empty(B, S, self.value_shape, key_shape=self.key_shape,
                               device="cpu", dtype=dtype)


def _randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=F64) * scale).to(dtype)


def _seq(d_k, d_v):
    def qkv(B, T, dtype, scale, g):
        return [_randn((B, T, *d_v), dtype, g), _randn((B, T, *d_k), dtype, g, scale),
                _randn((B, T, *d_v), dtype, g)]
    return qkv


D = 5
CASES = [
    Case(
        "aft_local",
        _seq((D,), (D,)),
        lambda rows, dtype, g: _randn((rows + 1, rows + 1), dtype, g),
        lambda q, k, v, w, causal=True, **kw: aft_local(q, k, v, w, S, causal=causal, **kw),
        lambda q, k, v, w, mask, st, row0: aft_local_reference(
            q, k, v, w, S, causal=True, padding_mask=mask, initial_state=st),
        lambda w, row0, n: w,
        (D,), (D,),
    ),
    Case(
        "aft_local_band",
        _seq((D,), (D,)),
        lambda rows, dtype, g: _randn((rows, S), dtype, g),
        lambda q, k, v, wb, causal=True, **kw: aft_local_band(
            q, k, v, wb, S, causal=causal, **kw),
        lambda q, k, v, wb, mask, st, row0: aft_local_reference(
            q, k, v, _full_of_band(wb, row0), S, causal=True, padding_mask=mask,
            initial_state=st),
        lambda wb, row0, n: wb[row0 : row0 + n],
        (D,), (D,),
    ),
    Case(
        "aft_conv",
        _seq((H, 1), (H, C)),
        lambda rows, dtype, g: _randn((H, S), dtype, g),
        lambda q, k, v, w, causal=True, **kw: aft_conv(q, k, v, w, causal=causal, **kw),
        lambda q, k, v, w, mask, st, row0: aft_conv_reference(
            q, k, v, w, causal=True, padding_mask=mask, initial_state=st),
        lambda w, row0, n: w,
        (H, 1), (H, C),
    ),
]
IDS = [c.name for c in CASES]
by_case = pytest.mark.parametrize("case", CASES, ids=IDS)

T = 17
#: chunk lengths: chunks of one position, uneven ones (an empty one too), all shorter than S
SPLITS = {
    "ones": [1] * T,
    "uneven": [5, 1, 0, 7, 2, 2],
    "short": [2, 3, 1, 2, 3, 2, 1, 3],
}


def _bounds(split):
    out, a = [], 0
    for n in split:
        out.append((a, a + n))
        a += n
    assert a == T
    return out


def _mask(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, T, generator=g) > 0.3
    m[0, :6] = False  # a row starting with padding: gone stays empty for a while
    m[-1, 8:11] = False  # a padded stretch longer than the ring
    return m


def _chunked(case, xs, bounds, *, mask=None, state=None, keep=()):
    """Run ``bounds`` in order with the state passed along; ``keep`` collects the states."""
    q, k, v, p = xs
    ys = []
    for a, b in bounds:
        m = None if mask is None else mask[:, a:b]
        y, state = case.op(q[:, a:b], k[:, a:b], v[:, a:b], case.piece(p, a, b - a),
                           padding_mask=m, initial_state=state, return_state=True)
        ys.append(y)
        if isinstance(keep, list):
            keep.append(state)
    return torch.cat(ys, 1), state


def _summary(st: BandState) -> dict[str, torch.Tensor]:
    """What a state means, whatever its shift: the ring and ``gone`` as a log-sum and average
    (``L = -inf`` where nothing is gone, with no ``log 0`` in the graph)."""
    g, seen = st.gone, st.gone.b > 0
    L = torch.where(seen, g.p + torch.log(torch.where(seen, g.b, 1.0)), float("-inf"))
    return {"k": st.k, "v": st.v, "gone.L": L, "gone.A": g.average()}


def _assert_states_close(a: BandState, e: BandState, tol: float | None = None) -> None:
    assert a.position == e.position
    assert torch.equal(a.valid, e.valid)
    for name, x in _summary(a).items():
        assert_close(f"state.{name}", x, _summary(e)[name], atol=tol, rtol=tol)


def _tol(dtype):
    return 1e-12 if dtype == F64 else 1e-5


# ----------------------------------------------------------------------- chunked == one pass
@by_case
@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "padded"])
def test_chunked_equals_one_pass(case, split, dtype, masked):
    """Outputs and final state, keys x30 (float32 1e-5, float64 1e-12)."""
    xs = case.inputs(3, T, dtype=dtype, scale=30.0)
    mask = _mask(3, T) if masked else None
    y1, s1 = case.op(*xs, padding_mask=mask, return_state=True)
    yc, sc = _chunked(case, xs, _bounds(SPLITS[split]), mask=mask)
    tol = _tol(dtype)
    assert_close("y", yc, y1, atol=tol, rtol=tol)
    assert_close("one pass vs plain call", y1, case.op(*xs, padding_mask=mask), atol=tol, rtol=tol)
    _assert_states_close(sc, s1, tol)
    assert s1.position == T and s1.k.dtype == dtype
    assert s1.k.shape[1] == S - 1 and torch.equal(s1.k, xs[1][:, T - S + 1 :].to(s1.k.dtype))
    if masked:
        assert torch.equal(s1.valid, mask[:, T - S + 1 :])


@by_case
def test_state_of_half_precision_is_float32(case):
    xs = case.inputs(2, T, dtype=torch.bfloat16, scale=3.0)
    y1, s1 = case.op(*xs, return_state=True)
    yc, sc = _chunked(case, xs, _bounds(SPLITS["uneven"]))
    assert yc.dtype == torch.bfloat16 and s1.gone.a.dtype == torch.float32
    assert_close("y", yc, y1)
    _assert_states_close(sc, s1, 1e-5)


@by_case
def test_empty_chunk_keeps_the_state(case):
    xs = case.inputs(2, 6)
    _, st = case.op(*xs, return_state=True)
    e = [x[:, :0] if x.dim() > 2 else x for x in xs]
    if case.name == "aft_local_band":
        e[3] = xs[3][:0]
    y, st2 = case.op(*e, initial_state=st, return_state=True)
    assert y.shape[1] == 0
    _assert_states_close(st2, st, 0.0)


# ----------------------------------------------------------------------- float64 reference
def _random_state(case, B, position, seed=3, *, empty_row=True) -> BandState:
    """A state no op produced: random ring (a slot invalid), random sums, the last row with
    nothing gone (``empty_row``)."""
    g = torch.Generator().manual_seed(seed)
    r = S - 1
    st = case.empty(B)
    st.k = _randn((B, r, *case.key_shape), F64, g, 3.0)
    st.v = _randn((B, r, *case.value_shape), F64, g)
    st.valid = torch.ones(B, r, dtype=torch.bool)
    st.valid[0, 1] = False
    st.gone.p = _randn((B, *case.key_shape), F64, g, 3.0)
    st.gone.b = 0.5 + torch.rand((B, *case.key_shape), generator=g, dtype=F64)
    st.gone.a = _randn((B, *case.value_shape), F64, g) * st.gone.b
    if empty_row:
        st.gone.p[-1], st.gone.b[-1], st.gone.a[-1] = float("-inf"), 0.0, 0.0
    st.position = position
    return st


def _cast(st: BandState, dtype: torch.dtype) -> BandState:
    gone = RunningSums(*(x.to(dtype) for x in (st.gone.a, st.gone.b, st.gone.p)))
    return BandState(gone, st.k.to(dtype), st.v.to(dtype), st.valid, st.position)


def _leaves(st: BandState) -> list[torch.Tensor]:
    """Make the state's float tensors leaves that require grad (the ones gradients reach)."""
    for obj, name in ((st, "k"), (st, "v"), (st.gone, "a"), (st.gone, "b")):
        setattr(obj, name, getattr(obj, name).detach().clone().requires_grad_())
    return [st.k, st.v, st.gone.a, st.gone.b]


@by_case
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("Tc", [2, 9], ids=["shorter_than_window", "longer"])
def test_matches_reference_with_initial_state(case, dtype, Tc):
    """A random state at position 6, forward and backward (inputs and the state's tensors)."""
    B, P = 3, 6
    full = case.inputs(B, P + Tc, rows=P + Tc)
    xs = [x[:, P:] if x.dim() > 2 else x for x in full[:3]] + [case.piece(full[3], P, Tc)]
    xs = [x.detach().to(dtype).requires_grad_() for x in xs]
    mask = _mask(B, Tc)
    st_c = _cast(_random_state(case, B, P), dtype)
    st = _cast(st_c, F64)  # the reference's: the same (rounded) values
    leaves, leaves_r = _leaves(st_c), _leaves(st)
    y = case.op(*xs, padding_mask=mask, initial_state=st_c)
    rs = [x.detach().double().requires_grad_() for x in xs]
    yr = case.reference(*rs, mask, st, P)
    assert y.dtype == dtype
    assert_close("y", y, yr)
    g = torch.randn(yr.shape, dtype=F64)
    ga = torch.autograd.grad(y, xs + leaves, g.to(dtype))
    ge = torch.autograd.grad(yr, rs + leaves_r, g)
    for name, a, e in zip("q k v w ring.k ring.v gone.a gone.b".split(), ga, ge, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert_close(f"d{name}", a, e)


@by_case
def test_matches_reference_after_a_chunk(case):
    """The reference continuing the op's own state equals the one-pass reference."""
    xs = case.inputs(2, T, scale=3.0)
    q, k, v, p = xs
    mask = _mask(2, T)
    _, st = case.op(q[:, :7], k[:, :7], v[:, :7], case.piece(p, 0, 7), padding_mask=mask[:, :7],
                    return_state=True)
    y = case.op(q[:, 7:], k[:, 7:], v[:, 7:], case.piece(p, 7, T - 7), padding_mask=mask[:, 7:],
                initial_state=st)
    yr = case.reference(q[:, 7:], k[:, 7:], v[:, 7:], case.piece(p, 7, T - 7), mask[:, 7:],
                        st, 7)
    y_all = case.reference(*xs, mask, None, 0)
    assert_close("y vs reference", y, yr)
    assert_close("reference with state vs one pass", yr, y_all[:, 7:], atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------- gradients
def _loss_terms(st: BandState, gs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss on the state's meaning (:func:`_summary`), its finite entries, weighted by ``gs``."""
    terms = _summary(st).items()
    return sum((torch.where(torch.isfinite(x), x, 0.0) * gs[n].detach()).sum() for n, x in terms)


@by_case
@pytest.mark.parametrize("split", ["ones", "uneven", "short"])
def test_gradients_through_the_chain_equal_one_pass(case, split):
    """A loss on every chunk's output and on the final state: gradients for q, k, v, w."""
    xs = [x.requires_grad_() for x in case.inputs(2, T, scale=3.0)]
    mask = _mask(2, T)
    y1, s1 = case.op(*xs, padding_mask=mask, return_state=True)
    g = torch.randn(y1.shape, dtype=F64)
    gs = {n: torch.randn(x.shape, dtype=F64) for n, x in _summary(s1).items()}
    g1 = torch.autograd.grad((y1 * g).sum() + _loss_terms(s1, gs), xs)
    yc, sc = _chunked(case, xs, _bounds(SPLITS[split]), mask=mask)
    gc = torch.autograd.grad((yc * g).sum() + _loss_terms(sc, gs), xs)
    for name, a, e in zip("qkvw", gc, g1, strict=True):
        assert e.abs().max() > 0
        assert_close(f"d{name}", a, e, atol=1e-12, rtol=1e-12)


@by_case
def test_gradcheck_through_initial_state(case):
    B, Tc = 2, 5
    xs = [x.requires_grad_() for x in case.inputs(B, Tc, rows=Tc + 4)]
    xs[3] = case.piece(xs[3].detach(), 4, Tc).clone().requires_grad_()
    st0 = _random_state(case, B, 4, empty_row=False)
    fields = [x.clone().requires_grad_() for x in (st0.k, st0.v, st0.gone.a, st0.gone.b)]
    mask = torch.tensor([[True, False, True, True, True], [True] * 5])

    def fn(q, k, v, p, rk, rv, ga, gb):
        st = BandState(RunningSums(ga, gb, st0.gone.p), rk, rv, st0.valid, 4)
        y, s = case.op(q, k, v, p, padding_mask=mask, initial_state=st, return_state=True)
        return y, s.gone.log_sum(), s.gone.average(), s.k

    assert torch.autograd.gradcheck(fn, xs + fields)


@by_case
def test_detach_stops_the_gradient(case):
    q, k, v, p = case.inputs(2, T)
    q.requires_grad_()  # the second chunk's output has a graph either way
    k1, v1 = k[:, :8].clone().requires_grad_(), v[:, :8].clone().requires_grad_()

    def grads(detach):
        _, st = case.op(q[:, :8], k1, v1, case.piece(p, 0, 8), return_state=True)
        st = st.detach() if detach else st
        y = case.op(q[:, 8:], k[:, 8:], v[:, 8:], case.piece(p, 8, T - 8), initial_state=st)
        return torch.autograd.grad(y.sum(), [k1, v1], allow_unused=True)

    assert all(gr is not None and gr.abs().max() > 0 for gr in grads(False))
    assert all(gr is None for gr in grads(True))


# ----------------------------------------------------------------------- packed documents
OFFSETS = [0, 3, 3, 10, 11, 17]  # an empty document, one of one position


@by_case
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "continued"])
def test_cu_seqlens_equals_separate_calls(case, with_state):
    """Outputs, the last document's state, and gradients (inputs and the initial state)."""
    P = 5 if with_state else 0
    docs = list(zip(OFFSETS, OFFSETS[1:], strict=False))
    rows = max(b - a + (P if i == 0 else 0) for i, (a, b) in enumerate(docs))
    xs = [x.requires_grad_() for x in case.inputs(1, T, scale=3.0, rows=rows)]
    q, k, v, p = xs
    mask = _mask(1, T)
    st = leaves = None
    if with_state:
        pre = case.inputs(1, P, seed=7, rows=P)
        _, st = case.op(*pre, return_state=True)
        leaves = _leaves(st)
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    y, s_last = case.op(*xs, padding_mask=mask, initial_state=st, return_state=True,
                        cu_seqlens=cu)
    ys, state = [], None
    for i, (a, b) in enumerate(docs):
        r0 = P if i == 0 else 0
        yi, state = case.op(q[:, a:b], k[:, a:b], v[:, a:b], case.piece(p, r0, b - a),
                            padding_mask=mask[:, a:b], initial_state=st if i == 0 else None,
                            return_state=True)
        ys.append(yi)
    assert_close("y", y, torch.cat(ys, 1), atol=1e-12, rtol=1e-12)
    _assert_states_close(s_last, state, 1e-12)
    assert s_last.position == OFFSETS[-1] - OFFSETS[-2]
    g = torch.randn(y.shape, dtype=F64)
    wrt = xs + (leaves or [])
    gs = {n: torch.randn(x.shape, dtype=F64) for n, x in _summary(state).items()}
    ga = torch.autograd.grad((y * g).sum() + _loss_terms(s_last, gs), wrt, allow_unused=True)
    ye = torch.cat(ys, 1)
    ge = torch.autograd.grad((ye * g).sum() + _loss_terms(state, gs), wrt, allow_unused=True)
    for i, (a, e) in enumerate(zip(ga, ge, strict=True)):
        assert a is not None and e is not None and e.abs().max() > 0
        assert_close(f"grad {i}", a, e, atol=1e-12, rtol=1e-12)


@by_case
def test_cu_seqlens_documents_do_not_see_each_other(case):
    """A change in the first document leaves every later document's output unchanged."""
    xs = case.inputs(1, T, rows=T)
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    y = case.op(*xs, cu_seqlens=cu)
    xs[2] = xs[2].clone()
    xs[2][:, :3] += 10.0
    y2 = case.op(*xs, cu_seqlens=cu)
    assert torch.equal(y[:, 3:], y2[:, 3:])
    assert (y[:, :3] - y2[:, :3]).abs().max() > 1e-3


# ----------------------------------------------------------------------- torch.compile
@by_case
def test_compile_fullgraph_with_a_state_input(case):
    xs = case.inputs(2, 9, rows=9 + 6)
    xs[3] = case.piece(xs[3], 6, 9)
    _, st = case.op(*case.inputs(2, 6, seed=5, rows=6), return_state=True)

    def fn(q, k, v, p, state):
        return case.op(q, k, v, p, initial_state=state, return_state=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y, s = compiled(*xs, st)
    y_e, s_e = fn(*xs, st)
    assert_close("y", y, y_e, atol=1e-12, rtol=1e-12)
    _assert_states_close(s, s_e, 1e-12)


# ----------------------------------------------------------------------- bad input
def _other(case, **change) -> BandState:
    """An empty state of another batch (B), ring (window), width or head count."""
    B = change.get("B", 2)
    window = change.get("window", S)
    F, Fk = case.value_shape, case.key_shape
    if "width" in change:
        F = (F[0] + 1, *F[1:])
        Fk = (Fk[0] + 1, *Fk[1:])
    return BandState.empty(B, window, F, key_shape=Fk, device="cpu", dtype=change.get("dtype", F64))


@by_case
def test_bad_state_is_refused_by_name(case):
    xs = case.inputs(2, 5)
    cases = [
        (RunningSums.empty(2, 5, device="cpu", dtype=F64), TypeError, "must be a BandState"),
        (_other(case, window=S + 1), ValueError, r"'initial_state.k' must have shape"),
        (_other(case, B=3), ValueError, r"'initial_state.k' must have shape"),
        (_other(case, width=True), ValueError, r"'initial_state.k' must have shape"),
        (_other(case, dtype=torch.float32), TypeError, r"'initial_state.k' must have dtype"),
    ]
    for state, err, match in cases:
        with pytest.raises(err, match=match):
            case.op(*xs, initial_state=state)
    st = case.empty(2)
    st.position = -1
    with pytest.raises(ValueError, match="'initial_state.position' must be >= 0"):
        case.op(*xs, initial_state=st)


@by_case
def test_state_keywords_need_causal(case):
    xs = case.inputs(2, 5)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for kw in ({"initial_state": case.empty(2)}, {"return_state": True}, {"cu_seqlens": cu}):
        with pytest.raises(ValueError, match=f"'{next(iter(kw))}' need causal=True"):
            case.op(*xs, causal=False, **kw)
    with pytest.raises(TypeError, match="'return_state' must be a bool"):
        case.op(*xs, return_state=1)


@by_case
def test_bad_cu_seqlens_are_refused(case):
    xs = case.inputs(1, 5)
    bad = [
        (torch.tensor([0, 5]), TypeError, "int32"),
        (torch.tensor([[0, 5]], dtype=torch.int32), ValueError, "dimensions"),
        (torch.tensor([1, 5], dtype=torch.int32), ValueError, "from 0 to the sequence length"),
        (torch.tensor([0, 4], dtype=torch.int32), ValueError, "from 0 to the sequence length"),
        (torch.tensor([0, 3, 2, 5], dtype=torch.int32), ValueError, "non-decreasing"),
    ]
    for cu, err, match in bad:
        with pytest.raises(err, match=match):
            case.op(*xs, cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch of one row"):
        case.op(*case.inputs(2, 5), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


def test_aft_local_w_must_cover_position_plus_T():
    q, k, v, w = CASES[0].inputs(2, 5)  # w (6, 6)
    st = CASES[0].empty(2)
    st.position = 2
    with pytest.raises(ValueError, match=r"T' >= position \+ T = 2 \+ 5 = 7"):
        aft_local(q, k, v, w, S, causal=True, initial_state=st)
    aft_local(q, k, v, w, S, causal=True, initial_state=dataclasses.replace(st, position=1))


def test_aft_local_band_is_window_wide_with_a_state():
    q, k, v, wb = CASES[1].inputs(2, 3)  # T = 3 < S: a plain call's band is 3 wide, a state's S
    assert wb.shape == (3, S)
    with pytest.raises(ValueError, match=r"'w_band' must have shape \(T = 3, window = 4\)"):
        aft_local_band(q, k, v, wb[:, 1:], S, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"'w_band' must have shape \(3, 3\)"):
        aft_local_band(q, k, v, wb, S, causal=True)  # no state keyword: min(window, T) wide
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row per in-document position, 2 rows"):
        aft_local_band(q[:1], k[:1], v[:1], wb[:2], S, causal=True, cu_seqlens=cu)


@pytest.mark.parametrize("window", [0, 1, 2, 30], ids=["simple", "diagonal", "2", "wider_than_T"])
def test_aft_local_chunked_at_edge_windows(window):
    """Window 0 (AFT-simple: all of the past in ``gone``), 1 (no ring), and wider than ``T``."""
    q, k, v, w = CASES[0].inputs(2, T, scale=3.0)
    mask = _mask(2, T)
    y1, s1 = aft_local(q, k, v, w, window, causal=True, padding_mask=mask, return_state=True)
    ys, st = [], None
    for a, b in _bounds(SPLITS["uneven"]):
        y, st = aft_local(q[:, a:b], k[:, a:b], v[:, a:b], w, window, causal=True,
                          padding_mask=mask[:, a:b], initial_state=st, return_state=True)
        ys.append(y)
    assert_close("y", torch.cat(ys, 1), y1, atol=1e-12, rtol=1e-12)
    _assert_states_close(st, s1, 1e-12)
    assert st.k.shape[1] == max(window - 1, 0)


@pytest.mark.parametrize("s", [1, 2, 30])
def test_aft_conv_chunked_at_edge_kernel_sizes(s):
    q, k, v, _ = CASES[2].inputs(2, T, scale=3.0)
    w = torch.randn(H, s, dtype=F64)
    y1, s1 = aft_conv(q, k, v, w, causal=True, return_state=True)
    ys, st = [], None
    for a, b in _bounds(SPLITS["uneven"]):
        y, st = aft_conv(q[:, a:b], k[:, a:b], v[:, a:b], w, causal=True, initial_state=st,
                         return_state=True)
        ys.append(y)
    assert_close("y", torch.cat(ys, 1), y1, atol=1e-12, rtol=1e-12)
    _assert_states_close(st, s1, 1e-12)
