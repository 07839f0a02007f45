"""One-pass prefill: the decoding state from one parallel pass equals ``T`` decoding steps."""

from __future__ import annotations

import collections
import dataclasses
import sys

import pytest
import torch
from torch import nn

from aftlab import _checks
from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
)
from aftlab.mixers import registry as _registry
from aftlab.models import PixelTransformer, TransformerConfig, TransformerLM
from aftlab.testing import assert_close

#: every registered mixer that decodes (aft-decay included; none is non-causal only)
CAUSAL_MIXERS = available_mixers()
LENGTHS = [1, 7, 33]
#: mixers with a ``T_max`` position table
LENGTH_LIMITED = [n for n in CAUSAL_MIXERS if get_mixer_class(n).length_limited]


def _small(name: str) -> dict:
    """The mixer's ``test_options``: small windows and kernels, ring buffers wrap in a prompt."""
    return dict(get_mixer_class(name).test_options)


def _lm(name: str, **kw) -> TransformerLM:
    """A float64 LM (odd sizes) with every parameter perturbed: biases, kernels, decays move."""
    base = dict(vocab_size=29, d_model=15, n_layers=2, n_heads=3, max_seq_len=40)
    cfg = TransformerConfig(**{**base, "mixer": name, "mixer_options": _small(name), **kw})
    model = TransformerLM(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _steps(model: TransformerLM, idx: torch.Tensor):
    """The token-by-token path: ``(B, T, V)`` logits and the cache after ``T`` steps."""
    cache = model.init_cache(idx.shape[0])
    logits = [model.step(idx[:, t], cache) for t in range(idx.shape[1])]
    return torch.stack(logits, 1), cache


def _assert_same_state(where: str, got, expected, precision: torch.dtype) -> None:
    """Every field of two mixer states (dataclasses, nested ones too) equal: tensors within the
    tolerance of ``precision``, the dtype of the model that computed them (a float64 field of a
    float32 model holds float32 sums, whose last bits depend on the CPU's summation order)."""
    assert type(got) is type(expected), f"{where}: {type(got).__name__}"
    for f in dataclasses.fields(expected):
        a, e = getattr(got, f.name), getattr(expected, f.name)
        if dataclasses.is_dataclass(e):
            _assert_same_state(f"{where}: {f.name}", a, e, precision)
        elif isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype, f"{where}: {f.name} dtype {a.dtype} != {e.dtype}"
            assert_close(f"{where}: {f.name}", a, e, precision=precision)
        else:
            assert a == e, f"{where}: {f.name} = {a!r}, expected {e!r}"


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
        _assert_same_state(f"{where}, layer {layer}", got, expected, dtype)
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
    _check_prefill(_lm(name), T, f"{name}, T={T}")


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
    ],
    ids=["local-w0", "local-w40", "local-full-bias", "conv-k8", "full-full-bias", "rotary",
         "naive-post-ln"],
)
@pytest.mark.parametrize("T", [7, 33])
def test_prefill_state_equals_steps_variants(name, kw, T):
    torch.manual_seed(T)
    _check_prefill(_lm(name, **kw), T, f"{name} {kw}, T={T}")


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_greedy_generate_unchanged_by_prefill(name, T):
    torch.manual_seed(100 + T)
    model = _lm(name)
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
    _assert_same_state(name, state, steps, dtype)


@pytest.mark.parametrize("name", LENGTH_LIMITED)
def test_length_limited_mixers_refuse_overflow(name):
    model = _lm(name, max_seq_len=10, positional="sinusoidal")
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
    model = _lm("aft-simple", max_seq_len=10)
    limit = "the limit of 'the learned positional table'"
    with pytest.raises(ValueError, match=rf"sequence length 11 of 'idx' .* = 10, {limit}"):
        model.prefill(torch.zeros(1, 11, dtype=torch.long))


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_logits_to_keep_gives_the_last_rows(name):
    """``prefill(idx, logits_to_keep=n)``: the last ``n`` rows of the full logits, same cache."""
    torch.manual_seed(2)
    model = _lm(name)
    idx = torch.randint(0, 29, (3, 9))
    full, cache = model.prefill(idx)
    for n in (1, 4, 9):
        last, last_cache = model.prefill(idx, logits_to_keep=n)
        assert_close(f"{name}: prefill logits_to_keep={n}", last, full[:, -n:])
        assert_close(f"{name}: forward logits_to_keep={n}", model(idx, logits_to_keep=n), last)
        for layer, (a, e) in enumerate(zip(last_cache.states, cache.states, strict=True)):
            _assert_same_state(f"{name}, layer {layer}", a, e, torch.float64)
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
    model = _lm(name)
    idx = torch.randint(0, 29, (3, 6))
    counts = _count_checks(monkeypatch)
    _, cache = model.prefill(idx)
    assert counts == {"check_tokens": 1}, f"{name}: prefill: {dict(counts)}"
    counts.clear()
    model.step(idx[:, 0], cache)
    assert counts == {"check_tokens": 1, "check_state": 2}, f"{name}: step: {dict(counts)}"
    counts.clear()
    model.backbone.blocks[0].mixer.prefill(torch.randn(3, 6, 15, dtype=torch.float64))
    assert counts == {"check_tensor": 1}, f"{name}: mixer prefill: {dict(counts)}"


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_prefill_bad_input(name):
    m = build_mixer(name, d_model=15, n_heads=3, causal=True, max_seq_len=40)
    x = torch.randn(2, 5, 15)
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_state'"):
        m(x, return_state=True)  # one spelling of a prefill: prefill(x)
    y, state = m.prefill(x[:, :0])  # an empty prompt: the empty state, as init_state gives
    assert y.shape == (2, 0, 15)
    _assert_same_state(name, state, m.init_state(2), torch.float32)
    with pytest.raises(ValueError, match=r"'x' must have shape \(\*, \*, 15\), got \(2, 5, 14\)"):
        m.prefill(torch.randn(2, 5, 14))
    if not get_mixer_class(name).causal_only:
        bidir = build_mixer(name, d_model=15, n_heads=3, causal=False, max_seq_len=40)
        with pytest.raises(RuntimeError, match=r"prefill\(\) needs a causal mixer"):
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
        model = _lm("test-cumsum", positional="sinusoidal")
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
