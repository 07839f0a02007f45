"""The mixer registry: lookup errors, duplicate and invalid registrations, option errors.

Throwaway mixers are registered under unique names and removed from
``aftlab.mixers.registry._MIXERS`` afterwards, so no global state leaks into other tests.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
)
from aftlab.mixers import registry as registry_module


@contextlib.contextmanager
def _temporary_name(name: str):
    assert name not in registry_module._MIXERS
    try:
        yield name
    finally:
        registry_module._MIXERS.pop(name, None)


def _identity_class():
    class _Identity(SequenceMixer):
        def __init__(self, *, scale: float = 1.0, **common):
            super().__init__(**common)
            self.scale = scale

        def forward(self, x, *, padding_mask=None):
            x, _ = self._check_input(x, padding_mask)
            return x * self.scale

    return _Identity


def test_unknown_name_lists_known_names():
    with _temporary_name("zz-test-known"):
        register_mixer("zz-test-known")(_identity_class())
        with pytest.raises(ValueError, match=re.escape("unknown mixer 'no-such-mixer'")) as info:
            build_mixer("no-such-mixer", d_model=8)
        message = str(info.value)
        assert "zz-test-known" in message
        for name in available_mixers():
            assert repr(name) in message
        with pytest.raises(ValueError, match="unknown mixer"):
            get_mixer_class(["unhashable"])


def test_register_and_build():
    with _temporary_name("zz-test-build") as name:
        cls = register_mixer(name)(_identity_class())
        assert cls.name == name
        assert name in available_mixers()
        assert available_mixers() == sorted(available_mixers())
        assert get_mixer_class(name) is cls
        mixer = build_mixer(name, d_model=8, n_heads=2, causal=True, scale=3.0)
        assert isinstance(mixer, cls)
        assert (mixer.d_model, mixer.n_heads, mixer.causal, mixer.scale) == (8, 2, True, 3.0)
        x = torch.randn(2, 5, 8)
        assert torch.equal(mixer(x), 3 * x)
    assert name not in available_mixers()


def test_register_duplicate_name_rejected():
    with _temporary_name("zz-test-dup") as name:
        first = register_mixer(name)(_identity_class())
        assert register_mixer(name)(first) is first  # the same class again is harmless
        other = _identity_class()
        taken = f"name {name!r} is already taken by _Identity"
        with pytest.raises(ValueError, match=re.escape(taken)):
            register_mixer(name)(other)
        assert get_mixer_class(name) is first


def test_register_non_mixer_rejected():
    with _temporary_name("zz-test-not-a-mixer") as name:

        class NotAMixer(torch.nn.Module):
            pass

        with pytest.raises(TypeError, match="is not a SequenceMixer subclass"):
            register_mixer(name)(NotAMixer)
        with pytest.raises(TypeError, match="is not a SequenceMixer subclass"):
            register_mixer(name)(lambda x: x)
        assert name not in available_mixers()


def test_unknown_option_names_the_mixer():
    with _temporary_name("zz-test-options") as name:
        register_mixer(name)(_identity_class())
        with pytest.raises(ValueError, match=re.escape(f"mixer {name!r}")) as info:
            build_mixer(name, d_model=8, windw=3)
        assert "windw" in str(info.value)


def test_common_argument_validation_reaches_the_user():
    with _temporary_name("zz-test-args") as name:
        register_mixer(name)(_identity_class())
        with pytest.raises(ValueError, match="'d_model' must be > 0, got 0"):
            build_mixer(name, d_model=0)
        with pytest.raises(ValueError, match=re.escape("'dropout' must be in [0, 1), got 1.5")):
            build_mixer(name, d_model=8, dropout=1.5)


@pytest.mark.parametrize("name", ["attention", "aft-simple", "aft-conv", "aft-decay"])
def test_mixers_without_a_position_table_take_any_length(name):
    m = build_mixer(name, d_model=8, n_heads=2, causal=True, max_seq_len=4)
    assert not m.length_limited
    assert m(torch.randn(1, 9, 8)).shape == (1, 9, 8)


@pytest.mark.parametrize("name", ["aft-full", "aft-local"])
def test_mixers_with_a_position_table_refuse_longer_inputs(name):
    m = build_mixer(name, d_model=8, n_heads=2, causal=True, max_seq_len=4)
    assert m.length_limited
    with pytest.raises(
        ValueError, match=r"sequence length 9 of 'x' exceeds max_seq_len \(T_max\) = 4"
    ):
        m(torch.randn(1, 9, 8))
