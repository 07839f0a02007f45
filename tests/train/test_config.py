import dataclasses
import re
from types import SimpleNamespace

import pytest

from aftlab._checks import did_you_mean
from aftlab.errors import UsageError
from aftlab.models import TransformerConfig
from aftlab.train.build import model_config_for
from aftlab.train.config import (
    TrainConfig,
    apply_overrides,
    default_model,
    load_config,
    parse_override,
    resume_conflicts,
    to_toml,
)


def test_defaults_are_valid_and_round_trip_through_dict_and_toml(tmp_path):
    cfg = TrainConfig.from_dict(
        {"mixer": "aft-local", "mixer_options": {"window": 8}, "model": {"d_model": 64, "d_ff": 9}}
    )
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    assert load_config(path, values={"steps": 7}) == cfg.replace(steps=7)


def test_the_config_holds_the_settings_as_the_file_writes_them():
    cfg = TrainConfig.from_dict(
        {"seq_len": 32, "mixer": "aft-local", "mixer_options": {"window": 4}, "model": {"d_ff": 5}}
    )
    # [model] is the table, every key of it (the defaults filled in), nothing of the task's
    assert cfg.model == {**default_model(), "d_ff": 5}
    assert set(cfg.model) == {f.name for f in dataclasses.fields(TransformerConfig)} - {
        "max_seq_len",
        "mixer",
        "mixer_options",
        "vocab_size",
        "causal",
    }
    assert (cfg.seq_len, cfg.mixer, cfg.mixer_options) == (32, "aft-local", {"window": 4})
    other = cfg.replace(mixer="aft-full", mixer_options={}, seq_len=8, lr=1e-3)
    assert (other.mixer, other.mixer_options, other.seq_len) == ("aft-full", {}, 8)
    assert other.model["d_ff"] == 5 and other.lr == 1e-3 and cfg.mixer == "aft-local"
    # a model table given to replace refines this config's
    assert cfg.replace(model={"n_layers": 2}).model == {**cfg.model, "n_layers": 2}
    # the file keeps the layout users know: no max_seq_len, vocab_size or causal in [model]
    d = cfg.to_dict()
    assert (d["seq_len"], d["mixer"], d["mixer_options"]) == (32, "aft-local", {"window": 4})
    assert d["model"] == cfg.model
    # the Python API takes the table, refining the defaults, and checks its keys and values
    assert TrainConfig(model={"d_model": 8, "n_heads": 2}).model == {
        **default_model(),
        "d_model": 8,
        "n_heads": 2,
    }
    with pytest.raises(UsageError, match="'model' must be of type dict, got TransformerConfig"):
        TrainConfig(model=TransformerConfig(d_model=64))
    with pytest.raises(UsageError, match=r"^config: unknown key 'model.causal' \(it is set by"):
        TrainConfig(model={"causal": False})
    with pytest.raises(UsageError, match=r"^config: \[model\]: .*'n_heads' must be a divisor"):
        TrainConfig(model={"d_model": 30})


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
    assert (cfg.model["d_model"], cfg.model["n_layers"], cfg.model["n_heads"]) == (32, 2, 4)
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


def test_old_spellings_and_old_run_folders_still_load(tmp_path):
    """A config.toml/config.json written before the model was typed (a partial [model] table)."""
    old = tmp_path / "config.toml"
    old.write_text(
        'task = "text"\nseq_len = 64\nmixer = "aft-local"\nsteps = 9\nbetas = [0.9, 0.95]\n'
        '# out = (unset)\n\n[task_options]\n\n[mixer_options]\n"window" = 8\n\n'
        '[model]\n"d_model" = 32\n"n_layers" = 3\n"n_heads" = 4\n"norm" = "post"\n'
    )
    cfg = load_config(old)
    want = {**default_model(), "d_model": 32, "norm": "post"}
    assert cfg.model == want and cfg.steps == 9
    assert (cfg.seq_len, cfg.mixer, cfg.mixer_options) == (64, "aft-local", {"window": 8})
    saved = {  # config.json's "train" of that run
        "task": "text",
        "seq_len": 64,
        "mixer": "aft-local",
        "mixer_options": {"window": 8},
        "model": {"d_model": 32, "n_layers": 3, "n_heads": 4, "norm": "post"},
        "steps": 9,
    }
    assert TrainConfig.from_dict(saved) == cfg
    assert resume_conflicts(saved, cfg.replace(steps=20)) == []  # steps may change
    assert resume_conflicts(saved, cfg.replace(model={"d_ff": 7})) == [
        "model.d_ff is None there but 7 here"
    ]
    cli = load_config(
        None, ["mixer=aft-local", "model.d_model=32", "mixer_options.window=8", "seq_len=64"]
    )
    assert (cli.model, cli.seq_len, cli.mixer, cli.mixer_options) == (
        {**want, "norm": "pre"},
        64,
        "aft-local",
        {"window": 8},
    )


