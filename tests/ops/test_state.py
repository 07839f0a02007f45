"""State across calls of every causal op: one suite over the table ``CASES``.

``CASES`` holds the five causal ops with a state: ``aft_simple`` (causal) and ``aft_decay``
(:class:`RunningSums`), ``aft_local``, ``aft_local_band`` and ``aft_conv`` (causal;
:class:`BandState`). Every generic test runs on each, on both implementations (the ``impl``
fixture of conftest.py: C++ kernel and PyTorch). A :class:`Case` makes an op's inputs, cuts its
parameters to the positions of a call, calls the op with the state keywords and the float64
references (of the output and of the state) with an initial state, and draws a random valid
state. The properties, in the order of the tests:

* a chunked run (single positions, uneven chunks, empty ones, chunks shorter than the window,
  padding inside them) equals one pass, outputs and final state, and the float64 references;
  so does one continuing a given state;
* gradients through the chain of states equal the one-pass ones (and the reference's, into a
  given state); gradcheck through ``initial_state``; ``detach`` stops the gradient;
* packed documents (``cu_seqlens``) equal separate calls, with ``initial_state`` and
  ``return_state``; ``torch.compile(fullgraph=True)`` takes and returns a state;
* bad states, offsets and state keywords on a non-causal call are refused by name.

The op-specific tests (no generic form) follow the generic ones.

States are compared by their meaning, not field by field: one state has many ``(p, a, b)``
(``p`` is only a shift), so a RunningSums is its log-sum ``L = p + log b`` and average
``A = a / b``; a BandState is its ring as stored (keys, values, validity) and its ``gone``'s
``L`` and ``A``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
import torch

from aftlab._state import map_state
from aftlab.ops import aft_decay, aft_simple
from aftlab.ops.aft_conv import aft_conv, aft_conv_reference
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.ops.aft_local import aft_local, aft_local_band, aft_local_reference
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.ops.reference import running_sums_reference
from aftlab.ops.state import BandState, RunningSums
from aftlab.testing import assert_close

pytestmark = pytest.mark.usefixtures("impl", "one_thread")  # both implementations (conftest)

F64, F32 = torch.float64, torch.float32
NEG_INF = float("-inf")
S = 4  # aft-local's window and aft-conv's kernel size: a ring of S - 1 = 3 slots
D = 4  # channels of aft-simple, aft-decay and aft-local
H, C = 2, 3  # aft-conv's heads and channels per head (one key channel per head)


# ----------------------------------------------------------------------------- the cases
def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=F64)


def _cast(x, dtype: torch.dtype):
    """``x`` (a dict of tensors, or a state) with its float tensors in ``dtype``."""
    if isinstance(x, dict):
        return {n: _cast(t, dtype) for n, t in x.items()}
    return map_state(lambda t: t.to(dtype) if t.is_floating_point() else t, x)


def _start(state) -> int:
    """The position a call continuing ``state`` starts at (0 for no state)."""
    return 0 if state is None else state.position


def _length(seq: dict) -> int:
    return seq["q"].shape[1]


@dataclasses.dataclass(frozen=True)
class Case:
    """A causal op of the suite and its float64 reference.

    Attributes:
        op: ``op(**seq, **params, **kw)`` with ``seq = {q, k, v}``, ``kw`` among
            ``padding_mask``, ``initial_state``, ``return_state``, ``cu_seqlens`` (and
            ``causal=False`` where ``noncausal``).
        params: ``(rows, gen) -> params``, float64: the op's tensors other than ``q, k, v``; a
            bias indexed by position covers ``rows`` positions.
        reference_y: ``(seq, params, padding_mask, initial_state) -> Y``, float64 from the
            formula, ``params`` cut to the call's positions.
        value_shape, key_shape: ``F`` and ``Fk``: ``q, v (B, T, *F)``, ``k (B, T, *Fk)``.
        window: the window of a BandState (its ring holds ``window - 1`` keys); None for a
            RunningSums.
        rows: ``(params, start, n) -> params`` of a call on positions ``start .. start + n - 1``
            (counted from the document's start); None: every call gets the same params.
        noncausal: the op has a non-causal form (which refuses the state keywords).
    """

    op: Callable
    params: Callable[[int, torch.Generator], dict]
    reference_y: Callable
    value_shape: tuple[int, ...] = (D,)
    key_shape: tuple[int, ...] = (D,)
    window: int | None = None
    rows: Callable | None = None
    noncausal: bool = True

    @property
    def state_type(self) -> type:
        return RunningSums if self.window is None else BandState

    def make(self, B, T, dtype=F64, kscale=1.0, *, rows=None, seed=0):
        """``(seq, params)`` drawn in float64, cast to ``dtype``: ``seq`` the tensors along the
        sequence (dim 1), keys scaled by ``kscale``; ``params`` covering ``rows`` positions
        (default ``T``)."""
        g = torch.Generator().manual_seed(seed)
        F, Fk = self.value_shape, self.key_shape
        seq = {"q": _randn(g, B, T, *F), "k": kscale * _randn(g, B, T, *Fk),
               "v": _randn(g, B, T, *F)}
        return _cast(seq, dtype), _cast(self.params(T if rows is None else rows, g), dtype)

    def at(self, params: dict, start: int, n: int) -> dict:
        """The params of a call on positions ``start .. start + n - 1``."""
        return params if self.rows is None else self.rows(params, start, n)

    def run(self, seq, params, **kw):
        """The op on ``seq``, ``params`` cut to its positions (``initial_state.position`` on);
        with ``cu_seqlens`` they go whole: the op takes each document's rows itself."""
        if kw.get("cu_seqlens") is None:
            params = self.at(params, _start(kw.get("initial_state")), _length(seq))
        return self.op(**seq, **params, **kw)

    def reference(self, seq, params, padding_mask=None, initial_state=None):
        """Float64 ``(Y, state)`` of :meth:`run`'s call, from the formulas."""
        params = self.at(params, _start(initial_state), _length(seq))
        y = self.reference_y(seq, params, padding_mask, initial_state)
        if self.window is None:
            s = running_sums_reference(seq["k"], seq["v"], decay=params.get("decay"),
                                       padding_mask=padding_mask, initial_state=initial_state)
        else:
            s = self._band_state_reference(seq, padding_mask, initial_state)
        return y, s

    def _band_state_reference(self, seq, padding_mask, initial_state) -> BandState:
        """The band state after ``seq``, from its definition: of the ring and the chunk (oldest
        first) the last ``window - 1`` keys and values stay in the ring, with their validity;
        the others join ``gone``, the running sums (no decay) of the keys that left the window
        (:func:`running_sums_reference`, flattened to one channel per value channel)."""
        k, v = seq["k"].double(), seq["v"].double()
        (B, T), F = k.shape[:2], self.value_shape
        st = self.empty_state(B) if initial_state is None else initial_state
        ks, vs = torch.cat([st.k.double(), k], 1), torch.cat([st.v.double(), v], 1)
        mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
        valid = torch.cat([st.valid, mask], 1)
        g = st.gone
        gone0 = RunningSums(a=g.a.double().flatten(1), b=g.b.double().expand(B, *F).flatten(1),
                            p=g.p.double().expand(B, *F).flatten(1))
        gone = running_sums_reference(ks[:, :T].expand(B, T, *F).flatten(2),
                                      vs[:, :T].flatten(2), padding_mask=valid[:, :T],
                                      initial_state=gone0)
        keys = (slice(None), *(slice(0, n) for n in self.key_shape))  # a head's key channel
        L, A = gone.log_sum().view(B, *F)[keys], gone.average().view(B, *F)
        gone = RunningSums(a=A, b=(L > NEG_INF).double(), p=L)
        return BandState(gone=gone, k=ks[:, T:], v=vs[:, T:], valid=valid[:, T:],
                         position=st.position + T)

    def empty_state(self, B, dtype=F64, *, window=None, wider=False):
        """The empty state for ``B`` rows (of another ``window``, or one channel ``wider``)."""
        F, Fk = self.value_shape, self.key_shape
        if wider:
            F, Fk = (F[0] + 1, *F[1:]), (Fk[0] + 1, *Fk[1:])
        if self.window is None:
            return RunningSums.empty(B, F, key_shape=Fk, device="cpu", dtype=dtype)
        return BandState.empty(B, self.window if window is None else window, F, key_shape=Fk,
                               device="cpu", dtype=dtype)

    def random_state(self, B, dtype=F64, *, position=7, empty_row=True, seed=3):
        """A valid state no op made: sums with ``p`` anywhere, ``b > 0`` (any ``b`` is a
        shift of ``b = 1``), ``A = a / b`` of the values' size; a BandState's ring random, a
        slot of row 0 without a key. With ``empty_row`` and ``B > 1`` the last row has no key
        in its sums (``p = -inf``, ``a = b = 0``)."""
        g = torch.Generator().manual_seed(seed)
        F, Fk = self.value_shape, self.key_shape
        b = 0.5 + 4 * torch.rand(B, *Fk, generator=g, dtype=F64)
        state = RunningSums(a=_randn(g, B, *F) * b, b=b, p=3 * _randn(g, B, *Fk),
                            position=position)
        if empty_row and B > 1:
            state.a[-1], state.b[-1], state.p[-1] = 0.0, 0.0, NEG_INF
        if self.window is not None:
            r = max(self.window - 1, 0)
            valid = torch.ones(B, r, dtype=torch.bool)
            valid[0, 1:2] = False
            state = BandState(gone=state, k=3 * _randn(g, B, r, *Fk), v=_randn(g, B, r, *F),
                              valid=valid, position=position)
        return _cast(state, dtype)


def _full_of_band(w_band: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """The ``(start + T, start + T)`` bias whose causal band rows ``start ..`` are ``w_band``
    (``w[start + t, start + t + j - (window - 1)] = w_band[t, j]``; 0 elsewhere),
    differentiable."""
    T, n = w_band.shape[0], start + w_band.shape[0]
    t = torch.arange(T)[:, None].expand(T, window)
    cols = start + t + torch.arange(window)[None] - (window - 1)
    keep = cols >= 0
    return w_band.new_zeros(n, n).index_put(((start + t)[keep], cols[keep]), w_band[keep])


def _aft_local_case(window: int) -> Case:
    return Case(
        op=partial(aft_local, window=window, causal=True),
        params=lambda rows, g: {"w": _randn(g, rows + 1, rows + 1)},  # T' > T is fine
        reference_y=lambda seq, p, mask, st: aft_local_reference(
            **seq, **p, window=window, causal=True, padding_mask=mask, initial_state=st),
        window=window,
    )


def _aft_conv_case(s: int) -> Case:
    return Case(
        op=partial(aft_conv, causal=True),
        params=lambda rows, g: {"w": _randn(g, H, s)},
        reference_y=lambda seq, p, mask, st: aft_conv_reference(
            **seq, **p, causal=True, padding_mask=mask, initial_state=st),
        value_shape=(H, C), key_shape=(H, 1), window=s,
    )


#: the causal ops with a state, by name
CASES: dict[str, Case] = {
    "aft_simple": Case(
        op=partial(aft_simple, causal=True),
        params=lambda rows, g: {},
        reference_y=lambda seq, p, mask, st: aft_simple_reference(
            **seq, causal=True, padding_mask=mask, initial_state=st),
    ),
    "aft_decay": Case(
        op=aft_decay,
        params=lambda rows, g: {"decay": 2 * torch.rand(D, generator=g, dtype=F64),
                                "bonus": _randn(g, D)},
        reference_y=lambda seq, p, mask, st: aft_decay_reference(
            **seq, **p, padding_mask=mask, initial_state=st),
        noncausal=False,
    ),
    "aft_local": _aft_local_case(S),
    "aft_local_band": Case(
        op=partial(aft_local_band, window=S, causal=True),
        params=lambda rows, g: {"w_band": _randn(g, rows, S)},  # one row per position
        reference_y=lambda seq, p, mask, st: aft_local_reference(
            **seq, w=_full_of_band(p["w_band"], _start(st), S), window=S, causal=True,
            padding_mask=mask, initial_state=st),
        window=S,
        rows=lambda p, start, n: {"w_band": p["w_band"][start:start + n]},
    ),
    "aft_conv": _aft_conv_case(S),
}
BAND = [n for n, c in CASES.items() if c.state_type is BandState]
SCAN = [n for n, c in CASES.items() if c.state_type is RunningSums]

N = 17  # the length of a chunked sequence
CHUNKINGS = {
    "whole": [N],
    "singles": [1] * N,
    "uneven": [5, 1, 0, 7, 2, 2],
    "empty first and last": [0, 5, 12, 0],
    "shorter than the window": [2, 3, 1, 2, 3, 2, 1, 3],
}
#: dtype and tolerance of a chunked run against one pass (keys x30: ~100 in the exponents)
PRECISIONS = {"float64": (F64, 1e-12), "float32": (F32, 1e-5)}
#: the chunks of a call continuing a state: the chunk shorter than the ring, and longer
WITH_STATE = {"shorter than the ring": [1, 0, 1], "longer": [4, 0, 1, 6]}


# ----------------------------------------------------------------------------- helpers
def _mask(B, T, seed=1):
    """Padding (True: a real token), about 70% real. With ``B >= 2``: row 0 starts with six
    padded positions (nothing gone for a while), the last row has a padded stretch 3 .. 10
    (longer than the ring: a chunk without a key); with ``B >= 3`` row 1 has no key at all."""
    m = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.3
    if B >= 2:
        m[0, :6] = False
        m[-1, 3:11] = False
    if B >= 3:
        m[1] = False
    return m


def _slice(seq: dict, a: int, b: int) -> dict:
    return {n: x[:, a:b] for n, x in seq.items()}


def _leaves(tensors: dict) -> dict:
    return {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}


def _split(seq, params, tensors: dict) -> tuple[dict, dict]:
    """``tensors`` (by name) as the ``(seq, params)`` of a call."""
    return {n: tensors[n] for n in seq}, {n: tensors[n] for n in params}


def _chunked(case, seq, params, chunks, *, padding_mask=None, state=None):
    """The op over ``chunks`` (lengths along T), the state passed along: ``(Y, state)``."""
    ys, a = [], 0
    for n in chunks:
        mask = None if padding_mask is None else padding_mask[:, a:a + n]
        y, state = case.run(_slice(seq, a, a + n), params, padding_mask=mask,
                            initial_state=state, return_state=True)
        ys.append(y)
        a += n
    assert a == _length(seq)
    return torch.cat(ys, 1), state


def _fields(state, prefix="initial_state") -> list[tuple[str, object, str]]:
    """``(dotted name, owner, field)`` of every tensor of ``state`` (nested states too)."""
    out = []
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, torch.Tensor):
            out.append((f"{prefix}.{f.name}", state, f.name))
        elif dataclasses.is_dataclass(value):
            out += _fields(value, f"{prefix}.{f.name}")
    return out


def _floats(state) -> dict[str, torch.Tensor]:
    """The floating-point tensors of ``state`` by dotted name."""
    found = {n: getattr(owner, f) for n, owner, f in _fields(state)}
    return {n: x for n, x in found.items() if x.is_floating_point()}


def _with_fields(state, values: dict[str, torch.Tensor]):
    """A copy of ``state`` with the tensors ``values`` (by dotted name) in place of its own."""
    state = map_state(lambda t: t, state)  # new dataclasses, the same tensors
    for name, owner, f in _fields(state):
        if name in values:
            setattr(owner, f, values[name])
    return state


def _as_leaves(state):
    """A copy of ``state`` whose float tensors are new leaves that require grad, and those."""
    if state is None:
        return None, {}
    leaves = _leaves(_floats(state))
    return _with_fields(state, leaves), leaves


def _meaning(state) -> dict[str, torch.Tensor]:
    """What two equal states agree on: a RunningSums' log-sum and average (``L = -inf``,
    ``A = 0`` when empty); a BandState's ring (as stored) and its ``gone``'s meaning."""
    if isinstance(state, RunningSums):
        return {"L": state.log_sum(), "A": state.average()}
    gone = _meaning(state.gone)
    return {"k": state.k, "v": state.v, "gone.L": gone["L"], "gone.A": gone["A"]}


def _assert_states(name, actual, expected, **tol):
    """``actual`` and ``expected`` mean the same: type, position, validity, :func:`_meaning`."""
    assert type(actual) is type(expected), f"{name}: {type(actual).__name__}"
    assert actual.position == expected.position, f"{name}: position {actual.position}"
    if isinstance(actual, BandState):
        assert torch.equal(actual.valid, expected.valid), f"{name}: valid"
    want = _meaning(expected)
    for field, value in _meaning(actual).items():
        assert_close(f"{name}.{field}", value, want[field], **tol)


def _row_is_empty(state, row: int) -> bool:
    """Whether row ``row`` of ``state`` holds no key: empty sums and (BandState) no valid slot."""
    sums = state if isinstance(state, RunningSums) else state.gone
    ring = isinstance(state, RunningSums) or not state.valid[row].any()
    return ring and bool((sums.log_sum()[row] == NEG_INF).all() and
                         (sums.average()[row] == 0).all())


def _weights(y, state, seed=1):
    """Random float64 weights of a loss on ``y`` and on the state's meaning."""
    g = torch.Generator().manual_seed(seed)
    return (_randn(g, *y.shape),
            {n: _randn(g, *x.shape) for n, x in _meaning(state).items()})


def _loss(y, state, weights):
    """``sum gy Y + sum_f gs_f meaning_f``, without the infinite entries (an empty ``L``)."""
    gy, gs = weights
    loss = (y * gy).sum()
    for field, x in _meaning(state).items():
        loss = loss + (torch.where(torch.isfinite(x), x, 0.0) * gs[field]).sum()
    return loss


def _assert_grads(names, actual, expected, **tol):
    for n, a, e in zip(names, actual, expected, strict=True):
        assert e.abs().max() > 0, f"d{n} is 0: {n} does not reach the loss"
        assert_close(f"d{n}", a, e, **tol)


# ============================================================================= generic tests
# ----------------------------------------------------------------------------- chunked
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_one_pass(name, chunking, precision, padded):
    """Outputs and final state == one pass == the float64 references, the state in the
    inputs' dtype; a row without a key keeps the empty state."""
    case, (dtype, tol) = CASES[name], PRECISIONS[precision]
    seq, params = case.make(3, N, dtype, 30.0)
    mask = _mask(3, N) if padded else None
    if padded:  # what padding hides cannot matter
        for x in seq.values():
            x.masked_fill_(~mask.view(3, N, *(1,) * (x.dim() - 2)), 1e4)
    y0, s0 = case.run(seq, params, padding_mask=mask, return_state=True)
    assert_close("Y (plain call)", case.run(seq, params, padding_mask=mask), y0,
                 atol=tol, rtol=tol)
    y, s = _chunked(case, seq, params, CHUNKINGS[chunking], padding_mask=mask)
    assert y.dtype == dtype and all(x.dtype == dtype for x in _floats(s).values())
    assert_close("Y", y, y0, atol=tol, rtol=tol)
    _assert_states("state", s, s0, atol=tol, rtol=tol)
    y_ref, s_ref = case.reference(seq, params, mask)
    assert_close("Y vs reference", y0, y_ref, atol=tol, rtol=tol)
    _assert_states("state vs reference", s0, s_ref, atol=tol, rtol=tol)
    if padded:
        assert _row_is_empty(s, 1) and not _row_is_empty(s, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_low_precision_state_is_float32(name, dtype):
    case = CASES[name]
    seq, params = case.make(2, 12, dtype, 3.0)
    y0, s0 = case.run(seq, params, return_state=True)
    y, s = _chunked(case, seq, params, [5, 0, 7])
    assert y.dtype == dtype and all(x.dtype == F32 for x in _floats(s).values())
    assert_close("Y", y, y0)
    _assert_states("state", s, s0, atol=1e-5, rtol=1e-5)
    y_ref, s_ref = case.reference(seq, params)
    assert_close("Y vs reference", y, y_ref)
    _assert_states("state vs reference", s, s_ref, precision=F32, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kscale", [1e4, 1e30])
@pytest.mark.parametrize("name", list(CASES))
def test_huge_keys_chunked(name, kscale):
    """float32 keys far beyond exp's range, one position at a time: the state's log-sum
    carries them exactly."""
    case = CASES[name]
    seq, params = case.make(2, N, F32, kscale)
    y, s = _chunked(case, seq, params, CHUNKINGS["singles"])
    y_ref, s_ref = case.reference(seq, params)
    assert torch.isfinite(y).all()
    assert_close("Y", y, y_ref)
    _assert_states("state", s, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_an_empty_state_is_no_state(name):
    """The empty state == no state; a call of T = 0 keeps the state it is given."""
    case = CASES[name]
    seq, params = case.make(2, 9, F64, 3.0)
    y, s = case.run(seq, params, initial_state=case.empty_state(2), return_state=True)
    y0, s0 = case.run(seq, params, return_state=True)
    assert_close("Y", y, y0, atol=1e-12, rtol=1e-12)
    _assert_states("state", s, s0, atol=1e-12, rtol=1e-12)
    y, s = case.run(_slice(seq, 0, 0), params, initial_state=s0, return_state=True)
    assert y.shape[1] == 0
    _assert_states("after T = 0", s, s0, atol=0, rtol=0)
    _, e = case.run(_slice(seq, 0, 0), params, return_state=True)
    _assert_states("T = 0 from no state", e, case.empty_state(2), atol=0, rtol=0)


# ----------------------------------------------------------------------------- a given state
@pytest.mark.parametrize("length", list(WITH_STATE))
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_continuing_a_state_matches_the_reference(name, precision, length):
    """A state no op made, at position 7: the references weigh it by the formula (the
    float32 op against them given the same rounded values)."""
    case, dtype, chunks = CASES[name], PRECISIONS[precision][0], WITH_STATE[length]
    tol = 1e-12 if dtype == F64 else None  # None: float32's default tolerance
    P, T = 7, sum(chunks)
    seq, params = case.make(3, T, dtype, 3.0, rows=P + T)
    mask = _mask(3, T)
    s0 = case.random_state(3, dtype, position=P)
    y_ref, s_ref = case.reference(seq, params, mask, s0)
    y, s = case.run(seq, params, padding_mask=mask, initial_state=s0, return_state=True)
    assert_close("Y", y, y_ref, atol=tol, rtol=tol)
    _assert_states("state", s, s_ref, atol=tol, rtol=tol)
    y, s = _chunked(case, seq, params, chunks, padding_mask=mask, state=s0)
    assert_close("Y (chunked)", y, y_ref, atol=tol, rtol=tol)
    _assert_states("state (chunked)", s, s_ref, atol=tol, rtol=tol)
    # the past matters: from the empty state at the same position the outputs differ
    empty = dataclasses.replace(case.empty_state(3, dtype), position=P)
    assert (case.run(seq, params, padding_mask=mask, initial_state=empty) - y_ref).abs().max() \
        > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_continues_the_ops_own_state(name):
    """The references continuing the op's state after 7 positions == their one pass."""
    case = CASES[name]
    seq, params = case.make(2, N, F64, 3.0)
    mask = _mask(2, N)
    _, s7 = case.run(_slice(seq, 0, 7), params, padding_mask=mask[:, :7], return_state=True)
    y_ref, s_ref = case.reference(_slice(seq, 7, N), params, mask[:, 7:], s7)
    y_all, s_all = case.reference(seq, params, mask)
    assert_close("reference from the state vs one pass", y_ref, y_all[:, 7:], atol=1e-12,
                 rtol=1e-12)
    _assert_states("state", s_ref, s_all, atol=1e-12, rtol=1e-12)
    y = case.run(_slice(seq, 7, N), params, padding_mask=mask[:, 7:], initial_state=s7)
    assert_close("Y vs reference", y, y_ref)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("chunking", ["singles", "uneven", "shorter than the window"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_through_the_chain_of_states_equal_one_pass(name, chunking):
    """A loss on every chunk's output and the final state: the gradients of q, k, v and the
    op's parameters; a row without a key has finite (0) gradients."""
    case = CASES[name]
    seq, params = case.make(3, N, F64, 3.0)
    mask = _mask(3, N)
    leaves = _leaves({**seq, **params})
    seq, params = _split(seq, params, leaves)
    y0, s0 = case.run(seq, params, padding_mask=mask, return_state=True)
    weights = _weights(y0, s0)
    g0 = torch.autograd.grad(_loss(y0, s0, weights), list(leaves.values()))
    y, s = _chunked(case, seq, params, CHUNKINGS[chunking], padding_mask=mask)
    g = torch.autograd.grad(_loss(y, s, weights), list(leaves.values()))
    _assert_grads(leaves, g, g0, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("length", list(WITH_STATE))
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_through_a_given_state_match_the_reference(name, precision, length):
    """One pass and chunks continuing a random state, a loss on the outputs and the final
    state: the gradients of q, k, v, the parameters and every float tensor of the state ==
    the references' (float32: given the same rounded values)."""
    case, dtype, chunks = CASES[name], PRECISIONS[precision][0], WITH_STATE[length]
    tol = 1e-10 if dtype == F64 else None
    P, T = 7, sum(chunks)
    seq, params = case.make(2, T, dtype, 3.0, rows=P + T)
    mask = _mask(2, T)
    s0 = case.random_state(2, dtype, position=P)

    def grads(run, dtype):
        """``run(seq, params, mask, state)`` on leaves in ``dtype``: the gradients of the loss
        with respect to the inputs, the parameters and the state's float tensors."""
        inputs = _leaves(_cast({**seq, **params}, dtype))
        state, state_leaves = _as_leaves(_cast(s0, dtype))
        y, s = run(*_split(seq, params, inputs), mask, state)
        wrt = {**inputs, **state_leaves}
        return wrt, torch.autograd.grad(_loss(y, s, _weights(y, s)), list(wrt.values()))

    wrt, g_ref = grads(case.reference, F64)
    _, g = grads(lambda seq, params, mask, state: case.run(
        seq, params, padding_mask=mask, initial_state=state, return_state=True), dtype)
    _assert_grads(wrt, g, g_ref, atol=tol, rtol=tol)
    _, g = grads(lambda seq, params, mask, state: _chunked(
        case, seq, params, chunks, padding_mask=mask, state=state), dtype)
    _assert_grads(wrt, g, g_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_through_the_initial_state(name):
    """Outputs and the final state's meaning, with respect to the inputs, the parameters and
    the initial state's float tensors (a padded position in the chunk)."""
    case = CASES[name]
    B, T, P = 2, 5, 4
    seq, params = case.make(B, T, F64, 2.0, rows=P + T)
    mask = torch.tensor([[True, False, True, True, True], [True] * 5])
    s0 = case.random_state(B, position=P, empty_row=False)
    fields = _floats(s0)
    names = [*seq, *params, *fields]

    def fn(*tensors):
        ins = dict(zip(names, tensors, strict=True))
        state = _with_fields(s0, {n: ins[n] for n in fields})
        y, s = case.run(*_split(seq, params, ins), padding_mask=mask,
                        initial_state=state, return_state=True)
        return (y, *_meaning(s).values())

    inputs = [x.detach().clone().requires_grad_()
              for x in (*seq.values(), *params.values(), *fields.values())]
    assert torch.autograd.gradcheck(fn, tuple(inputs))


@pytest.mark.parametrize("name", list(CASES))
def test_detach_stops_the_gradient(name):
    case = CASES[name]
    seq, params = case.make(2, 10, F64, 3.0)
    first, second = _leaves(_slice(seq, 0, 6)), _leaves(_slice(seq, 6, 10))
    _, s = case.run(first, params, return_state=True)
    for cut in (False, True):
        y = case.run(second, params, initial_state=s.detach() if cut else s)
        grads = torch.autograd.grad(y.sum(), [first["k"], first["v"]], allow_unused=True,
                                    retain_graph=True)
        if cut:  # the second chunk's own inputs still get theirs
            assert all(g is None for g in grads)
            assert torch.autograd.grad(y.sum(), second["k"])[0].abs().max() > 0
        else:
            assert all(g is not None and g.abs().max() > 0 for g in grads)


# ----------------------------------------------------------------------------- cu_seqlens
DOCUMENTS = [5, 1, 0, 9, 3]  # an empty document, one of one position
OFFSETS = [0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()]


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "continued"])
@pytest.mark.parametrize("name", list(CASES))
def test_cu_seqlens_equals_separate_calls(name, with_state, padded):
    """Outputs, the last document's state, gradients (inputs, parameters and the initial
    state), and the float64 reference per document (the first continuing the state)."""
    case = CASES[name]
    P, T = (7 if with_state else 0), OFFSETS[-1]
    seq, params = case.make(1, T, F64, 3.0, rows=P + T)
    mask = _mask(1, T) if padded else None
    inputs = _leaves({**seq, **params})
    seq, params = _split(seq, params, inputs)
    state, state_leaves = _as_leaves(case.random_state(1, position=P) if with_state else None)
    wrt = {**inputs, **state_leaves}
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    y, s = case.run(seq, params, padding_mask=mask, initial_state=state, return_state=True,
                    cu_seqlens=cu)
    docs = [(a, b) for a, b in zip(OFFSETS, OFFSETS[1:], strict=False) if b > a]
    ys, refs = [], []
    for i, (a, b) in enumerate(docs):
        m, first = (None if mask is None else mask[:, a:b]), (state if i == 0 else None)
        yi, si = case.run(_slice(seq, a, b), params, padding_mask=m, initial_state=first,
                          return_state=True)
        ys.append(yi)
        refs.append(case.reference(_slice(seq, a, b), params, m, first)[0])
    y_sep = torch.cat(ys, 1)
    assert_close("Y", y, y_sep, atol=1e-12, rtol=1e-12)
    _assert_states("state (the last document's)", s, si, atol=1e-12, rtol=1e-12)
    assert s.position == DOCUMENTS[-1]  # positions restart in every document
    weights = _weights(y, s)
    g = torch.autograd.grad(_loss(y, s, weights), list(wrt.values()))
    g_sep = torch.autograd.grad(_loss(y_sep, si, weights), list(wrt.values()))
    _assert_grads(wrt, g, g_sep, atol=1e-12, rtol=1e-12)
    assert_close("Y vs reference", y, torch.cat(refs, 1), atol=1e-12, rtol=1e-12)
    # one pass over the row is something else: there the documents see each other
    assert (case.run(seq, params, padding_mask=mask, initial_state=state) - y).abs().max() \
        > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_cu_seqlens_documents_do_not_see_each_other(name):
    """A change in the first document leaves every later document's output unchanged."""
    case = CASES[name]
    seq, params = case.make(1, OFFSETS[-1], F64, 3.0)
    cu = torch.tensor(OFFSETS, dtype=torch.int32)
    y = case.run(seq, params, cu_seqlens=cu)
    n = DOCUMENTS[0]
    seq["v"] = seq["v"].clone()
    seq["v"][:, :n] += 10.0
    y2 = case.run(seq, params, cu_seqlens=cu)
    assert torch.equal(y[:, n:], y2[:, n:])
    assert (y[:, :n] - y2[:, :n]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- compile
@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_takes_and_returns_a_state(name):
    """Two compiled calls (float32), the second continuing the first's state, == eager."""
    case, dtype, tol = CASES[name], F32, 1e-6
    T, P = 9, 7
    seq, params = case.make(2, 2 * T, dtype, 3.0, rows=P + 2 * T)
    calls = [(_slice(seq, 0, T), case.at(params, P, T)),
             (_slice(seq, T, 2 * T), case.at(params, P + T, T))]

    def step(seq, params, state):
        return case.op(**seq, **params, initial_state=state, return_state=True)

    torch.compiler.reset()  # `step` is one code object in every case: no recompile limit
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    s = e = case.random_state(2, dtype, position=P)
    for i, (chunk, p) in enumerate(calls):  # the compiled call's own state goes back in
        y, s = compiled(chunk, p, s)
        y_e, e = step(chunk, p, e)
        assert isinstance(s, case.state_type)
        assert_close(f"Y (call {i})", y, y_e, atol=tol, rtol=tol)
        _assert_states(f"state (call {i})", s, e, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- bad input
def _call(case, B=2, T=5, **kw):
    """The op on float32 inputs, the params those of positions 0 .. T - 1 (what a bad state
    says is not read)."""
    seq, params = case.make(B, T, F32)
    return case.op(**seq, **case.at(params, 0, T), **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_another_type_is_refused(name):
    case = CASES[name]
    other = CASES["aft_local" if case.state_type is RunningSums else "aft_simple"]
    for state in (other.empty_state(2, F32), (1.0, 2.0)):
        with pytest.raises(TypeError, match=rf"'initial_state' must be a "
                           rf"{case.state_type.__name__}\b.*got {type(state).__name__}"):
            _call(case, initial_state=state)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_another_shape_device_or_dtype_is_refused(name):
    case = CASES[name]
    others = {"batch": case.empty_state(3, F32), "width": case.empty_state(2, F32, wider=True)}
    if case.window is not None:
        others["window"] = case.empty_state(2, F32, window=S + 1)
    for state in others.values():  # another batch, width, window
        with pytest.raises(ValueError, match=r"'initial_state\.[\w.]+' must have shape .*\(2, "):
            _call(case, initial_state=state)
    meta = map_state(lambda t: t.to("meta"), case.random_state(2, F32))
    with pytest.raises(ValueError, match=r"'initial_state\.[\w.]+' is on meta but 'q' is on cpu"):
        _call(case, initial_state=meta)
    state = case.random_state(2, F32)
    path, owner, field = _fields(state)[0]
    setattr(owner, field, getattr(owner, field).long())
    with pytest.raises(TypeError, match=rf"'{path}' must have dtype torch\.float32"):
        _call(case, initial_state=state)
    state = dataclasses.replace(case.empty_state(2, F32), position=-1)
    with pytest.raises(ValueError, match=r"'initial_state\.position' must be >= 0"):
        _call(case, initial_state=state)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_cu_seqlens_are_refused(name):
    case = CASES[name]
    i32 = partial(torch.tensor, dtype=torch.int32)
    with pytest.raises(TypeError, match="'cu_seqlens' must have dtype torch.int32"):
        _call(case, B=1, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(TypeError, match="'cu_seqlens' must be a torch.Tensor"):
        _call(case, B=1, cu_seqlens=[0, 2, 5])
    with pytest.raises(ValueError, match="'cu_seqlens' must have 1 dimensions"):
        _call(case, B=1, cu_seqlens=i32([[0, 2, 5]]))
    with pytest.raises(ValueError, match=r"'cu_seqlens' must run from 0 to .* 5, got \[1, 2, 5\]"):
        _call(case, B=1, cu_seqlens=i32([1, 2, 5]))
    with pytest.raises(ValueError, match=r"'cu_seqlens' must run from 0 to .* 5, got \[0, 2, 4\]"):
        _call(case, B=1, cu_seqlens=i32([0, 2, 4]))
    with pytest.raises(ValueError, match="'cu_seqlens' must be non-decreasing"):
        _call(case, B=1, cu_seqlens=i32([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="'cu_seqlens' packs documents into a batch of one row"):
        _call(case, B=2, cu_seqlens=i32([0, 2, 5]))


@pytest.mark.parametrize("arg", ["initial_state", "return_state", "cu_seqlens"])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.noncausal])
def test_state_keywords_need_causal(name, arg):
    case = CASES[name]
    value = {"initial_state": case.empty_state(1, F32), "return_state": True,
             "cu_seqlens": torch.tensor([0, 5], dtype=torch.int32)}[arg]
    with pytest.raises(ValueError, match=rf"'{arg}' need causal=True"):
        _call(case, B=1, causal=False, **{arg: value})


# ============================================================================= op-specific
@pytest.mark.parametrize("name", SCAN)
def test_a_running_sums_state_empty_in_some_channels(name):
    # Channel 0 of row 0 has seen no key (p = -inf, a = b = 0): a decay beyond the float range
    # can leave that; the other channels and rows carry on.
    case = CASES[name]
    seq, params = case.make(2, 6, F64, 3.0)
    s0 = case.random_state(2, empty_row=False)
    s0.p[0, 0], s0.a[0, 0], s0.b[0, 0] = NEG_INF, 0.0, 0.0
    y_ref, s_ref = case.reference(seq, params, None, s0)
    y, s = case.run(seq, params, initial_state=s0, return_state=True)
    assert_close("Y", y, y_ref, atol=1e-12, rtol=1e-12)
    _assert_states("state", s, s_ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_another_float_dtype_is_refused(name):
    # a state is kept in the compute dtype (float32 here); a float64 one is another op's call
    case = CASES[name]
    with pytest.raises(TypeError, match=r"'initial_state\.[\w.]+' must have dtype torch\.float32"):
        _call(case, initial_state=case.empty_state(2, F64))


@pytest.mark.parametrize("name", list(CASES))
def test_a_return_state_not_a_bool_is_refused(name):
    with pytest.raises(TypeError, match="'return_state' must be a bool"):
        _call(CASES[name], return_state=1)


def test_aft_local_w_must_cover_position_plus_T():
    case = CASES["aft_local"]
    seq, params = case.make(2, 5)  # w (6, 6)
    st = dataclasses.replace(case.empty_state(2), position=2)
    with pytest.raises(ValueError, match=r"T' >= position \+ T = 2 \+ 5 = 7"):
        case.run(seq, params, initial_state=st)
    case.run(seq, params, initial_state=dataclasses.replace(st, position=1))


def test_aft_local_band_is_window_wide_with_a_state():
    seq, params = CASES["aft_local_band"].make(2, 3)  # T = 3 < S: a plain call's band is 3
    (q, k, v), wb = seq.values(), params["w_band"]  # wide, a state's S
    assert wb.shape == (3, S)
    with pytest.raises(ValueError, match=r"'w_band' must have shape \(T = 3, window = 4\)"):
        aft_local_band(q, k, v, wb[:, 1:], S, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"'w_band' must have shape \(3, 3\)"):
        aft_local_band(q, k, v, wb, S, causal=True)  # no state keyword: min(window, T) wide
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row per in-document position, 2 rows"):
        aft_local_band(q[:1], k[:1], v[:1], wb[:2], S, causal=True, cu_seqlens=cu)


EDGES = {
    "aft_local window 0 (aft-simple)": _aft_local_case(0),
    "aft_local window 1 (no ring)": _aft_local_case(1),
    "aft_local window 2": _aft_local_case(2),
    "aft_local window 30 (wider than T)": _aft_local_case(30),
    "aft_conv kernel 1": _aft_conv_case(1),
    "aft_conv kernel 2": _aft_conv_case(2),
    "aft_conv kernel 30": _aft_conv_case(30),
}


@pytest.mark.parametrize("edge", list(EDGES))
def test_edge_windows_chunked_equal_one_pass_and_the_reference(edge):
    """Window 0 (all of the past in ``gone``), 1 (no ring), wider than ``T``; edge kernels."""
    case = EDGES[edge]
    seq, params = case.make(3, N, F64, 3.0)
    mask = _mask(3, N)
    y0, s0 = case.run(seq, params, padding_mask=mask, return_state=True)
    y, s = _chunked(case, seq, params, CHUNKINGS["uneven"], padding_mask=mask)
    assert s.k.shape[1] == max(case.window - 1, 0)
    assert_close("Y", y, y0, atol=1e-12, rtol=1e-12)
    _assert_states("state", s, s0, atol=1e-12, rtol=1e-12)
    y_ref, s_ref = case.reference(seq, params, mask)
    assert_close("Y vs reference", y0, y_ref, atol=1e-12, rtol=1e-12)
    _assert_states("state vs reference", s0, s_ref, atol=1e-10, rtol=1e-12)
