import pytest

from aftlab.train.config import TrainConfig, apply_overrides, load_config, parse_override, to_toml
from aftlab.train.errors import UsageError


def test_defaults_are_valid_and_round_trip_through_dict_and_toml(tmp_path):
    cfg = TrainConfig(
        mixer="aft-local", mixer_options={"window": 8}, model={"d_model": 64, "n_heads": 2}
    )
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_toml_file_tables_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'task = "digits"\nlr = 1\nbetas = [0.8, 0.99]\n'
        "[model]\nd_model = 32\n[mixer_options]\nwindow = 4\n"
    )
    cfg = load_config(
        path,
        [
            "model.n_layers=2",
            "mixer=aft-local",
            "lr=3e-4",
            "mixer_options.window=6",
            "compile=true",
            'out="runs/x"',
        ],
    )
    assert cfg.task == "digits" and cfg.mixer == "aft-local" and cfg.compile is True
    assert cfg.model["d_model"] == 32 and cfg.model["n_layers"] == 2 and cfg.model["n_heads"] == 4
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)
    assert cfg.betas == [0.8, 0.99] and cfg.mixer_options == {"window": 6} and cfg.out == "runs/x"


def test_parse_override_values():
    assert parse_override("model.d_model=128") == (["model", "d_model"], 128)
    assert parse_override("betas=[0.9, 0.95]") == (["betas"], [0.9, 0.95])
    assert parse_override("mixer=aft-full") == (["mixer"], "aft-full")
    assert parse_override("mixer_options={window = 3}") == (["mixer_options"], {"window": 3})
    with pytest.raises(UsageError, match="expected key=value"):
        parse_override("lr")


@pytest.mark.parametrize(
    "override, message",
    [
        ("lrr=1e-3", "unknown key 'lrr'; did you mean 'lr'"),
        ("model.d_modle=8", "unknown key 'model.d_modle'; did you mean 'd_model'"),
        ("model.vocab_size=8", "unknown key 'model.vocab_size'"),
        ("steps.x=1", "'steps' is not a table"),
    ],
)
def test_unknown_keys_name_the_key_and_close_matches(override, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(TrainConfig().to_dict(), [override])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr": -1.0}, "'lr' must be a positive finite number"),
        ({"min_lr": 1.0, "lr": 0.1}, "'min_lr' must be in"),
        ({"steps": 0}, "'steps' must be > 0"),
        ({"steps": "10"}, "'steps' must be of type int"),
        ({"compile": 1}, "'compile' must be of type bool"),
        ({"batch_size": 6, "grad_accum": 4}, "'batch_size' must be a multiple of grad_accum=4"),
        ({"precision": "fp16"}, "'precision' must be one of"),
        ({"betas": [0.9]}, "'betas' must be two numbers"),
        ({"device": "gpu"}, "'device' must be"),
        ({"seed": 2**32}, r"'seed' must be in \[0, 2\*\*32\)"),
        ({"seed": -1}, r"'seed' must be in \[0, 2\*\*32\)"),
        ({"model": {"d_model": 30, "n_heads": 4}}, r"\[model\]: .*n_heads"),
    ],
)
def test_invalid_values_are_rejected(changes, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig.from_dict({**TrainConfig().to_dict(), **changes})


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 3\n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("stpes = 3\n")
    with pytest.raises(UsageError, match="did you mean 'steps'"):
        load_config(unknown)


def test_transformer_config_takes_task_sizes():
    cfg = TrainConfig(
        mixer="aft-conv", seq_len=32, model={"d_model": 16, "n_heads": 2, "n_layers": 1}
    )
    tc = cfg.transformer_config(vocab_size=10, causal=False, grid=(4, 8))
    assert (tc.vocab_size, tc.max_seq_len, tc.causal, tc.mixer) == (10, 32, False, "aft-conv")
    assert tc.mixer_options == {"grid": (4, 8)} and tc.d_model == 16


def test_example_configs_load_and_the_default_one_is_the_defaults():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.toml"))
    assert files
    for f in files:
        assert isinstance(load_config(f), TrainConfig)
    assert load_config(root / "text-default.toml") == TrainConfig()
