"""State across calls of the causal ops: chunked runs, gradients through the state, packed
documents (``cu_seqlens``), ``torch.compile``, bad states. One suite over the table ``CASES``.

A case knows how to draw an op's inputs, call it and its float64 references; every test runs
on both implementations (the ``impl`` fixture of conftest.py). States are compared through
their summary (for :class:`RunningSums` the log-sum ``L`` and average ``A``): one state has many
``(p, a, b)``, since ``p`` is only a shift.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
import torch

from aftlab.ops import aft_decay, aft_simple
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.ops.reference import running_sums_reference
from aftlab.ops.state import BandState, RunningSums
from aftlab.testing import assert_close

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("impl", "one_thread")  # both implementations (conftest)


@dataclasses.dataclass(frozen=True)
class Case:
    """A causal op of this suite.

    Attributes:
        op: the op, called ``op(**seq, **params, **kw)`` with ``kw`` among ``padding_mask``,
            ``initial_state``, ``return_state``, ``cu_seqlens``.
        make: ``(B, T, d, dtype, kscale) -> (seq, params)``: ``seq`` the tensors along the
            sequence (dim 1), ``params`` the others; keys scaled by ``kscale``.
        reference: ``(seq, params, padding_mask, initial_state) -> (Y, state)``, float64 from
            the formula (the state's summary weighed as the formula says).
        summary: ``state -> {name: tensor}``, what two equal states agree on.
        random_state: ``(B, d, dtype) -> state``, a valid state not made by the op.
        empty_state: ``(B, d, dtype) -> state``, the state before any token.
    """

    op: Callable
    make: Callable
    reference: Callable
    summary: Callable
    random_state: Callable
    empty_state: Callable

    @property
    def state_type(self) -> type:
        return type(self.empty_state(1, 1, F64))


def _qkv(B, T, d, dtype, kscale):
    q, k, v = (torch.randn(B, T, d, dtype=F64) for _ in range(3))
    return {"q": q.to(dtype), "k": (k * kscale).to(dtype), "v": v.to(dtype)}


def _decay_params(d, dtype):
    return {"decay": (torch.rand(d, dtype=F64) * 2).to(dtype), "bonus": torch.randn(d).to(dtype)}


def _sums_summary(state: RunningSums) -> dict[str, torch.Tensor]:
    return {"L": state.log_sum(), "A": state.average()}


def _random_sums(B, d, dtype):
    """``p`` anywhere, ``b >= 1`` (after a first token), ``A = a / b`` of the values' size."""
    b = 1 + 4 * torch.rand(B, d, dtype=F64)
    s = RunningSums(a=torch.randn(B, d, dtype=F64) * b, b=b, p=3 * torch.randn(B, d, dtype=F64),
                    position=7)
    return dataclasses.replace(s, a=s.a.to(dtype), b=s.b.to(dtype), p=s.p.to(dtype))


def _empty_sums(B, d, dtype):
    return RunningSums.empty(B, d, device="cpu", dtype=dtype)


def _simple_reference(seq, params, padding_mask, initial_state):
    y = aft_simple_reference(**seq, causal=True, padding_mask=padding_mask,
                             initial_state=initial_state)
    s = running_sums_reference(seq["k"], seq["v"], padding_mask=padding_mask,
                               initial_state=initial_state)
    return y, s


def _decay_reference(seq, params, padding_mask, initial_state):
    y = aft_decay_reference(**seq, **params, padding_mask=padding_mask,
                            initial_state=initial_state)
    s = running_sums_reference(seq["k"], seq["v"], decay=params["decay"],
                               padding_mask=padding_mask, initial_state=initial_state)
    return y, s


_SUMS = {"summary": _sums_summary, "random_state": _random_sums, "empty_state": _empty_sums}

#: the causal ops by name (the band ops, aft_local and aft_conv, join with their BandState)
CASES: dict[str, Case] = {
    "aft_simple": Case(
        op=partial(aft_simple, causal=True),
        make=lambda B, T, d, dtype, kscale: (_qkv(B, T, d, dtype, kscale), {}),
        reference=_simple_reference,
        **_SUMS,
    ),
    "aft_decay": Case(
        op=aft_decay,
        make=lambda B, T, d, dtype, kscale: (_qkv(B, T, d, dtype, kscale),
                                             _decay_params(d, dtype)),
        reference=_decay_reference,
        **_SUMS,
    ),
}

#: one empty state of every type, for "a state of another type"
OTHER_STATES = {
    RunningSums: lambda B, d, dtype: RunningSums.empty(B, d, device="cpu", dtype=dtype),
    BandState: lambda B, d, dtype: BandState.empty(B, 3, d, device="cpu", dtype=dtype),
}

CHUNKINGS = {
    "whole": [23],
    "singles": [1] * 23,
    "uneven": [3, 0, 7, 1, 12],
    "empty first and last": [0, 5, 18, 0],
}

#: (dtype, key scale, atol, rtol): float32 keys x30 put ~100 in every exponent
PRECISIONS = {"float64": (F64, 3.0, 1e-12, 1e-12), "float32": (torch.float32, 30.0, 1e-5, 1e-5)}


def _leaves(tensors: dict, grad: bool = True) -> dict:
    return {n: t.detach().clone().requires_grad_(grad) for n, t in tensors.items()}


def _slice(seq: dict, a: int, b: int) -> dict:
    return {n: t[:, a:b] for n, t in seq.items()}


def _chunked(case, seq, params, chunks, *, padding_mask=None, state=None):
    """The op over ``chunks`` (lengths along T), the state passed along: ``(Y, state)``."""
    ys, a = [], 0
    for c in chunks:
        mask = None if padding_mask is None else padding_mask[:, a:a + c]
        y, state = case.op(**_slice(seq, a, a + c), **params, padding_mask=mask,
                           initial_state=state, return_state=True)
        ys.append(y)
        a += c
    assert a == next(iter(seq.values())).shape[1]
    return torch.cat(ys, 1), state


def _assert_states(name, case, actual, expected, **tol):
    assert actual.position == expected.position, f"{name}: position"
    want = case.summary(expected)
    for field, value in case.summary(actual).items():
        assert_close(f"{name}.{field}", value, want[field], **tol)


def _map_tensors(state, fn):
    """``state`` with ``fn`` applied to every tensor (nested dataclasses too)."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if not dataclasses.is_dataclass(state):
        return state
    changes = {f.name: _map_tensors(getattr(state, f.name), fn)
               for f in dataclasses.fields(state)}
    return dataclasses.replace(state, **changes)


def _first_tensor_path(state, prefix="initial_state"):
    """The dotted name and the owner of the first tensor field of ``state``."""
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, torch.Tensor):
            return f"{prefix}.{f.name}", state, f.name
        if dataclasses.is_dataclass(value):
            return _first_tensor_path(value, f"{prefix}.{f.name}")
    raise AssertionError("a state without tensors")


# ----------------------------------------------------------------------------- chunked
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_one_pass(name, chunking, precision):
    case, (dtype, kscale, atol, rtol) = CASES[name], PRECISIONS[precision]
    seq, params = case.make(2, 23, 5, dtype, kscale)
    y0, s0 = case.op(**seq, **params, return_state=True)
    assert torch.equal(y0, case.op(**seq, **params))  # return_state changes nothing else
    y, s = _chunked(case, seq, params, CHUNKINGS[chunking])
    assert y.dtype == dtype and s.a.dtype == dtype
    assert_close("Y", y, y0, atol=atol, rtol=rtol)
    _assert_states("state", case, s, s0, atol=atol, rtol=rtol)
    _, s_ref = case.reference(seq, params, None, None)
    _assert_states("state vs reference", case, s0, s_ref, atol=max(atol, 1e-10), rtol=rtol)


@pytest.mark.parametrize("name", list(CASES))
def test_continuing_a_state_matches_the_reference(name):
    # A state not made by the op: the reference weighs its summary by the formula.
    case = CASES[name]
    seq, params = case.make(3, 11, 4, F64, 3.0)
    s0 = case.random_state(3, 4, F64)
    y_ref, s_ref = case.reference(seq, params, None, s0)
    y, s = case.op(**seq, **params, initial_state=s0, return_state=True)
    assert_close("Y", y, y_ref, atol=1e-12, rtol=1e-12)
    _assert_states("state", case, s, s_ref, atol=1e-12, rtol=1e-12)
    y, s = _chunked(case, seq, params, [4, 0, 1, 6], state=s0)
    assert_close("Y (chunked)", y, y_ref, atol=1e-12, rtol=1e-12)
    _assert_states("state (chunked)", case, s, s_ref, atol=1e-12, rtol=1e-12)
    # the past matters: without it the outputs differ
    assert (case.op(**seq, **params) - y_ref).abs().max() > 1e-3


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.state_type is RunningSums])
def test_a_state_empty_in_some_channels(name):
    # Channel 0 of row 0 has seen no key (p = -inf, a = b = 0): a decay beyond the float range
    # can leave that; the other channels and rows carry on.
    case = CASES[name]
    seq, params = case.make(2, 6, 3, F64, 3.0)
    s0 = case.random_state(2, 3, F64)
    s0.p[0, 0], s0.a[0, 0], s0.b[0, 0] = float("-inf"), 0.0, 0.0
    y_ref, s_ref = case.reference(seq, params, None, s0)
    y, s = case.op(**seq, **params, initial_state=s0, return_state=True)
    assert_close("Y", y, y_ref, atol=1e-12, rtol=1e-12)
    _assert_states("state", case, s, s_ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kscale", [1e4, 1e30])
@pytest.mark.parametrize("name", list(CASES))
def test_huge_keys_chunked(name, kscale):
    # float32 keys far beyond exp's range: the state's log-sum carries them exactly
    case = CASES[name]
    seq, params = case.make(2, 23, 5, torch.float32, kscale)
    y, s = _chunked(case, seq, params, CHUNKINGS["singles"])
    y_ref, s_ref = case.reference(seq, params, None, None)
    assert torch.isfinite(y).all()
    assert_close("Y", y, y_ref)
    _assert_states("state", case, s, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_an_empty_state_is_no_state(name):
    case = CASES[name]
    seq, params = case.make(2, 9, 3, F64, 3.0)
    y, s = case.op(**seq, **params, initial_state=case.empty_state(2, 3, F64),
                   return_state=True)
    y0, s0 = case.op(**seq, **params, return_state=True)
    assert_close("Y", y, y0, atol=1e-12, rtol=1e-12)
    _assert_states("state", case, s, s0, atol=1e-12, rtol=1e-12)
    # a zero-length call keeps the state (the empty one stays empty: L = -inf, A = 0)
    _, s = case.op(**_slice(seq, 0, 0), **params, initial_state=s0, return_state=True)
    _assert_states("after T = 0", case, s, s0, atol=1e-12, rtol=1e-12)
    _, e = case.op(**_slice(seq, 0, 0), **params, return_state=True)
    _assert_states("empty", case, e, case.empty_state(2, 3, F64), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_padding_masks_inside_chunks(name):
    case = CASES[name]
    B, T, d = 3, 23, 4
    seq, params = case.make(B, T, d, F64, 3.0)
    mask = torch.rand(B, T) > 0.4
    mask[1] = False  # a row without a key: its state stays empty
    mask[2, 3:11] = False  # a chunk without a key
    for x in seq.values():  # what padding hides cannot matter
        x.masked_fill_(~mask[:, :, None], 1e4)
    y_ref, s_ref = case.reference(seq, params, mask, None)
    y0, s0 = case.op(**seq, **params, padding_mask=mask, return_state=True)
    assert_close("Y (one pass)", y0, y_ref, atol=1e-12, rtol=1e-12)
    for chunks in ([3, 8, 0, 12], [1] * T):
        y, s = _chunked(case, seq, params, chunks, padding_mask=mask)
        assert_close("Y", y, y_ref, atol=1e-12, rtol=1e-12)
        _assert_states("state", case, s, s_ref, atol=1e-12, rtol=1e-12)
    assert (s.log_sum()[1] == float("-inf")).all() and (s.average()[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_low_precision_state_is_float32(name, dtype):
    case = CASES[name]
    seq, params = case.make(2, 12, 4, dtype, 3.0)
    y, s = _chunked(case, seq, params, [5, 7])
    assert y.dtype == dtype and s.a.dtype == s.b.dtype == s.p.dtype == torch.float32
    y_ref, s_ref = case.reference(seq, params, None, None)
    assert_close("Y", y, y_ref)
    _assert_states("state", case, s, s_ref, precision=torch.float32, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- gradients
def _loss(case, y, state, gy, gs):
    loss = (y * gy).sum()
    for field, value in case.summary(state).items():
        loss = loss + (value * gs[field]).sum()
    return loss


@pytest.mark.parametrize("chunking", ["singles", "uneven"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_through_the_chain_of_states_equal_one_pass(name, chunking):
    case = CASES[name]
    B, T, d = 3, 23, 3
    seq, params = case.make(B, T, d, F64, 3.0)
    mask = torch.rand(B, T) > 0.2
    mask[2] = False  # a row without a key: its state stays empty, its gradients finite (0)
    leaves = _leaves({**seq, **params})
    seq, params = {n: leaves[n] for n in seq}, {n: leaves[n] for n in params}
    y0, s0 = case.op(**seq, **params, padding_mask=mask, return_state=True)
    gy = torch.randn_like(y0)
    gs = {n: torch.randn_like(x) for n, x in case.summary(s0).items()}
    g0 = torch.autograd.grad(_loss(case, y0, s0, gy, gs), list(leaves.values()))
    y, s = _chunked(case, seq, params, CHUNKINGS[chunking], padding_mask=mask)
    g = torch.autograd.grad(_loss(case, y, s, gy, gs), list(leaves.values()))
    for n, a, e in zip(leaves, g, g0, strict=True):
        assert e.abs().max() > 0, n  # every input reaches the loss
        assert_close(f"d{n}", a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_into_the_initial_state_match_the_reference(name):
    case = CASES[name]
    seq, params = case.make(2, 7, 3, F64, 3.0)
    s0 = case.random_state(2, 3, F64)
    fields = [f.name for f in dataclasses.fields(s0) if isinstance(getattr(s0, f.name),
                                                                    torch.Tensor)]
    grads = []
    for run in (lambda s: case.op(**seq, **params, initial_state=s, return_state=True),
                lambda s: case.reference(seq, params, None, s)):
        s = _map_tensors(s0, lambda t: t.detach().clone().requires_grad_())
        y, s1 = run(s)
        gen = torch.Generator().manual_seed(1)
        gy = torch.randn(y.shape, generator=gen, dtype=F64)
        gs = {n: torch.randn(x.shape, generator=gen, dtype=F64)
              for n, x in case.summary(s1).items()}
        grads.append(torch.autograd.grad(_loss(case, y, s1, gy, gs),
                                         [getattr(s, f) for f in fields]))
    for f, a, e in zip(fields, *grads, strict=True):
        assert e.abs().max() > 0, f
        assert_close(f"d initial_state.{f}", a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_through_the_initial_state(name):
    case = CASES[name]
    seq, params = case.make(2, 4, 2, F64, 2.0)
    s0 = case.random_state(2, 2, F64)
    fields = [f.name for f in dataclasses.fields(s0) if isinstance(getattr(s0, f.name),
                                                                    torch.Tensor)]
    names = list(seq) + list(params)

    def fn(*tensors):
        ins = dict(zip(names, tensors[: len(names)], strict=True))
        s = dataclasses.replace(s0, **dict(zip(fields, tensors[len(names):], strict=True)))
        y, s1 = case.op(**{n: ins[n] for n in seq}, **{n: ins[n] for n in params},
                        initial_state=s, return_state=True)
        return (y, *case.summary(s1).values())

    inputs = [t.detach().clone().requires_grad_() for t in (*seq.values(), *params.values())]
    inputs += [getattr(s0, f).detach().clone().requires_grad_() for f in fields]
    assert torch.autograd.gradcheck(fn, tuple(inputs))


@pytest.mark.parametrize("name", list(CASES))
def test_detach_stops_the_gradient(name):
    case = CASES[name]
    seq, params = case.make(2, 10, 3, F64, 3.0)
    first, second = _leaves(_slice(seq, 0, 6)), _leaves(_slice(seq, 6, 10))
    _, s = case.op(**first, **params, return_state=True)
    for cut in (False, True):
        y = case.op(**second, **params, initial_state=s.detach() if cut else s)
        grads = torch.autograd.grad(y.sum(), [first["k"], first["v"]], allow_unused=True,
                                    retain_graph=True)
        if cut:  # the second chunk's own inputs still get theirs
            assert all(g is None for g in grads)
            assert torch.autograd.grad(y.sum(), second["k"])[0].abs().max() > 0
        else:
            assert all(g is not None and g.abs().max() > 0 for g in grads)


# ----------------------------------------------------------------------------- cu_seqlens
LENGTHS = [5, 1, 0, 9, 3]


def _packed_inputs(case):
    T = sum(LENGTHS)
    seq, params = case.make(1, T, 3, F64, 3.0)
    leaves = _leaves({**seq, **params})
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return leaves, list(seq), offsets


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_cu_seqlens_equals_separate_calls(name, with_state):
    case = CASES[name]
    leaves, seq_names, cu = _packed_inputs(case)
    seq = {n: leaves[n] for n in seq_names}
    params = {n: x for n, x in leaves.items() if n not in seq_names}
    s0 = case.random_state(1, 3, F64) if with_state else None
    y, s = case.op(**seq, **params, cu_seqlens=cu, initial_state=s0, return_state=True)
    gy = torch.randn_like(y)
    g = torch.autograd.grad((y * gy).sum(), list(leaves.values()))
    ys, offsets = [], cu.tolist()
    docs = [(a, b) for a, b in zip(offsets, offsets[1:], strict=False) if b > a]
    for i, (a, b) in enumerate(docs):
        yi, si = case.op(**_slice(seq, a, b), **params, initial_state=s0 if i == 0 else None,
                         return_state=True)
        ys.append(yi)
    y_sep = torch.cat(ys, 1)
    g_sep = torch.autograd.grad((y_sep * gy).sum(), list(leaves.values()))
    assert_close("Y", y, y_sep, atol=1e-12, rtol=1e-12)
    _assert_states("state (last document's)", case, s, si, atol=1e-12, rtol=1e-12)
    assert s.position == LENGTHS[-1]  # positions restart in every document
    for n, a, e in zip(leaves, g, g_sep, strict=True):
        assert_close(f"d{n}", a, e, atol=1e-12, rtol=1e-12)
    # one pass over the row is something else: the documents do not see each other
    assert (case.op(**seq, **params, initial_state=s0) - y).abs().max() > 1e-3
    # the first document continues the state, the others start empty
    y_ref = torch.cat([case.reference(_slice(seq, a, b), params, None,
                                      s0 if i == 0 else None)[0]
                       for i, (a, b) in enumerate(docs)], 1)
    assert_close("Y vs reference", y, y_ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_cu_seqlens_with_padding_mask(name):
    case = CASES[name]
    leaves, seq_names, cu = _packed_inputs(case)
    seq = {n: leaves[n].detach() for n in seq_names}
    params = {n: x.detach() for n, x in leaves.items() if n not in seq_names}
    mask = torch.rand(1, sum(LENGTHS)) > 0.3
    y = case.op(**seq, **params, cu_seqlens=cu, padding_mask=mask)
    offsets = cu.tolist()
    y_sep = torch.cat([case.op(**_slice(seq, a, b), **params, padding_mask=mask[:, a:b])
                       for a, b in zip(offsets, offsets[1:], strict=False)], 1)
    assert_close("Y", y, y_sep, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- compile
@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_takes_and_returns_a_state(name):
    case = CASES[name]
    seq, params = case.make(2, 9, 4, torch.float32, 3.0)

    def step(seq, params, state):
        return case.op(**seq, **params, initial_state=state, return_state=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    s0 = case.random_state(2, 4, torch.float32)
    y, s = compiled(seq, params, s0)
    y2, s2 = compiled(seq, params, s)  # its own output state goes back in
    e, es = step(seq, params, s0)
    e2, es2 = step(seq, params, es)
    assert isinstance(s2, case.state_type)
    assert_close("Y", y, e, atol=1e-6, rtol=1e-6)
    assert_close("Y (second call)", y2, e2, atol=1e-6, rtol=1e-6)
    _assert_states("state", case, s2, es2, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
def _call(case, B=2, T=5, d=3, **kw):
    seq, params = case.make(B, T, d, torch.float32, 1.0)
    return case.op(**seq, **params, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_another_type_is_refused(name):
    case = CASES[name]
    others = [make(2, 3, torch.float32) for kind, make in OTHER_STATES.items()
              if kind is not case.state_type] + [(1.0, 2.0)]
    for other in others:
        with pytest.raises(TypeError, match=rf"'initial_state' must be a "
                           rf"{case.state_type.__name__}, got {type(other).__name__}"):
            _call(case, initial_state=other)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_another_size_device_or_dtype_is_refused(name):
    case = CASES[name]
    shape = r"'initial_state\.[\w.]+' must have shape \(2, "
    with pytest.raises(ValueError, match=shape):
        _call(case, initial_state=case.random_state(3, 3, torch.float32))  # batch size
    with pytest.raises(ValueError, match=shape):
        _call(case, initial_state=case.random_state(2, 4, torch.float32))  # width
    meta = _map_tensors(case.random_state(2, 3, torch.float32), lambda t: t.to("meta"))
    with pytest.raises(ValueError, match=r"'initial_state\.[\w.]+' is on meta but 'q' is on cpu"):
        _call(case, initial_state=meta)
    state = case.random_state(2, 3, torch.float32)
    path, owner, field = _first_tensor_path(state)
    object.__setattr__(owner, field, getattr(owner, field).long())
    with pytest.raises(TypeError, match=rf"'{path}' must be a floating-point tensor"):
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
def test_non_causal_aft_simple_has_no_state(arg):
    q = torch.randn(1, 5, 3)
    value = {"initial_state": RunningSums.empty(1, 3, device="cpu", dtype=torch.float32),
             "return_state": True,
             "cu_seqlens": torch.tensor([0, 5], dtype=torch.int32)}[arg]
    with pytest.raises(ValueError, match=rf"aft_simple: '{arg}' needs causal=True"):
        aft_simple(q, q, q, **{arg: value})
