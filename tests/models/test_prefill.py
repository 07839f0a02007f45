"""One-pass prefill: the decoding state from one parallel pass equals ``T`` decoding steps."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn

from aftlab import _checks
from aftlab._state import map_state
from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
)
from aftlab.mixers import registry as _registry
from aftlab.models import PixelTransformer, TransformerConfig, TransformerLM
from aftlab.testing import assert_close, assert_same_state

from .helpers import small_lm

#: every registered mixer that decodes (aft-decay included; none is non-causal only)
CAUSAL_MIXERS = available_mixers()
LENGTHS = [1, 7, 33]
#: mixers with a ``T_max`` position table
LENGTH_LIMITED = [n for n in CAUSAL_MIXERS if get_mixer_class(n).length_limited]


def _small(name: str) -> dict:
    """The mixer's ``test_options``: small windows and kernels, ring buffers wrap in a prompt."""
    return dict(get_mixer_class(name).test_options)


def _steps(model: TransformerLM, idx: torch.Tensor):
    """The token-by-token path: ``(B, T, V)`` logits and the cache after ``T`` steps."""
    cache = model.init_cache(idx.shape[0])
    logits = [model.step(idx[:, t], cache) for t in range(idx.shape[1])]
    return torch.stack(logits, 1), cache


def _check_prefill(model: TransformerLM, T: int, where: str) -> None:
    idx = torch.randint(0, model.config.vocab_size, (3, T))
    logits, cache = model.prefill(idx)
    # the forward's numbers are unchanged: prefill's logits are forward's, bit for bit
    assert torch.equal(logits, model(idx)), f"{where}: prefill logits != forward"
    step_logits, step_cache = _steps(model, idx)
    assert_close(f"{where}: step logits", step_logits, logits)
    assert (cache.position, cache.batch_size) == (T, 3)
    dtype = next(model.parameters()).dtype
    for layer, (got, expected) in enumerate(zip(cache.states, step_cache.states, strict=True)):
        assert_same_state(f"{where}, layer {layer}", got, expected, dtype)
    nxt = torch.randint(0, model.config.vocab_size, (3, 5))
    for t in range(5):  # decoding goes on alike from both caches
        assert_close(
            f"{where}: logits {t} after the prompt",
            model.step(nxt[:, t], cache),
            model.step(nxt[:, t], step_cache),
        )


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_prefill_state_equals_steps(name, T):
    torch.manual_seed(T)
    _check_prefill(small_lm(name), T, f"{name}, T={T}")


