"""What every registered mixer promises, checked on each of ``available_mixers()``.

Decoding (``init_state`` + ``step``) and prefill equal the forward, and so do chunks that carry the
state from call to call; packed documents (``cu_seqlens``) equal one call per document; padded keys
change nothing and a query with no key gives zeros; no later input reaches an earlier output,
forward or backward; bf16 autocast stays close to float32; gradients reach every parameter; dtype
and device follow the module; the decoding state does not grow with ``T`` (but on the dims its
fields mark with ``GROWS``, a key-value cache's); dropout in training only; bad input gets an error
naming the argument. Odd sizes throughout (``d = 15``, 3 heads of 5, ``T = 11``). Per-mixer files
test only what is a mixer's own: its formula against the op, its options, its initialisation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aftlab.mixers import available_mixers, get_mixer_class
from aftlab.mixers import build_mixer as _build_registered
from aftlab.mixers.aft.common import AFTMixer
from aftlab.mixers.base import GROWS
from aftlab.ops.state import BandState, RunningSums
from aftlab.testing import assert_close, assert_same_state, decode, perturb_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, D, H, T_MAX = 3, 11, 15, 3, 48
F64 = torch.float64

#: every AFT mixer again with ``token_shift=True`` ("aft-local+shift"; ``rwkv4`` is aft-decay
#: with it, registered itself): the same promises with the shift and its state
SHIFTED = {
    f"{n}+shift": n
    for n in available_mixers()
    if issubclass(get_mixer_class(n), AFTMixer) and n != "rwkv4"
}
#: the registered mixers, at collection, and the shifted ones; what each declares comes from
#: its class
NAMES = [*available_mixers(), *SHIFTED]


def _cls(name: str):
    return get_mixer_class(SHIFTED.get(name, name))


def build_mixer(name: str, **kw):
    """The registry's ``build_mixer``; a ``SHIFTED`` name builds its mixer with the shift."""
    if name in SHIFTED:
        return _build_registered(SHIFTED[name], token_shift=True, **kw)
    return _build_registered(name, **kw)


CASES = [(n, c) for n in NAMES for c in (False, True) if c or not _cls(n).causal_only]


def _mixer(name, causal=True, dtype=F64, **kw):
    """``name`` with every parameter perturbed (no zero bias or kernel hides a path), eval mode,
    with its ``test_options`` (small windows and kernels: the ring buffers wrap within T)."""
    opts = {**_cls(name).test_options, **kw}
    m = build_mixer(name, d_model=D, n_heads=H, causal=causal, max_seq_len=T_MAX, **opts)
    return perturb_parameters(m.to(dtype)).eval()


def _x(*shape, dtype=F64, scale=1.0):
    return (torch.randn(*shape, D, dtype=F64) * scale).to(dtype)


