"""Decoding states are checked by type, shape, dtype and device before a step, for every mixer.

A state of another mixer, of a mixer of another size, of another batch size or device, and an
integer ``dtype`` for ``init_state``/``init_cache`` get an error naming the argument (``state``,
``cache``, ``dtype``) and what was expected, not an error from inside the step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aftlab.mixers import available_mixers, build_mixer, get_mixer_class
from aftlab.models import TransformerConfig, TransformerLM

#: every registered mixer (all of them decode)
NAMES = available_mixers()
D, H = 12, 3
NOT_FLOAT = "'dtype' must be a floating-point torch.dtype, got torch.int64"


def _mixer(name: str, d_model: int = D):
    opts = get_mixer_class(name).test_options
    return build_mixer(name, d_model=d_model, n_heads=H, causal=True, max_seq_len=24, **opts)


def _x(batch_size: int = 2) -> torch.Tensor:
    return torch.randn(batch_size, D)


@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_mixer_is_refused(name):
    m = _mixer(name)
    own = type(m.init_state(2)).__name__
    others = {type(s).__name__: s for s in (_mixer(n).init_state(2) for n in NAMES)}
    others.pop(own)
    assert {"KVCache", "RunningSums"} & set(others)  # AFTDecay.step given a KVCache, among them
    for kind, state in others.items():
        with pytest.raises(TypeError, match=rf"'state' must be a {own}, got {kind}$"):
            m.step(_x(), state)


def test_band_states_name_their_type_and_their_layout():
    """aft-local and aft-conv both decode on the op's BandState: a scan state is refused by
    type, and the other mixer's BandState by the field whose layout differs."""
    local, conv = _mixer("aft-local"), _mixer("aft-conv")
    for m in (local, conv):
        assert type(m.init_state(2)).__name__ == "BandState"
        with pytest.raises(TypeError, match=r"'state' must be a BandState, got RunningSums$"):
            m.step(_x(), _mixer("aft-simple").init_state(2))
    wrong = r"'state\.gone\.a' must have \d dimensions \({}\), got \d with shape \({}\)"
    with pytest.raises(ValueError, match=wrong.format("2, 12", "2, 3, 4")):
        local.step(_x(), conv.init_state(2))
    with pytest.raises(ValueError, match=wrong.format("2, 3, 4", "2, 12")):
        conv.step(_x(), local.init_state(2))


@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_size_is_refused(name):
    m = _mixer(name)
    with pytest.raises(ValueError, match=r"'state\.[\w.]+' must have shape \(2, .*\), got \(2, "):
        m.step(_x(), _mixer(name, d_model=15).init_state(2))


@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_batch_size_or_device_is_refused(name):
    m = _mixer(name)
    with pytest.raises(ValueError, match="'x' has batch size 2 but 'state' was made for 3"):
        m.step(_x(), m.init_state(3))
    with pytest.raises(ValueError, match=r"'state\.[\w.]+' is on meta but 'x' is on cpu"):
        m.step(_x(), m.init_state(2, device="meta"))


@pytest.mark.parametrize("name", NAMES)
def test_a_state_tensor_of_an_integer_dtype_is_refused(name):
    m = _mixer(name)
    state = m.init_state(2)
    fields = dataclasses.fields(state)
    field = next(f.name for f in fields if torch.is_tensor(getattr(state, f.name)))
    setattr(state, field, getattr(state, field).long())
    with pytest.raises(TypeError, match=rf"'state\.{field}' must be a floating-point tensor"):
        m.step(_x(), state)


@pytest.mark.parametrize("name", NAMES)
def test_init_state_refuses_an_integer_dtype(name):
    with pytest.raises(ValueError, match=NOT_FLOAT):
        _mixer(name).init_state(2, dtype=torch.int64)


@pytest.mark.parametrize("name", NAMES)
def test_a_valid_state_still_decodes(name):
    m = _mixer(name).eval()
    state = m.init_state(2)
    with torch.no_grad():
        for _ in range(20):  # past the ring buffers and the key-value cache's first capacity
            y, state = m.step(_x(), state)
    assert y.shape == (2, D) and torch.isfinite(y).all()


def _lm(**kw) -> TransformerLM:
    base = dict(vocab_size=20, d_model=D, n_layers=2, n_heads=H, max_seq_len=16, mixer="aft-decay")
    return TransformerLM(TransformerConfig(**{**base, **kw})).eval()


def test_the_model_checks_a_cache_of_another_model():
    lm, tokens = _lm(), torch.zeros(2, dtype=torch.long)
    with pytest.raises(
        ValueError, match="'cache' holds 3 layer states but the model has n_layers=2"
    ):
        lm.step(tokens, _lm(n_layers=3).init_cache(2))
    with pytest.raises(ValueError, match=r"'cache\.states\[0\]\.a' must have shape \(2, 12\)"):
        lm.step(tokens, _lm(d_model=15).init_cache(2))
    with pytest.raises(TypeError, match=r"'cache\.states\[0\]' must be a RunningSums, got KVCache"):
        lm.step(tokens, _lm(mixer="attention").init_cache(2))
    with pytest.raises(ValueError, match=f"TransformerLM: {NOT_FLOAT}"):
        lm.init_cache(2, dtype=torch.int64)


def test_states_the_check_cannot_describe_pass_it():
    """A plugin state with a field filled on a later step, or an ``_init_state`` that cannot run
    on the meta device, is not refused by the check (its own step is the judge)."""
    from dataclasses import dataclass, field

    from aftlab.mixers import SequenceMixer

    @dataclass
    class Lazy:
        n: torch.Tensor
        h: torch.Tensor | None = field(default=None)

    class LazyMixer(SequenceMixer):
        def _init_state(self, batch_size, device, dtype):
            return Lazy(torch.zeros(batch_size, device=device, dtype=dtype))

        def _step(self, x, state):
            state.h = x if state.h is None else state.h + x
            return state.h, state

    class DataReading(LazyMixer):
        def _init_state(self, batch_size, device, dtype):
            scale = torch.ones((), device=device).item()  # fails on the meta device
            return Lazy(scale * torch.zeros(batch_size, device=device, dtype=dtype))

    for cls in (LazyMixer, DataReading):
        m = cls(d_model=D, causal=True)
        state = m.init_state(2)
        for _ in range(3):
            y, state = m.step(_x(), state)
        assert y.shape == (2, D) and state.h is not None
        if cls is LazyMixer:  # the described parts are still checked
            with pytest.raises(TypeError, match="'state' must be a Lazy"):
                m.step(_x(), object())