@pytest.mark.parametrize(
    "override, says",
    [
        ('model.mixer="aft-full"', "'model.mixer' is written 'mixer', at the top level"),
        ("model.max_seq_len=64", "'model.max_seq_len' is written 'seq_len', at the top level"),
        ("model.mixer_options={window=3}", "'model.mixer_options' is written 'mixer_options'"),
        ("model.causal=false", "unknown key 'model.causal' (it is set by the task)"),
    ],
)
def test_a_model_key_written_elsewhere_gets_one_line_saying_what_to_write(tmp_path, override, says):
    with pytest.raises(UsageError, match="^" + re.escape(f"--set '{override}': {says}")) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)
    key, _, value = override.partition("=")
    path = tmp_path / "c.toml"
    path.write_text(f"[model]\n{key.split('.')[1]} = {value}\n")
    with pytest.raises(UsageError, match="^" + re.escape(f"config: {says}")):
        load_config(path)


def test_seq_len_and_mixer_keep_their_own_names_in_errors():
    with pytest.raises(UsageError, match=r"^config: 'seq_len' must be > 0, got 0 \(fix it"):
        load_config(None, ["seq_len=0"])
    with pytest.raises(UsageError, match="^config: 'mixer' must be of type str, got int 3"):
        load_config(None, ["mixer=3"])
    with pytest.raises(
        UsageError, match="^config: 'eval_batch_size' must be of type int or absent"
    ):
        load_config(None, ["eval_batch_size=1.5"])


def test_the_task_fills_vocabulary_context_causality_and_the_options_it_provides():
    cfg = TrainConfig.from_dict(
        {"mixer": "aft-conv", "seq_len": 32, "model": {"d_model": 16, "n_heads": 2, "n_layers": 1}}
    )
    task = SimpleNamespace(vocab_size=10, seq_len=64, kind="classify", grid=(8, 8))
    tc = model_config_for(cfg, task)
    assert (tc.vocab_size, tc.max_seq_len, tc.causal, tc.mixer) == (10, 64, False, "aft-conv")
    assert tc.mixer_options == {"grid": (8, 8)} and tc.d_model == 16
    assert tc == TransformerConfig(
        **cfg.model,
        vocab_size=10,
        max_seq_len=64,
        mixer="aft-conv",
        mixer_options={"grid": (8, 8)},
        causal=False,
    )
    own = model_config_for(cfg.replace(mixer_options={"grid": [4, 16]}), task)
    assert own.mixer_options == {"grid": [4, 16]}  # the config's own grid wins
    lm = SimpleNamespace(vocab_size=256, seq_len=32, kind="lm", grid=None)
    assert model_config_for(cfg.replace(mixer="aft-local"), task).mixer_options == {}
    assert model_config_for(cfg, lm).causal is True
    with pytest.raises(UsageError, match="unknown mixer 'aft-cnov'; did you mean 'aft-conv'"):
        model_config_for(cfg.replace(mixer="aft-cnov"), task)


def test_did_you_mean():
    assert did_you_mean("lrr", ["lr", "steps"]) == "did you mean 'lr'? "
    assert did_you_mean("aft-ful", ["aft-full", "aft-local", "attention"]) == (
        "did you mean 'aft-full' or 'aft-local'? "
    )
    assert did_you_mean("zzz", ["lr", "steps"]) == ""
    assert did_you_mean(3, []) == ""


def test_example_configs_load_and_the_default_one_is_the_defaults():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.toml"))
    assert files
    for f in files:
        assert isinstance(load_config(f), TrainConfig)
    assert load_config(root / "text-default.toml") == TrainConfig()


def test_cli_flags_reach_the_config_as_given(tmp_path):
    """``--data``, ``--out``, ``--mixer``, ``--steps`` go into the config as they are.

    They were once JSON-quoted into ``--set`` strings and TOML-parsed back, which turned a path
    with a character outside the BMP into its quoted JSON escape.
    """
    from aftlab.cli import build_parser
    from aftlab.cli.commands import resolve_train_config

    data, out = "d\N{GRINNING FACE}.txt", str(tmp_path / 'run "\N{GRINNING FACE}"')
    flags = ["--data", data, "--out", out, "--mixer", "aft-local", "--steps", "7"]
    argv = ["train", *flags, "--set", "mixer_options.window=3"]
    cfg = resolve_train_config(build_parser().parse_args(argv))
    got = (cfg.data, cfg.out, cfg.mixer, cfg.steps, cfg.mixer_options)
    assert got == (data, out, "aft-local", 7, {"window": 3})
    # --resume starts from the run's config.toml, then the same flags
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "config.toml").write_text(to_toml(TrainConfig()))
    argv = ["train", "--resume", "--out", str(tmp_path / "run2"), "--data", data, "--steps", "9"]
    cfg = resolve_train_config(build_parser().parse_args(argv))
    assert (cfg.data, cfg.steps, cfg.out) == (data, 9, str(tmp_path / "run2"))


def test_replace_checks_keys_and_names_seq_len_like_the_file_does():
    c = TrainConfig()
    with pytest.raises(UsageError, match="^config: unknown key 'sqe_len'; did you mean 'seq_len'"):
        c.replace(sqe_len=64)
    with pytest.raises(UsageError, match=r"^config: 'seq_len' must be > 0, got 0 \(fix it"):
        c.replace(seq_len=0)
    with pytest.raises(UsageError, match="^config: 'seq_len' must be of type int, got str '64'"):
        c.replace(seq_len="64")
    assert (c.replace(seq_len=64, steps=3).seq_len, c.seq_len) == (64, 128)