def _tensors(state):
    """The tensors of a decoding state (a dataclass, or a dict)."""
    if isinstance(state, dict):
        values = state.values()
    elif dataclasses.is_dataclass(state):
        values = (getattr(state, f.name) for f in dataclasses.fields(state))
    else:
        values = vars(state).values()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _padding_mask():
    """Row 0 left-padded (its first causal queries see no key), row 1 right-padded, row 2 empty."""
    pm = torch.ones(B, T, dtype=torch.bool)
    pm[0, :3] = False
    pm[1, 7:] = False
    pm[2] = False
    return pm


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("scale", [1.0, 1e3])  # inputs ~1e3: exp overflows without the shifts
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("name", NAMES)
def test_decode_equals_forward(name, dtype, scale):
    m = _mixer(name, dtype=dtype)
    x = _x(B, T, dtype=dtype, scale=scale)
    with torch.no_grad():
        y = m(x)
        steps, _ = decode(m, x)
    assert steps.dtype == y.dtype == dtype
    assert torch.isfinite(steps).all() and torch.isfinite(y).all()
    atol, rtol = (1e-10, 1e-8) if dtype == F64 else (1e-5, 1e-4)
    assert_close(f"{name} steps", steps, y, atol=atol * y.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("prompt", [1, 7])
@pytest.mark.parametrize("name", NAMES)
def test_prefill_equals_forward_and_decoding_continues(name, prompt):
    m = _mixer(name)
    x = _x(B, T)
    with torch.no_grad():
        y = m(x)
        y_prompt, state = m.prefill(x[:, :prompt])
        y_rest, _ = decode(m, x[:, prompt:], state)
    assert_close(f"{name} prefill", y_prompt, y[:, :prompt])
    assert_close(f"{name} steps after the prefill", y_rest, y[:, prompt:])


@pytest.mark.parametrize(
    "sizes", [(4, 1, 6), (1,) * T, (5, 0, 6)], ids=["4+1+6", "ones", "5+0+6"]
)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_equals_one_prefill(name, sizes):
    """``forward(x_i, state=s, return_state=True)`` chunk after chunk: the outputs and the final
    state of one prefill, then the same next step; chunks of one token and of none included."""
    m = _mixer(name)
    x = _x(B, T)
    with torch.no_grad():
        y, state = m.prefill(x)
        ys, s, start = [], None, 0
        for n in sizes:
            y_n, s = m(x[:, start : start + n], state=s, return_state=True)
            ys.append(y_n)
            start += n
        assert_close(f"{name} chunked outputs", torch.cat(ys, 1), y)
        assert_same_state(f"{name} chunked state", s, state, F64)
        nxt = _x(B)
        assert_close(f"{name} next step", m.step(nxt, s)[0], m.step(nxt, state)[0])
        _, s = m.prefill(x[:, :5])  # state= alone: the outputs only
        assert_close(f"{name} forward(state=)", m(x[:, 5:], state=s), y[:, 5:])


@pytest.mark.parametrize("name", NAMES)
def test_prefill_of_one_token_is_a_step(name):
    """Prefill in chunks of one token is decoding: each chunk's output and state equal those of
    ``step`` from the same state (field by field), and the chain of prefills carries the
    forward's gradients (float64); so does the chain of steps of an op's state (running sums,
    band states: steps without in-place writes; a cache's step writes its buffer in place)."""
    m = _mixer(name)
    x = _x(B, T).requires_grad_()
    g = _x(B, T)
    ys_step, ys_prefill = [], []
    s_step, s_prefill = m.init_state(B), m.init_state(B)  # step may update its state in place
    for t in range(T):
        y_s, s_step = m.step(x[:, t], s_step)
        y_p, s_prefill = m.prefill(x[:, t : t + 1], s_prefill)
        assert_close(f"{name} token {t}", y_p[:, 0], y_s)
        assert_same_state(f"{name} state after token {t}", s_prefill, s_step, F64)
        ys_step.append(y_s)
        ys_prefill.append(y_p[:, 0])
    (expected,) = torch.autograd.grad((m(x) * g).sum(), x)
    chains = [("one-token prefills", ys_prefill)]
    if isinstance(s_step, (RunningSums, BandState)):
        chains.append(("steps", ys_step))
    for how, ys in chains:
        (grad,) = torch.autograd.grad((torch.stack(ys, 1) * g).sum(), x, retain_graph=True)
        assert_close(f"{name} gradient through {how}", grad, expected)


@pytest.mark.parametrize("name, causal", CASES)
def test_state_arguments_bad_input(name, causal):
    m = _mixer(name, causal)
    x = _x(2, 5)
    if not causal:
        for kw in (dict(return_state=True), dict(state=object())):
            with pytest.raises(RuntimeError, match="needs a causal mixer"):
                m(x, **kw)
        return
    state = m.init_state(2)
    with pytest.raises(TypeError, match="'return_state' must be a bool"):
        m(x, return_state=1)
    with pytest.raises(ValueError, match="'padding_mask' cannot be combined with 'state'"):
        m(x, state=state, padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="'padding_mask' cannot be combined"):
        m(x, return_state=True, padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="'x' has batch size 2 but 'state' was made for 3"):
        m(x, state=m.init_state(3))
    other = "aft-simple" if name.startswith("attention") else "attention"
    with pytest.raises(TypeError, match="'state' must be a"):
        m(x, state=_mixer(other).init_state(2))


@pytest.mark.parametrize("name", NAMES)
def test_state_size(name):
    """A constant-size state (running sums, ring buffers, a T_max table) stays one size."""
    m = _mixer(name)
    with torch.no_grad():
        sizes = [sum(t.numel() for t in _tensors(m.init_state(B)))]
        state = None
        for n in (3, 40):  # 3 then 43 tokens: past the 16 slots a key-value cache starts with
            _, state = decode(m, _x(B, n), state)
            sizes.append(sum(t.numel() for t in _tensors(state)))
    state = m.init_state(B)
    grows = dataclasses.is_dataclass(state) and any(
        f.metadata.get(GROWS) for f in dataclasses.fields(state)
    )
    if grows:
        assert sizes[0] == sizes[1] < sizes[2], sizes
    else:
        assert sizes[0] == sizes[1] == sizes[2], f"{name}: state grew: {sizes} elements"


# ----------------------------------------------------------------------------- padding
@pytest.mark.parametrize("name, causal", CASES)
def test_padding(name, causal):
    m = _mixer(name, causal)
    pm = _padding_mask()
    x = _x(B, T).requires_grad_()
    y = m(x, padding_mask=pm)
    other = x.detach().clone()
    other[~pm] = 1e3
    assert_close(f"{name} real queries, other padding", m(other, padding_mask=pm)[pm], y[pm])
    # right padding is the shorter sequence
    assert_close(f"{name} right-padded row", y[1, :7], m(x[1:2, :7].detach())[0])
    # a query without a valid key gives 0, not NaN: the empty row, and causal left padding
    no_key = torch.zeros(B, T, dtype=torch.bool)
    no_key[2] = True
    no_key[0, :3] = causal
    assert torch.equal(y[no_key], torch.zeros_like(y[no_key]))
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[2], torch.zeros_like(x.grad[2])), "a fully padded row has no effect"
    for n, p in m.named_parameters():
        assert torch.isfinite(p.grad).all(), f"{name}: d{n} not finite"


