"""A model's memory from its config (aftlab.models.memory): exact parameter counts, and models
too large for the machine refused before anything is built, in Python, the CLI and transformers."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from torch import nn

from aftlab import _system
from aftlab.cli import main
from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    get_mixer_class,
    register_mixer,
    unregister_mixer,
)
from aftlab.mixers.aft.common import AFTMixer
from aftlab.models import (
    PixelTransformer,
    TransformerClassifier,
    TransformerConfig,
    TransformerLM,
    memory,
)
from aftlab.models.memory import check_memory, estimate_memory, parameter_count
from aftlab.models.transformer import TransformerBackbone

from ..train.helpers import TINY, train_tiny, write_text

HUGE = 10**8  # blocks: hundreds of TB of parameters on any machine
SMALL = dict(vocab_size=11, d_model=16, n_heads=4, n_layers=2, max_seq_len=9)
#: per mixer, option sets that change its parameters (its defaults first)
OPTIONS = {
    "attention": [{}, {"head_dim": 6}],
    "attention-naive": [{}, {"head_dim": 6}],
    "aft-full": [{}, {"mixer_options": {"bias_rank": None}}, {"mixer_options": {"bias_rank": 3}}],
    "aft-local": [{}, {"mixer_options": {"bias_rank": None, "window": 2}}],
    "aft-conv": [{}, {"mixer_options": {"kernel_size": 5}}],
}
#: model fields that change the count around any mixer
VARIANTS = [
    {},
    {"bias": False, "tie_embeddings": False, "positional": "none", "norm": "none", "d_ff": 24},
    {"positional": "sinusoidal", "norm": "post", "final_norm": False},
    {"d_ff": 0},  # no feed-forward, and so no second norm
    {"d_ff": 0, "norm": "none"},
]


@pytest.fixture(autouse=True)
def _check_on(monkeypatch):
    monkeypatch.delenv("AFTLAB_MEMORY_CHECK", raising=False)


def _forbid_building(monkeypatch) -> None:
    """Building a backbone (every model's first tensor) fails the test: a refusal comes first."""

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(TransformerBackbone, "__init__", built)


@pytest.fixture
def nothing_built(monkeypatch):
    _forbid_building(monkeypatch)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head once


def _configs(mixer: str, **fields) -> list[TransformerConfig]:
    return [
        TransformerConfig(**{**SMALL, "mixer": mixer, **variant, **options, **fields})
        for options in OPTIONS.get(mixer, [{}])
        for variant in VARIANTS
    ]


@pytest.mark.parametrize("mixer", available_mixers())
def test_parameter_count_is_exact_for_every_registered_mixer(mixer):
    for cfg in _configs(mixer):
        assert parameter_count(cfg) == _count(TransformerLM(cfg)), cfg
        pixels = PixelTransformer(cfg, image_shape=(3, 3))
        assert parameter_count(cfg) + cfg.d_model == _count(pixels), cfg


@pytest.mark.parametrize(
    "mixer",
    [m for m in available_mixers() if issubclass(get_mixer_class(m), AFTMixer) and m != "rwkv4"],
)
def test_parameter_count_with_the_token_shift(mixer):
    """``token_shift=True`` adds the three mixes of ``d`` per block (rwkv4 always has them)."""
    shifted = TransformerConfig(**SMALL, mixer=mixer, mixer_options={"token_shift": True})
    assert parameter_count(shifted) == _count(TransformerLM(shifted))
    plain = TransformerConfig(**SMALL, mixer=mixer)
    assert parameter_count(shifted) - parameter_count(plain) == 3 * 16 * 2


@pytest.mark.parametrize(
    "mixer", [m for m in available_mixers() if not get_mixer_class(m).causal_only]
)
def test_parameter_count_of_a_classifier(mixer):
    options = {"mixer_options": {"kernel_size": 3, "grid": [3, 3]}} if mixer == "aft-conv" else {}
    for cfg in _configs(mixer, causal=False) + _configs(mixer, causal=False, **options):
        model = TransformerClassifier(cfg, num_classes=5)
        assert parameter_count(cfg, num_classes=5) == _count(model), cfg


def test_a_mixer_registered_elsewhere_is_counted_on_the_meta_device():
    @register_mixer("test-gated")
    class Gated(SequenceMixer):
        def __init__(self, *, width: int = 3, **common):
            super().__init__(**common)
            self.gate = nn.Linear(self.d_model, width * self.d_model)

    try:
        cfg = TransformerConfig(**SMALL, mixer="test-gated", mixer_options={"width": 5})
        assert parameter_count(cfg) == _count(TransformerLM(cfg))
        huge = TransformerConfig(**{**SMALL, "d_model": 2**20}, mixer="test-gated")
        assert parameter_count(huge) > 3 * 2**40  # counted, nothing allocated
    finally:
        unregister_mixer("test-gated")


def test_training_adds_gradients_moments_and_activations():
    cfg = TransformerConfig(**SMALL)
    n, B, T = parameter_count(cfg), 3, 5
    per_token = cfg.n_layers * (7 * cfg.d_model + 2 * cfg.resolved_d_ff) + cfg.d_model + 2 * 11
    weights = estimate_memory(cfg, dtype=torch.float32)
    assert weights == 4 * n + cfg.n_layers * memory.BLOCK_OVERHEAD
    trained = estimate_memory(cfg, dtype=torch.float32, batch_size=B, seq_len=T)
    assert trained == weights + 3 * 4 * n + B * T * per_token * 4
    half = estimate_memory(cfg, batch_size=B, seq_len=T, activation_dtype=torch.bfloat16)
    assert half == weights + 3 * 4 * n + B * T * per_token * 2


@pytest.mark.parametrize(
    "build",
    [
        lambda c: TransformerLM(c),
        lambda c: PixelTransformer(c, image_shape=(3, 3)),
        lambda c: TransformerClassifier(
            TransformerConfig(**{**c.to_dict(), "causal": False}), num_classes=4
        ),
    ],
    ids=["lm", "pixels", "classifier"],
)
@pytest.mark.parametrize("field", ["n_layers", "d_model"])
def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(
    build, field, nothing_built
):
    cfg = TransformerConfig(**{**SMALL, "n_heads": 1, field: HUGE})
    with pytest.raises(ValueError, match="needs at least [0-9,.]+ GiB, more than the") as e:
        build(cfg)  # before anything is built: nothing_built fails the test otherwise
    message = str(e.value)
    assert (
        "\n" not in message and f"parameters in torch.float32, {cfg.n_layers:,} blocks" in message
    )
    assert "AFTLAB_MEMORY_CHECK=0" in message


def test_the_check_compares_with_the_memory_available_and_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: (2**20, "a test's"))
    cfg = TransformerConfig(**{**SMALL, "d_model": 256, "n_heads": 4})  # 6 MiB of weights
    needed = _system.format_bytes(estimate_memory(cfg))
    expected = f"needs at least {needed}, more than the 1 MiB available (a test's)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        TransformerLM(cfg)
    monkeypatch.setenv("AFTLAB_MEMORY_CHECK", "0")
    assert _count(TransformerLM(cfg)) == parameter_count(cfg)
    check_memory("here", 2**40, "anything")  # switched off: nothing raised


