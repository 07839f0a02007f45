"""The aft-local mixer: band of U V^T (or of relative biases), its window (decoding included),
relation to aft-full.

What every mixer promises (decoding, padding, causality, autocast, dtypes) is in test_contract.py.
"""

import pytest
import torch

from aftlab.functional import aft_local
from aftlab.mixers import build_mixer
from aftlab.models import TransformerConfig, TransformerLM
from aftlab.ops.aft_local import aft_local_reference
from aftlab.testing import assert_close, assert_same_state, decode, perturb_parameters
from aftlab.train.compare import parse_mixer_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def _mixer(causal=True, **opts):
    opts.setdefault("max_seq_len", 20)
    return build_mixer("aft-local", d_model=6, causal=causal, **opts).double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_rank", [3, None])
def test_forward_is_projections_around_aft_local(causal, bias_rank):
    m = perturb_parameters(_mixer(causal=causal, window=4, bias_rank=bias_rank), 1.0)
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    w = m.pos_bias.matrix(20)
    assert_close("y", m(x), m.proj(aft_local(q, k, v, w, 4, causal=causal)))


def test_default_window_and_bias_trains():
    m = build_mixer("aft-local", d_model=4, max_seq_len=64)
    assert m.window == 32
    m(torch.randn(1, 40, 4)).pow(2).sum().backward()
    assert m.pos_bias.v.grad.abs().max() > 0


def test_window_beyond_length_is_aft_full():
    loc = perturb_parameters(_mixer(window=50, bias_rank=3), 1.0)
    full = build_mixer("aft-full", d_model=6, causal=True, max_seq_len=20, bias_rank=3).double()
    full.load_state_dict(loc.state_dict())
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    assert_close("aft-local(window >= T) vs aft-full", loc(x), full(x))


@pytest.mark.parametrize("window", [0, 1, 3, 20, 64])
@pytest.mark.parametrize("key_scale", [1.0, 1e3])
def test_step_matches_forward_for_every_window(window, key_scale):
    """Also with huge keys; the state (a BandState of window min(s, T_max)) keeps a ring of
    the last min(s, T_max) - 1 keys only."""
    m = perturb_parameters(_mixer(window=window, bias_rank=None if window == 3 else 4), 5.0)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)
        x = torch.randn(2, 20, 6, dtype=torch.float64)
        y = m(x)
        steps, state = decode(m, x)
    assert torch.isfinite(y).all()
    r = max(min(window, 20) - 1, 0)
    assert state.k.shape == state.v.shape == (2, r, 6) and state.valid.shape == (2, r)
    assert state.position == 20 and state.gone.position == 20 - r
    assert_close("step-by-step", steps, y)


def test_errors():
    with pytest.raises(ValueError, match="'max_seq_len'.*required"):
        build_mixer("aft-local", d_model=4)
    with pytest.raises(ValueError, match="'window' must be >= 0, got -1"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, window=-1)
    with pytest.raises(ValueError, match=r"length 9 .* max_seq_len \(T_max\) = 8"):
        build_mixer("aft-local", d_model=4, max_seq_len=8)(torch.randn(1, 9, 4))
    with pytest.raises(ValueError, match="unexpected keyword argument 'windw'"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, windw=3)


# ----------------------------------------------------------------------------- relative bias
def _relative(causal=True, window=4, **opts):
    m = build_mixer(
        "aft-local", d_model=6, causal=causal, window=window, relative_bias=True, **opts
    )
    return perturb_parameters(m.double(), 1.0)


def _toeplitz(rel: torch.Tensor, T: int, window: int) -> torch.Tensor:
    """``(T, T)`` ``w[t, t'] = rel[t' - t + window - 1]`` where that index exists, else 0 (the
    reference zeroes what lies outside the window and masks the future when causal)."""
    t = torch.arange(T)
    j = t[None, :] - t[:, None] + window - 1
    inside = (j >= 0) & (j < rel.numel())
    return torch.where(inside, rel[j.clamp(0, rel.numel() - 1)], 0.0)


@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("T", "window"), [(13, 4), (13, 1), (7, 20), (1, 3), (29, 5)])
def test_relative_bias_matches_reference_forward_and_backward(causal, T, window):
    """Forward and every gradient against the float64 reference with the Toeplitz ``w`` of
    the offsets, on the kernel and the PyTorch path (``T < window``: the band is cut to T)."""
    m = _relative(causal=causal, window=window)
    assert m.rel_bias.shape == ((window,) if causal else (2 * window - 1,))
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, T, 6, dtype=torch.float64)
    y = m(x)
    got = torch.autograd.grad(y, (x, m.rel_bias), g)
    rel = m.rel_bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    q, k, v = m.to_q(xr), m.to_k(xr), m.to_v(xr)
    w = _toeplitz(rel * m.relative_gain, T, window)  # r = relative_gain * rel_bias
    ref = m.proj(aft_local_reference(q, k, v, w, window, causal=causal))
    want = torch.autograd.grad(ref, (xr, rel), g)
    assert_close("y", y, ref)
    assert_close("dL/dx", got[0], want[0])
    assert_close("dL/drel_bias", got[1], want[1])
    if T >= window:  # every offset is read
        assert got[1].abs().min() > 0