# ----------------------------------------------------------------------------- packed documents
#: documents of 3, 0, 1 and 7 tokens in a row of T = 11
OFFSETS = [0, 3, 3, 4, T]


def _docs(offsets):
    return [(a, b) for a, b in zip(offsets, offsets[1:], strict=False) if b > a]


def _cu(offsets):
    return torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("name, causal", CASES)
def test_packed_documents_equal_one_call_per_document(name, causal):
    """``cu_seqlens``: outputs and gradients of one call per document; a NaN reaches no other
    document."""
    m = _mixer(name, causal)
    x = _x(1, T)
    g = _x(1, T)
    params = list(m.parameters())

    def run(fn):
        inp = x.clone().requires_grad_()
        y = fn(inp)
        return y, torch.autograd.grad((y * g).sum(), [inp, *params])

    y, grads = run(lambda inp: m(inp, cu_seqlens=_cu(OFFSETS)))
    y_ref, grads_ref = run(lambda inp: torch.cat([m(inp[:, a:b]) for a, b in _docs(OFFSETS)], 1))
    assert_close(f"{name} packed", y, y_ref)
    for i, (a, e) in enumerate(zip(grads, grads_ref, strict=True)):
        assert_close(f"{name} packed gradient {i}", a, e)
    with torch.no_grad():
        bad = x.clone()
        bad[:, 6] = float("nan")  # in the last document, [4, 11)
        y_bad = m(bad, cu_seqlens=_cu(OFFSETS))
    assert_close(f"{name} other documents", y_bad[:, :4], y[:, :4])
    if causal:
        assert_close(f"{name} earlier in the document", y_bad[:, 4:6], y[:, 4:6])


@pytest.mark.parametrize("offsets", [OFFSETS, [0, 0, T]], ids=["4-docs", "empty-first"])
@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_continue_a_state(name, offsets):
    """With ``state`` the first document continues it; the state returned is the last one's."""
    m = _mixer(name)
    before, x = _x(1, 5), _x(1, T)
    docs = _docs(offsets)
    with torch.no_grad():
        _, state = m.prefill(before)
        y, last = m(x, state=state, return_state=True, cu_seqlens=_cu(offsets))
        a, b = docs[0]
        first = m(torch.cat([before, x[:, a:b]], 1))[:, 5:]
        rest = [m(x[:, a:b]) for a, b in docs[1:]]
        assert_close(f"{name} packed after a state", y, torch.cat([first, *rest], 1))
        a, b = docs[-1]
        tail = x[:, a:b] if len(docs) > 1 else torch.cat([before, x[:, a:b]], 1)
        assert_same_state(f"{name} last document's state", last, m.prefill(tail)[1], F64)


# ----------------------------------------------------------------------------- causality
@pytest.mark.parametrize("bad", [1e3, -7.5])
@pytest.mark.parametrize("name", NAMES)
def test_a_later_input_changes_no_earlier_output_or_gradient(name, bad):
    m, p = _mixer(name), 5
    x = _x(B, T)

    def run(inp):
        inp = inp.clone().requires_grad_()
        y = m(inp)
        grads = torch.autograd.grad(y[:, :p].square().sum(), [inp, *m.parameters()])
        return y, grads

    y0, g0 = run(x)
    x[:, p] = bad
    y1, g1 = run(x)
    assert torch.equal(y1[:, :p], y0[:, :p]), f"{name}: x[:, {p}] = {bad} moved y[:, :{p}]"
    assert_close(f"{name} dL/dx[:, :{p}]", g1[0][:, :p], g0[0][:, :p])
    assert torch.equal(g1[0][:, p:], torch.zeros_like(g1[0][:, p:]))
    names = [n for n, _ in m.named_parameters()]
    for n, a, e in zip(names, g1[1:], g0[1:], strict=True):
        assert_close(f"{name} dL/d{n}", a, e)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_at_a_later_position_stays_there(name, bad):
    m, p = _mixer(name), 5
    x = _x(B, T)
    with torch.no_grad():
        y0 = m(x)
        x[:, p] = bad
        y1 = m(x)
    assert torch.equal(y1[:, :p], y0[:, :p]), f"{name}: x[:, {p}] = {bad} moved y[:, :{p}]"


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("name, causal", CASES)
def test_gradients_reach_every_parameter(name, causal):
    m = _mixer(name, causal)
    x = _x(B, T).requires_grad_()
    m(x).square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for n, p in m.named_parameters():
        assert p.grad is not None, f"{name}: no gradient reaches {n}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: d{n}"


