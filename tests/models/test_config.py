"""TransformerConfig and RWKV4Config: JSON round trips, derived sizes, every validation error;
model_config_from_dict."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from aftlab.models import RWKV4Config, TransformerConfig
from aftlab.models.config import ARCHITECTURES, model_config_from_dict


def _custom() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=50,
        d_model=48,
        n_layers=3,
        n_heads=3,
        head_dim=16,
        d_ff=100,
        max_seq_len=77,
        mixer="aft-local",
        mixer_options={"window": 8, "nested": {"a": [1, 2]}},
        causal=False,
        norm="post",
        activation="relu",
        positional="sinusoidal",
        scaled=False,
        dropout=0.25,
        bias=False,
        tie_embeddings=False,
        layer_norm_eps=1e-6,
        final_norm=False,
        init="torch",
    )


def test_custom_config_differs_from_defaults_in_every_field():
    # so that the round trips below would notice a field that is dropped or reset
    default, custom = TransformerConfig(), _custom()
    for f in dataclasses.fields(TransformerConfig):
        assert getattr(default, f.name) != getattr(custom, f.name), f.name


@pytest.mark.parametrize("make", [TransformerConfig, _custom])
def test_dict_json_round_trip(make):
    cfg = make()
    data = cfg.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(TransformerConfig)}
    back = TransformerConfig.from_dict(json.loads(json.dumps(data)))
    assert back == cfg
    assert back.to_dict() == data


def test_to_json_from_json_round_trip():
    cfg = _custom()
    text = cfg.to_json()
    assert json.loads(text)["mixer_options"] == {"window": 8, "nested": {"a": [1, 2]}}
    assert TransformerConfig.from_json(text) == cfg


def test_to_dict_is_a_copy():
    cfg = _custom()
    data = cfg.to_dict()
    data["mixer_options"]["window"] = 999
    assert cfg.mixer_options["window"] == 8


def test_defaults_resolution():
    cfg = TransformerConfig(d_model=96, n_heads=3)
    assert cfg.head_dim is None and cfg.d_ff is None
    assert cfg.resolved_head_dim == 32
    assert cfg.resolved_d_ff == 4 * 96
    explicit = TransformerConfig(d_model=96, n_heads=5, head_dim=7, d_ff=11)
    assert explicit.resolved_head_dim == 7
    assert explicit.resolved_d_ff == 11


def test_n_heads_need_not_divide_d_model_when_head_dim_given():
    assert TransformerConfig(d_model=10, n_heads=3, head_dim=4).resolved_head_dim == 4


BAD = [
    ("vocab_size", 0),
    ("d_model", -4),
    ("n_layers", True),
    ("n_heads", 0),
    ("max_seq_len", "1024"),
    ("max_seq_len", 2.0),
    ("head_dim", 0),
    ("head_dim", 1.5),
    ("d_ff", -1),
    ("d_ff", 2.0),
    ("d_ff", 0.0),
    ("d_ff", False),
    ("norm", "sandwich"),
    ("activation", "swish"),
    ("positional", "alibi"),
    ("init", "xavier"),
    ("mixer", 3),
    ("mixer_options", ["window", 8]),
    ("dropout", 1.0),
    ("dropout", -0.1),
    ("layer_norm_eps", 0.0),
    ("dropout", "abc"),
    ("dropout", None),
    ("layer_norm_eps", "1e-5"),
    ("mixer_options", {"window": object}),
    ("causal", 1),
    ("scaled", "yes"),
    ("tie_embeddings", None),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_validation_names_the_field(field, value):
    prefix = f"TransformerConfig: '{field}' must be"
    with pytest.raises(ValueError, match=re.escape(prefix)) as info:
        TransformerConfig(**{field: value})
    assert repr(value) in str(info.value)  # the received value is shown


def test_n_heads_not_dividing_d_model():
    with pytest.raises(ValueError, match=r"'n_heads' must be a divisor of d_model=10.*got 3"):
        TransformerConfig(d_model=10, n_heads=3)


def test_from_dict_rejects_unknown_fields_and_non_dicts():
    data = TransformerConfig().to_dict() | {"n_layer": 2, "zz": 1}
    with pytest.raises(ValueError, match=re.escape("unknown field(s) ['n_layer', 'zz']")) as info:
        TransformerConfig.from_dict(data)
    assert "n_layers" in str(info.value)  # lists the known fields
    with pytest.raises(TypeError, match="expected a dict, got list"):
        TransformerConfig.from_dict([("d_model", 8)])


def test_from_dict_validates_values():
    data = TransformerConfig().to_dict() | {"norm": "middle"}
    with pytest.raises(ValueError, match="'norm' must be one of"):
        TransformerConfig.from_dict(data)


def test_from_dict_partial_uses_defaults():
    cfg = TransformerConfig.from_dict({"d_model": 32, "n_heads": 2})
    assert cfg.d_model == 32 and cfg.n_layers == TransformerConfig().n_layers


# --------------------------------------------------------------------------- RWKV4Config
def _rwkv4() -> RWKV4Config:
    return RWKV4Config(
        vocab_size=99, d_model=32, n_layers=7, d_ff=37, max_seq_len=77, layer_norm_eps=1e-6,
        rescale_every=0, tie_embeddings=True,
    )  # fmt: skip


def test_rwkv4_config_round_trips():
    cfg = _rwkv4()
    defaults = RWKV4Config()
    # every field differs from its default, so a dropped or reset field would show
    for f in dataclasses.fields(RWKV4Config):
        assert getattr(cfg, f.name) != getattr(defaults, f.name), f.name
    data = cfg.to_dict()
    assert data["architecture"] == "rwkv4"
    assert RWKV4Config.from_dict(data) == cfg
    assert RWKV4Config.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json()) == data
    assert (cfg.resolved_d_ff, defaults.resolved_d_ff) == (37, 4 * defaults.d_model)


RWKV4_BAD = [
    ("vocab_size", 0),
    ("d_model", 2.5),
    ("n_layers", True),
    ("max_seq_len", -1),
    ("d_ff", 0),
    ("rescale_every", -1),
    ("rescale_every", 1.0),
    ("layer_norm_eps", 0.0),
    ("layer_norm_eps", "1e-5"),
    ("tie_embeddings", 1),
]


@pytest.mark.parametrize("field,value", RWKV4_BAD, ids=[f"{f}={v!r}" for f, v in RWKV4_BAD])
def test_rwkv4_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=re.escape(f"RWKV4Config: '{field}' must be")) as info:
        RWKV4Config(**{field: value})
    assert repr(value) in str(info.value)


def test_rwkv4_config_from_dict_refusals():
    with pytest.raises(ValueError, match=re.escape("unknown field(s) ['n_heads']")):
        RWKV4Config.from_dict({"n_heads": 2})
    with pytest.raises(ValueError, match="'architecture' must be 'rwkv4', got 'transformer'"):
        RWKV4Config.from_dict({"architecture": "transformer"})
    with pytest.raises(TypeError, match="expected a dict, got list"):
        RWKV4Config.from_dict([])


def test_model_config_from_dict_dispatches_on_architecture():
    assert model_config_from_dict(_rwkv4().to_dict()) == _rwkv4()
    tc = TransformerConfig(d_model=32, n_heads=2)
    assert model_config_from_dict(tc.to_dict()) == tc  # no "architecture": a TransformerConfig
    assert model_config_from_dict({**tc.to_dict(), "architecture": "transformer"}) == tc
    assert set(ARCHITECTURES) == {"transformer", "rwkv4"}
    with pytest.raises(ValueError, match=r"'architecture' must be one of \['rwkv4', "
                                         r"'transformer'\], got 'mamba'"):  # fmt: skip
        model_config_from_dict({"architecture": "mamba"})
    with pytest.raises(TypeError, match="expected a dict"):
        model_config_from_dict(None)