def test_available_memory_honours_ulimit_v(monkeypatch):
    size = _system.proc_bytes("self/status", "VmSize")
    if not size:
        pytest.skip("needs /proc/self/status")
    monkeypatch.setattr(_system.resource, "getrlimit", lambda which: (size + 2**20, -1))
    free, source = _system.available_memory("cpu")
    assert free <= 2**20 and source == "what ulimit -v leaves"


@pytest.mark.parametrize("size", [2**63, 10**22])
@pytest.mark.parametrize("field", ["d_model", "n_layers", "d_ff", "max_seq_len"])
def test_a_size_no_tensor_can_have_is_refused_by_the_config(field, size):
    kind = "non-negative" if field == "d_ff" else "positive"  # d_ff = 0: no feed-forward
    with pytest.raises(ValueError, match=f"'{field}' must be a {kind} int below 2\\*\\*63"):
        TransformerConfig(**{**SMALL, field: size})


# --------------------------------------------------------------------------- CLI


def _one_line(err: str, *patterns: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aftlab: error: "), lines
    for pattern in patterns:
        assert pattern in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "setting, expected",
    [
        (f"model.n_layers={HUGE}", "needs at least"),
        ("batch_size=1000000000000", "micro-batches of 1000000000000 x 16 tokens"),
        ("model.d_model=10000000000000000000000", "'d_model' must be a positive int below 2**63"),
    ],
)
def test_train_refuses_what_cannot_fit(setting, expected, tmp_path, capsys, nothing_built):
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(out), *TINY, "--set", setting]
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err, expected)
    if "needs" in expected:
        assert "config: training this model" in line and "AFTLAB_MEMORY_CHECK=0" in line
    assert not out.exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("memory"), 1)


def _with_layers(run, dest, n_layers: int):
    """A copy of ``run`` whose newest config.json asks for ``n_layers``, its manifest matching."""
    shutil.copytree(run, dest)
    ckpt = sorted((dest / "checkpoints").iterdir())[-1]
    saved = json.loads((ckpt / "config.json").read_text())
    saved["model"]["n_layers"] = n_layers
    raw = json.dumps(saved).encode()
    (ckpt / "config.json").write_bytes(raw)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["config.json"] = {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "bytes": len(raw),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_a_stored_config_too_large_is_refused_before_it_is_built(
    command, trained, tmp_path, capsys, nothing_built
):
    if command == "export":
        pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")
    run = _with_layers(trained, tmp_path / "run", HUGE)
    capsys.readouterr()
    argv = [command, str(run)] + ([str(tmp_path / "hf")] if command == "export" else [])
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err, "cannot build the model: TransformerLM: the model")
    assert f"{HUGE:,} blocks) needs at least" in line
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- transformers


def test_hf_from_pretrained_refuses_a_config_too_large_at_once(tmp_path, monkeypatch):
    hf = pytest.importorskip("aftlab.hf", reason="the hf extra (transformers) is missing")
    from transformers import AutoModelForCausalLM

    small = hf.AftlabConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_seq_len=8)
    hf.AftlabForCausalLM(small).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "n_layers": HUGE}))
    _forbid_building(monkeypatch)
    for load in (
        lambda: AutoModelForCausalLM.from_pretrained(tmp_path),
        lambda: hf.AftlabForCausalLM(hf.AftlabConfig(n_layers=HUGE)),
    ):
        with pytest.raises(ValueError, match=f"TransformerLM: the model .*{HUGE:,} blocks"):
            load()  # at once: _forbid_building fails the test if a block is built