@pytest.mark.parametrize("name, causal", CASES)
def test_autocast_bf16_is_close_to_float32(name, causal):
    """Reductions run in fp32 under autocast: the result stays within bf16's rounding."""
    m = _mixer(name, causal, dtype=torch.float32)
    x = _x(2, T, dtype=torch.float32, scale=3.0)
    with torch.no_grad():
        y32 = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    scale = y32.abs().max().item()
    assert_close(f"{name} bf16 autocast vs float32", y.float(), y32, atol=0.05 * scale, rtol=0.05)
    y.float().square().sum().backward()
    for n, p in m.named_parameters():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: d{n}"


@pytest.mark.parametrize("name, causal", CASES)
def test_dropout_in_training_only(name, causal):
    m = _mixer(name, causal, dtype=torch.float32, dropout=0.5)
    x = _x(2, T, dtype=torch.float32)
    assert (m.train()(x) == 0).float().mean() > 0.2
    m.eval()
    y = m(x)
    assert torch.equal(y, m(x)) and (y != 0).all()


# ----------------------------------------------------------------------------- dtype, device
@pytest.mark.parametrize("name, causal", CASES)
def test_dtype_follows_the_module(name, causal):
    m = build_mixer(name, d_model=D, n_heads=H, causal=causal, max_seq_len=T_MAX)
    for dtype in (F64, torch.bfloat16, torch.float32):
        m.to(dtype)
        assert all(p.dtype == dtype for p in m.parameters())
        y = m(_x(2, T, dtype=dtype))
        assert y.dtype == dtype and torch.isfinite(y).all()
        if causal:  # the state keeps at least the module's precision (fp32 for bf16)
            state = m.init_state(2)
            kinds = {t.dtype for t in _tensors(state) if t.is_floating_point()}
            assert kinds, f"{name}: no floating-point state"
            for k in kinds:
                assert torch.promote_types(k, dtype) == k, f"{name} {dtype}: state in {k}"
            y_t, _ = m.step(_x(2, dtype=dtype), state)
            assert y_t.dtype == dtype and y_t.shape == (2, D)


@pytest.mark.parametrize("name", NAMES)
def test_state_follows_the_module_device(name):
    m = build_mixer(name, d_model=D, n_heads=H, causal=True, max_seq_len=T_MAX).to("meta")
    assert {t.device.type for t in _tensors(m.init_state(2))} == {"meta"}


# ----------------------------------------------------------------------------- sizes, errors
@pytest.mark.parametrize("name, causal", CASES)
def test_odd_and_empty_sizes(name, causal):
    m = _mixer(name, causal)
    for shape in [(1, 1), (2, 0), (1, T_MAX)]:
        y = m(_x(*shape))
        assert y.shape == (*shape, D) and torch.isfinite(y).all()


@pytest.mark.parametrize("name", [n for n in NAMES if _cls(n).causal_only])
def test_causal_only_mixers_refuse_causal_false(name):
    with pytest.raises(ValueError, match="'causal'"):
        build_mixer(name, d_model=D, causal=False)


@pytest.mark.parametrize("name, causal", CASES)
def test_bad_input_names_the_argument(name, causal):
    m = _mixer(name, causal)
    with pytest.raises(ValueError, match="'x'"):
        m(_x(2, 5)[..., :-1])
    with pytest.raises(ValueError, match="'padding_mask'"):
        m(_x(2, 5), padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="'cu_seqlens' packs documents into a batch of one row"):
        m(_x(2, 5), cu_seqlens=_cu([0, 5]))
    with pytest.raises(TypeError, match="'cu_seqlens' must have dtype torch.int32"):
        m(_x(1, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="'cu_seqlens' must run from 0 to the sequence length 5"):
        m(_x(1, 5), cu_seqlens=_cu([0, 4]))
    with pytest.raises(ValueError, match="'cu_seqlens' or 'padding_mask', not both"):
        m(_x(1, 5), cu_seqlens=_cu([0, 5]), padding_mask=torch.ones(1, 5, dtype=torch.bool))
    if not causal:
        for call in (lambda: m.init_state(1), lambda: m.step(_x(1), None)):
            with pytest.raises(RuntimeError, match="causal"):
                call()
        return
    with pytest.raises(ValueError, match="'x'"):
        m.step(_x(2, 5), m.init_state(2))