@pytest.mark.parametrize(
    "name, kw",
    [
        ("aft-local", dict(mixer_options={"window": 0})),  # AFT-simple: every key in the sums
        ("aft-local", dict(mixer_options={"window": 40})),  # the window never fills
        ("aft-local", dict(mixer_options={"window": 5, "bias_rank": None})),
        ("aft-conv", dict(mixer_options={"kernel_size": 8})),  # an even causal kernel
        ("aft-full", dict(mixer_options={"bias_rank": None})),
        ("attention", dict(positional="rotary", head_dim=6)),  # rotated keys in the cache
        ("attention-naive", dict(positional="sinusoidal", norm="post", final_norm=False)),
        ("aft-decay", dict(d_ff=0)),  # no feed-forward: the mixer's branch alone
        ("attention", dict(d_ff=0, norm="post")),
    ],
    ids=["local-w0", "local-w40", "local-full-bias", "conv-k8", "full-full-bias", "rotary",
         "naive-post-ln", "decay-no-ff", "attention-no-ff-post-ln"],
)
@pytest.mark.parametrize("T", [7, 33])
def test_prefill_state_equals_steps_variants(name, kw, T):
    torch.manual_seed(T)
    _check_prefill(small_lm(name, **kw), T, f"{name} {kw}, T={T}")


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_greedy_generate_unchanged_by_prefill(name, T):
    torch.manual_seed(100 + T)
    model = small_lm(name)
    prompt = torch.randint(0, 29, (3, T))
    logits, cache = _steps(model, prompt)  # the token-by-token path generate used to take
    nxt, expected = logits[:, -1].argmax(-1), [prompt]
    for _ in range(6):
        expected.append(nxt[:, None])
        nxt = model.step(nxt, cache).argmax(-1)
    assert torch.equal(model.generate(prompt, 6, temperature=0), torch.cat(expected, 1))


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_pixel_sample_completes_a_prefix_after_prefill(name):
    torch.manual_seed(1)
    cfg = TransformerConfig(
        vocab_size=17, d_model=15, n_layers=2, n_heads=3, max_seq_len=16, mixer=name,
        mixer_options=_small(name),
    )
    model = PixelTransformer(cfg, image_shape=(4, 4)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seq = torch.randint(0, 17, (2, 5))
    out = model.sample(2, prefix=seq, temperature=0)
    for t in range(5, 16):  # reference: a full forward per pixel
        nxt = model(torch.cat([seq, torch.zeros(2, 1, dtype=torch.long)], 1))[:, t].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert torch.equal(out, seq)
    assert torch.equal(model.sample(2, prefix=seq, temperature=0), seq)  # nothing left to draw


@pytest.mark.parametrize(  # 300: keys spread far beyond e^-60 (float64: the projections agree)
    "dtype, scale", [(torch.float32, 3.0), (torch.float64, 300.0)], ids=["f32", "f64-large"]
)
@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_mixer_prefill_keeps_forward_and_matches_steps(name, dtype, scale):
    """Module level: ``y`` is forward's bit for bit; the state is ``T`` steps'."""
    torch.manual_seed(0)
    m = build_mixer(name, d_model=15, n_heads=3, causal=True, max_seq_len=40, **_small(name))
    m.to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
        x = scale * torch.randn(2, 33, 15, dtype=dtype)
        y, state = m.prefill(x)
        assert torch.equal(y, m(x)), f"{name}: prefill's y != forward's"
        steps = m.init_state(2)
        for t in range(33):
            _, steps = m.step(x[:, t], steps)
    assert_same_state(name, state, steps, dtype)


@pytest.mark.parametrize("name", LENGTH_LIMITED)
def test_length_limited_mixers_refuse_overflow(name):
    model = small_lm(name, max_seq_len=10, positional="sinusoidal")
    limit = rf"sequence length 11 of 'idx' exceeds max_seq_len = 10, the limit of '{name}'"
    with pytest.raises(ValueError, match=limit):
        model.prefill(torch.zeros(2, 11, dtype=torch.long))
    mixer = model.backbone.blocks[0].mixer  # alone, the mixer checks its own input
    with pytest.raises(ValueError, match="sequence length 11 of 'x' exceeds max_seq_len"):
        mixer.prefill(torch.zeros(2, 11, 15, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"= 11 exceeds max_seq_len = 10, the limit of '{name}'"):
        next(model.stream_generate(torch.zeros(2, 4, dtype=torch.long), 7))  # before any token
    _, cache = model.prefill(torch.zeros(2, 10, dtype=torch.long))  # exactly fills T_max
    with pytest.raises(ValueError, match=r"position 10 exceeds max_seq_len \(T_max\) = 10"):
        model.step(torch.zeros(2, dtype=torch.long), cache)


def test_learned_positions_limit_prefill():
    model = small_lm("aft-simple", max_seq_len=10)
    limit = "the limit of 'the learned positional table'"
    with pytest.raises(ValueError, match=rf"sequence length 11 of 'idx' .* = 10, {limit}"):
        model.prefill(torch.zeros(1, 11, dtype=torch.long))


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_logits_to_keep_gives_the_last_rows(name):
    """``prefill(idx, logits_to_keep=n)``: the last ``n`` rows of the full logits, same cache."""
    torch.manual_seed(2)
    model = small_lm(name)
    idx = torch.randint(0, 29, (3, 9))
    full, cache = model.prefill(idx)
    for n in (1, 4, 9):
        last, last_cache = model.prefill(idx, logits_to_keep=n)
        assert_close(f"{name}: prefill logits_to_keep={n}", last, full[:, -n:])
        assert_close(f"{name}: forward logits_to_keep={n}", model(idx, logits_to_keep=n), last)
        for layer, (a, e) in enumerate(zip(last_cache.states, cache.states, strict=True)):
            assert_same_state(f"{name}, layer {layer}", a, e, torch.float64)
    with pytest.raises(ValueError, match="'logits_to_keep' must be >= 0, got -1"):
        model.prefill(idx, logits_to_keep=-1)
    pix = PixelTransformer(model.config, image_shape=(4, 4)).double().eval()
    pixels = torch.randint(0, 29, (2, 7))
    logits, _ = pix.prefill(pixels)
    assert torch.equal(logits, pix(pixels)), f"{name}: pixel prefill logits != forward"
    assert_close(f"{name}: pixel logits_to_keep", pix.prefill(pixels, logits_to_keep=1)[0],
                 logits[:, -1:])


def _count_checks(monkeypatch) -> collections.Counter:
    """Count the calls of the tensor and token checks (wherever imported) and of state checks."""
    counts: collections.Counter = collections.Counter()
    for fn in (_checks.check_tensor, _checks.check_tokens):
        def counted(*a, _fn=fn, **k):
            counts[_fn.__name__] += 1
            return _fn(*a, **k)

        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("aftlab") and vars(mod).get(
                fn.__name__
            ) is fn:
                monkeypatch.setattr(mod, fn.__name__, counted)
    check_state = SequenceMixer.check_state

    def counted_state(self, *a, **k):
        counts["check_state"] += 1
        return check_state(self, *a, **k)

    monkeypatch.setattr(SequenceMixer, "check_state", counted_state)
    return counts


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_each_entry_checks_its_input_once(name, monkeypatch):
    """A model's prefill checks the tokens once and nothing below it; its step the tokens and
    each layer's state once; a mixer called alone checks its ``x`` once."""
    model = small_lm(name)
    idx = torch.randint(0, 29, (3, 6))
    counts = _count_checks(monkeypatch)
    _, cache = model.prefill(idx)
    assert counts == {"check_tokens": 1}, f"{name}: prefill: {dict(counts)}"
    counts.clear()
    model.step(idx[:, 0], cache)
    assert counts == {"check_tokens": 1, "check_state": 2}, f"{name}: step: {dict(counts)}"
    counts.clear()
    model.prefill(idx, cache=cache)  # continuing: the tokens, and each layer's state once
    assert counts == {"check_tokens": 1, "check_state": 2}, f"{name}: prefill: {dict(counts)}"
    counts.clear()
    mixer = model.backbone.blocks[0].mixer
    _, state = mixer.prefill(torch.randn(3, 6, 15, dtype=torch.float64))
    assert counts == {"check_tensor": 1}, f"{name}: mixer prefill: {dict(counts)}"
    counts.clear()
    mixer.prefill(torch.randn(3, 2, 15, dtype=torch.float64), state)
    assert counts == {"check_tensor": 1, "check_state": 1}, f"{name}: mixer: {dict(counts)}"


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_prefill_bad_input(name):
    m = build_mixer(name, d_model=15, n_heads=3, causal=True, max_seq_len=40)
    x = torch.randn(2, 5, 15)
    with pytest.raises(TypeError, match="'return_state' must be a bool, got str"):
        m(x, return_state="yes")
    y, state = m.prefill(x[:, :0])  # an empty prompt: the empty state, as init_state gives
    assert y.shape == (2, 0, 15)
    assert_same_state(name, state, m.init_state(2), torch.float32)
    with pytest.raises(ValueError, match=r"'x' must have shape \(\*, \*, 15\), got \(2, 5, 14\)"):
        m.prefill(torch.randn(2, 5, 14))
    if not get_mixer_class(name).causal_only:
        bidir = build_mixer(name, d_model=15, n_heads=3, causal=False, max_seq_len=40)
        with pytest.raises(RuntimeError, match=r"prefill\(\) .*needs a causal mixer"):
            bidir.prefill(x)


class _Cumsum(SequenceMixer):
    """A mixer with forward and step hooks only (no ``_prefill``): ``y_t = W sum_s x_s``."""

    def __init__(self, **common) -> None:
        super().__init__(**common)
        self.proj = nn.Linear(self.d_model, self.d_model)

    def _forward(self, x, padding_mask):
        return self.proj(x.cumsum(1))

    def _init_state(self, batch_size, device, dtype):
        return torch.zeros(batch_size, self.d_model, device=device, dtype=dtype)

    def _step(self, x, state):
        state = state + x
        return self.proj(state), state


def test_mixer_without_a_prefill_hook_is_prefilled_by_steps():
    register_mixer("test-cumsum")(_Cumsum)
    try:
        torch.manual_seed(0)
        model = small_lm("test-cumsum", positional="sinusoidal")
        prompt = torch.randint(0, 29, (3, 7))
        logits, cache = model.prefill(prompt)
        assert_close("logits", logits, model(prompt))
        for layer, state in enumerate(cache.states):
            assert state.shape == (3, 15), f"layer {layer}"
        seq = prompt
        for _ in range(4):  # reference: a full forward per new token
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(model.generate(prompt, 4, temperature=0), seq)
    finally:
        _registry._MIXERS.pop("test-cumsum", None)


# ----------------------------------------------------------------------------- continuing a cache
def _chunked(model: TransformerLM, idx: torch.Tensor, sizes, cache=None):
    """``prefill`` the chunks of ``idx: (B, sum(sizes))`` one after the other, each continuing
    the cache of the one before: the logits ``(B, T, V)`` side by side and the last cache."""
    logits, start = [], 0
    for n in sizes:
        out, cache = model.prefill(idx[:, start : start + n], cache=cache)
        logits.append(out)
        start += n
    return torch.cat(logits, 1), cache


#: (mixer, config keywords) of the models whose continued prefill is checked
CONTINUED = [
    ("attention", dict(positional="learned")),
    ("attention", dict(positional="rotary", head_dim=6)),
    ("attention", dict(positional="none")),
    ("attention-naive", dict(positional="sinusoidal")),
    ("aft-full", {}),
    ("aft-decay", {}),
    ("aft-simple", {}),
    ("aft-local", {}),
    ("aft-conv", {}),
]
CONTINUED_IDS = [f"{n}-{kw.get('positional', 'learned')}" for n, kw in CONTINUED]


@pytest.mark.parametrize("sizes", [(7, 9), (5, 1, 1, 9)], ids=["7+9", "5+1+1+9"])
@pytest.mark.parametrize("name, kw", CONTINUED, ids=CONTINUED_IDS)
def test_prefill_continues_a_cache(name, kw, sizes):
    """``prefill(a)`` then ``prefill(b, cache=c)`` is ``prefill(a + b)``: logits, cache, the
    next step; chunks of one token included."""
    torch.manual_seed(len(sizes))
    model = small_lm(name, **kw)
    idx = torch.randint(0, 29, (3, sum(sizes)))
    with torch.no_grad():
        logits, cache = model.prefill(idx)
        got, got_cache = _chunked(model, idx, sizes)
        assert_close(f"{name}: chunked logits", got, logits)
        assert (got_cache.position, got_cache.batch_size) == (sum(sizes), 3)
        assert_same_state(f"{name}: chunked cache", got_cache.states, cache.states, torch.float64)
        nxt = torch.randint(0, 29, (3,))
        assert_close(f"{name}: next step", model.step(nxt, got_cache), model.step(nxt, cache))


#: models with no length limit: mixers and positions run any length (mixer, positional)
UNLIMITED = [
    ("attention", "none"),
    ("attention", "sinusoidal"),
    ("attention", "rotary"),
    ("aft-simple", "sinusoidal"),
    ("aft-decay", "none"),
    ("aft-conv", "none"),
]


@pytest.mark.parametrize("name, positional", UNLIMITED)
def test_unlimited_models_stream_past_max_seq_len(name, positional):
    """A model without a length limit continues its cache past ``max_seq_len``: equal to the
    same weights with a larger ``max_seq_len``, in one pass, and to stepping."""
    torch.manual_seed(3)
    kw = dict(positional=positional, head_dim=6 if positional == "rotary" else None)
    short = small_lm(name, max_seq_len=8, **kw)
    long = small_lm(name, max_seq_len=40, **kw)
    long.load_state_dict(short.state_dict())
    assert short.length_limit is None
    idx = torch.randint(0, 29, (2, 20))
    with torch.no_grad():
        got, cache = _chunked(short, idx, (6, 7, 7))  # positions 6 .. 19 lie past max_seq_len
        expected, long_cache = long.prefill(idx)
        assert_close(f"{name}: logits past max_seq_len", got, expected)
        assert_close(f"{name}: steps past max_seq_len", _steps(short, idx)[0], expected)
        nxt = torch.randint(0, 29, (2,))
        assert_close(f"{name}: step 20", short.step(nxt, cache), long.step(nxt, long_cache))


@pytest.mark.parametrize(
    "name, kw, source",
    [
        ("aft-simple", {}, "the learned positional table"),
        ("aft-full", dict(positional="sinusoidal"), "aft-full"),
        ("aft-local", dict(positional="sinusoidal"), "aft-local"),
    ],
)
def test_a_continued_prefill_past_the_limit_is_refused(name, kw, source):
    """Learned positions and a length-limited mixer stop at ``max_seq_len``: the error names
    the position and the limit, before anything ran (the cache is as it was)."""
    model = small_lm(name, max_seq_len=10, **kw)
    _, cache = model.prefill(torch.zeros(2, 6, dtype=torch.long))
    limit = (
        r"position 10 of 'idx' \(continuing 'cache' at position 6\) exceeds max_seq_len = 10, "
        rf"the limit of '{source}'"
    )
    with pytest.raises(ValueError, match=limit):
        model.prefill(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    assert cache.position == 6
    _, cache = model.prefill(torch.zeros(2, 4, dtype=torch.long), cache=cache)  # fills T_max
    assert cache.position == 10
    with pytest.raises(ValueError, match=r"position 10 .*max_seq_len"):
        model.step(torch.zeros(2, dtype=torch.long), cache)
    if source != "the learned positional table":  # the mixer alone: its own state's position
        mixer = model.backbone.blocks[0].mixer
        x = torch.randn(2, 11, 15, dtype=torch.float64)
        _, state = mixer.prefill(x[:, :6])
        with pytest.raises(ValueError, match=r"position 10 .*max_seq_len \(T_max\) = 10"):
            mixer.prefill(x[:, 6:], state)


def test_prefill_bad_cache():
    model = small_lm("aft-simple")
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="'cache' must be a DecodingCache, got list"):
        model.prefill(idx, cache=[])
    with pytest.raises(ValueError, match="'idx' has batch size 2 but 'cache' was made for"):
        model.prefill(idx, cache=model.init_cache(3))
    other = small_lm("attention").init_cache(2)  # another model's cache: named per layer
    with pytest.raises(TypeError, match=r"'cache.states\[0\]' must be a RunningSums"):
        model.prefill(idx, cache=other)


def _tensors_of(state) -> list[torch.Tensor]:
    """Every tensor of a state or cache (nested dataclasses and lists), in field order."""
    found: list[torch.Tensor] = []
    map_state(lambda t: found.append(t) or t, state)
    return found


@pytest.mark.parametrize(
    "name, kw",
    [
        pytest.param("attention", dict(positional="rotary", head_dim=6), id="attention"),
        pytest.param("aft-full", {}, id="aft-full"),
        pytest.param("aft-simple", {}, id="aft-simple"),
        pytest.param("aft-decay", {}, id="aft-decay"),
        pytest.param("aft-local", {}, id="aft-local"),
        pytest.param("aft-conv", {}, id="aft-conv"),
    ],
)
def test_gradients_flow_through_the_cache(name, kw):
    """A loss over both chunks' logits has the one-pass loss's parameter gradients (float64):
    training can carry a state from chunk to chunk; ``cache.detach()`` cuts the chain."""
    torch.manual_seed(4)
    model = small_lm(name, **kw)
    idx = torch.randint(0, 29, (2, 13))
    weights = torch.randn(2, 13, 29, dtype=torch.float64)
    names, params = zip(*model.named_parameters(), strict=True)

    def grads(logits):
        return torch.autograd.grad((logits.tanh() * weights).sum(), params, allow_unused=True)

    expected = grads(model(idx))
    logits, _ = _chunked(model, idx, (5, 8))
    for n, a, e in zip(names, grads(logits), expected, strict=True):
        assert_close(f"{name}: d{n}", a, e)
    first, cache = model.prefill(idx[:, :5])
    cut = cache.detach()
    pairs = list(zip(_tensors_of(cut), _tensors_of(cache), strict=True))
    assert pairs and any(t.requires_grad for _, t in pairs)
    for t_cut, t in pairs:  # the same storage, out of the graph
        assert not t_cut.requires_grad and t_cut.data_ptr() == t.data_ptr()
    rest, _ = model.prefill(idx[:, 5:], cache=cut)
    assert_close(f"{name}: logits from the detached cache", rest, logits[:, 5:])
    through, cut_off = (
        torch.autograd.grad(rest.square().sum(), model.backbone.token_embedding.weight)[0]
        for rest in (model.prefill(idx[:, 5:], cache=model.prefill(idx[:, :5])[1])[0], rest)
    )
    assert (through - cut_off).abs().max() > 1e-6, "detach() cut nothing"


class _InPlaceCumsum(_Cumsum):
    """:class:`_Cumsum` whose step adds into its state in place (no ``_prefill`` either)."""

    def _step(self, x, state):
        state.add_(x)  # the projection saved the previous step's state for its backward
        return self.proj(state), state


def test_a_mixer_stepping_in_place_is_continued_with_gradients():
    """The steps that continue a state of a mixer without a one-pass ``_prefill`` each get a
    copy of the state under autograd: the gradient is the one-pass one."""
    register_mixer("test-inplace-cumsum")(_InPlaceCumsum)
    try:
        torch.manual_seed(5)
        model = small_lm("test-inplace-cumsum", positional="sinusoidal")
        idx = torch.randint(0, 29, (2, 9))
        params = list(model.parameters())
        expected = torch.autograd.grad(model(idx).square().sum(), params)
        logits, cache = _chunked(model, idx, (4, 5))
        for i, (a, e) in enumerate(zip(torch.autograd.grad(logits.square().sum(), params),
                                       expected, strict=True)):
            assert_close(f"parameter {i}", a, e)
        assert cache.position == 9
    finally:
        _registry._MIXERS.pop("test-inplace-cumsum", None)
