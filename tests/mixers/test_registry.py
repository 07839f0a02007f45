"""The mixer registry: lookup errors, duplicate and invalid registrations, option errors, and a
mixer added by its class alone.

Throwaway mixers are registered under unique names and removed with ``unregister_mixer``
afterwards, so no global state leaks into other tests.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
    unregister_mixer,
)
from aftlab.models import TransformerConfig, TransformerLM


@contextlib.contextmanager
def _temporary_name(name: str):
    assert name not in available_mixers()
    try:
        yield name
    finally:
        if name in available_mixers():
            unregister_mixer(name)


def _limited(name: str) -> bool:
    return get_mixer_class(name).length_limited


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


@pytest.mark.parametrize("name", [n for n in available_mixers() if not _limited(n)])
def test_mixers_without_a_position_table_take_any_length(name):
    m = build_mixer(name, d_model=8, n_heads=2, causal=True, max_seq_len=4)
    assert not m.length_limited
    assert m(torch.randn(1, 9, 8)).shape == (1, 9, 8)


@pytest.mark.parametrize("name", [n for n in available_mixers() if _limited(n)])
def test_mixers_with_a_position_table_refuse_longer_inputs(name):
    m = build_mixer(name, d_model=8, n_heads=2, causal=True, max_seq_len=4)
    assert m.length_limited
    with pytest.raises(
        ValueError, match=r"sequence length 9 of 'x' exceeds max_seq_len \(T_max\) = 4"
    ):
        m(torch.randn(1, 9, 8))


def test_unregister_mixer():
    with _temporary_name("zz-test-unregister") as name:
        cls = register_mixer(name)(_identity_class())
        assert unregister_mixer(name) is cls
        assert name not in available_mixers()
        with pytest.raises(ValueError, match=re.escape(f"unknown mixer {name!r}")):
            unregister_mixer(name)


class _ToyRunningMean(SequenceMixer):
    """A toy mixer written as a user would: ``y_t = W (g / t) sum_{t' <= t} x_t'`` (causal), or
    the mean over all real tokens (non-causal). Only the class: the hooks and one option."""

    def __init__(self, *, gain: float = 1.0, **common) -> None:
        super().__init__(**common)
        self.gain = gain
        self.proj = nn.Linear(self.d_model, self.d_model, bias=self.bias)

    def _forward(self, x, padding_mask):
        m = x.new_ones(x.shape[:2]) if padding_mask is None else padding_mask.to(x.dtype)
        num, den = (x * m[..., None]), m[..., None]
        if self.causal:
            num, den = num.cumsum(1), den.cumsum(1)
        else:
            num, den = num.sum(1, keepdim=True), den.sum(1, keepdim=True)
        return self.proj(self.gain * num / den.clamp(min=1)).expand_as(x)

    def _init_state(self, batch_size, device, dtype):
        return {"sum": torch.zeros(batch_size, self.d_model, device=device, dtype=dtype), "n": 0}

    def _step(self, x, state):
        state = {"sum": state["sum"] + x, "n": state["n"] + 1}
        return self.proj(self.gain * state["sum"] / state["n"]), state


@pytest.fixture
def toy():
    with _temporary_name("toy") as name:
        register_mixer(name)(_ToyRunningMean)
        yield name


def test_a_mixer_class_is_all_a_model_needs(toy):
    """Registered by its class alone, the toy mixer trains and generates in a TransformerLM."""
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=11,
        d_model=16,
        n_layers=2,
        n_heads=2,
        max_seq_len=12,
        mixer=toy,
        mixer_options={"gain": 0.5},
    )
    model = TransformerLM(config)
    mixers = [block.mixer for block in model.backbone.blocks]
    assert all(isinstance(m, _ToyRunningMean) for m in mixers)
    assert [(m.gain, m.d_model, m.n_heads, m.causal) for m in mixers] == [(0.5, 16, 2, True)] * 2

    data = (torch.randint(0, 11, (8, 1)) + torch.arange(10)) % 11  # x_{t+1} = x_t + 1 mod 11
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        for m in mixers:
            assert m.proj.weight.grad is not None and m.proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

    model.eval()
    prompt = data[:2, :3]
    out = model.generate(prompt, 5, temperature=0)  # prefill by steps, then the step hook
    assert out.shape == (2, 8) and torch.equal(out[:, :3], prompt)
    greedy = model(out[:, :-1]).argmax(-1)[:, 2:]  # the forward hook's choice at each step
    assert torch.equal(out[:, 3:], greedy)


def test_base_init_state_defaults_and_guards(toy):
    mixer = build_mixer(toy, d_model=8, causal=True).double()
    state = mixer.init_state(3)
    assert (state["sum"].shape, state["sum"].dtype) == ((3, 8), torch.float64)
    assert mixer.init_state(1, dtype=torch.float32)["sum"].dtype == torch.float32
    with pytest.raises(ValueError, match="'batch_size' must be > 0, got 0"):
        mixer.init_state(0)
    with pytest.raises(RuntimeError, match="init_state\\(\\) needs a causal mixer"):
        build_mixer(toy, d_model=8).init_state(2)
    with pytest.raises(RuntimeError, match="step\\(\\) needs a causal mixer"):
        build_mixer(toy, d_model=8).step(torch.zeros(2, 8), None)


def test_a_registered_class_is_the_only_edit_the_lists_need(toy):
    """``aftlab compare``'s defaults, the bench's cases and the contract and prefill suites all
    derive from the registry: a mixer registered by its class alone is in each of them."""
    from aftlab.bench import cases
    from aftlab.train.compare import default_mixers

    assert toy in default_mixers() and toy in cases()
    assert "attention-naive" not in default_mixers()  # a reference: SequenceMixer.reference
    root = Path(__file__).resolve().parents[2]
    suites = ["tests/mixers/test_contract.py", "tests/models/test_prefill.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "tests.mixers.toy_plugin", "-k", "zz-toy-plugin", *suites],
        cwd=root, capture_output=True, text=True, timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 20 and "failed" not in summary, summary


def test_config_options_name_known_values():
    """A mixer's ``config_options`` are names of ``CONFIG_OPTIONS``; another name is refused."""
    from aftlab.models.blocks import CONFIG_OPTIONS, mixer_from_config

    for name in available_mixers():
        assert set(get_mixer_class(name).config_options) <= set(CONFIG_OPTIONS), name
    with _temporary_name("zz-test-options") as name:
        cls = register_mixer(name)(type("Odd", (_identity_class(),), {"config_options": ("x",)}))
        assert cls.config_options == ("x",)
        config = TransformerConfig(vocab_size=5, d_model=8, n_layers=1, n_heads=2, mixer=name)
        with pytest.raises(ValueError, match=r"config_options \['x'\] are not config options"):
            mixer_from_config(config)