def test_relative_band_is_a_view_of_the_offsets():
    m = _relative(causal=False, window=4)
    with torch.no_grad():
        m.rel_bias.copy_(torch.randn(7))
    band = m.band(10)
    assert band.shape == (10, 7) and band.stride() == (0, 1)  # one row of offsets, repeated
    assert m.relative_gain == 10.0
    assert_close("band rows", band, (10.0 * m.rel_bias.detach()).expand(10, 7))


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_relative_bias_step_and_prefill_match_forward(window):
    """No max_seq_len: decoding runs any length, its state (a BandState) holds the window's
    last ``window - 1`` keys; a prefill continuing it (one op call, the same band rows at any
    position) equals the forward and leaves the steps' state."""
    m = _relative(window=window)
    assert m.max_seq_len is None and not m.length_limited
    x = torch.randn(2, 25, 6, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
        steps, state = decode(m, x)
        y_pre, pre = m.prefill(x[:, :17])
        y_rest, after = m.prefill(x[:, 17:], pre)
        tail, _ = decode(m, x[:, 17:], m.prefill(x[:, :17])[1])
    assert state.k.shape[1] == max(window - 1, 0) and state.position == 25
    assert_close("step-by-step", steps, y)
    assert_close("prefill", y_pre, y[:, :17])
    assert_close("prefill continuing the state", y_rest, y[:, 17:])
    assert_same_state("state of the continued prefill", after, state, torch.float64)
    assert_close("decoding after prefill", tail, y[:, 17:])


@pytest.mark.parametrize("relative_bias", [False, True])
def test_gradients_through_chunks_of_states(relative_bias):
    """Chunks carrying the BandState (shorter and longer than the window, one token among them)
    give the forward's gradients for the input and every parameter, the bias included."""
    if relative_bias:
        m = _relative(window=4)
    else:
        m = perturb_parameters(_mixer(window=4, bias_rank=3), 1.0)
    x = torch.randn(2, 14, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 14, 6, dtype=torch.float64)
    params = [x, *m.parameters()]
    want = torch.autograd.grad((m(x) * g).sum(), params)
    ys, state, start = [], None, 0
    for n in (2, 1, 6, 5):
        y, state = m.prefill(x[:, start : start + n], state)
        ys.append(y)
        start += n
    got = torch.autograd.grad((torch.cat(ys, 1) * g).sum(), params)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, a, e in zip(names, got, want, strict=True):
        assert_close(f"dL/d{name}", a, e)
    assert got[names.index("rel_bias" if relative_bias else "pos_bias.v")].abs().max() > 0


@pytest.mark.parametrize("causal", [False, True])
def test_relative_bias_ignores_right_padding(causal):
    """Padded keys count for nothing: the real rows equal the forward of the unpadded prefix."""
    m = _relative(causal=causal, window=4)
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    pm = torch.ones(2, 11, dtype=torch.bool)
    pm[:, 7:] = False
    assert_close("padded", m(x, padding_mask=pm)[:, :7], m(x[:, :7]))


def test_relative_bias_is_causal_and_trains_from_zero():
    m = build_mixer("aft-local", d_model=6, causal=True, window=4, relative_bias=True).double()
    assert m.rel_bias.abs().max() == 0  # starts as AFT-simple, like PositionBias
    perturb_parameters(m.to_k, 1.0)
    x = torch.randn(2, 12, 6, dtype=torch.float64, requires_grad=True)
    y = m(x)
    (dx,) = torch.autograd.grad(y[:, 6].sum(), x, retain_graph=True)
    assert dx[:, 7:].abs().max() == 0 and dx[:, :7].abs().max() > 0
    y.pow(2).sum().backward()
    assert m.rel_bias.grad.abs().min() > 0


def _lm(positional="none", **options):
    cfg = TransformerConfig(
        vocab_size=11,
        d_model=8,
        n_layers=2,
        n_heads=2,
        max_seq_len=8,
        causal=True,
        mixer="aft-local",
        mixer_options={"window": 3, **options},
        positional=positional,
    )
    return TransformerLM(cfg)


@pytest.mark.parametrize("positional", ["none", "sinusoidal"])
def test_model_with_relative_bias_runs_past_max_seq_len(positional):
    lm = _lm(positional, relative_bias=True)
    assert lm.length_limit is None
    idx = torch.randint(0, 11, (2, 20))
    with torch.no_grad():
        logits = lm(idx)
        cache = lm.init_cache(2)
        steps = torch.stack([lm.step(idx[:, t], cache) for t in range(20)], 1)
    assert logits.shape == (2, 20, 11)
    assert_close("model decoding past max_seq_len", steps, logits, precision=torch.float32)
    absolute = _lm(positional)
    assert absolute.length_limit.source == "aft-local"
    with pytest.raises(ValueError, match=r"length 20 of 'x' exceeds max_seq_len \(T_max\) = 8"):
        absolute(idx)
    with pytest.raises(ValueError, match="length 20 of 'idx' exceeds max_seq_len = 8, the limit"):
        absolute.prefill(idx)


def test_relative_bias_through_compare_spec():
    spec = parse_mixer_spec("aft-local:window=8:relative_bias=true")
    assert spec.options == {"window": 8, "relative_bias": True}
    mixer = _lm(**{**spec.options, "window": 3}).backbone.blocks[0].mixer
    assert mixer.relative_bias and mixer.rel_bias.shape == (3,) and not hasattr(mixer, "pos_bias")


def test_relative_bias_errors():
    with pytest.raises(TypeError, match="'relative_bias' must be a bool, got str"):
        build_mixer("aft-local", d_model=4, relative_bias="yes")
    for bad in (0, -1.0, float("inf"), "10", True):
        with pytest.raises(ValueError, match="'relative_gain' must be a finite number > 0"):
            build_mixer("aft-local", d_model=4, relative_bias=True, relative_gain=bad)
