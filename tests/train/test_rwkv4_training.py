"""``model.architecture = "rwkv4"``: RWKV-4 through aftlab train, eval, resume, export, compare."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from aftlab.cli import main
from aftlab.errors import UsageError
from aftlab.models import RWKV4LM
from aftlab.models.config import RWKV4Config
from aftlab.models.memory import estimate_memory, parameter_count
from aftlab.train.checkpoint import latest_checkpoint
from aftlab.train.config import load_config, to_toml
from aftlab.train.run import load_run

from .helpers import TINY, write_text


def _flags(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


#: TINY without the Transformer's n_heads, as RWKV-4
RWKV = [
    x for flag, item in zip(TINY[::2], TINY[1::2], strict=True) if "n_heads" not in item
    for x in (flag, item)
] + _flags("model.architecture=rwkv4", "model.d_model=24", "model.n_layers=2")


def test_the_config_of_an_rwkv4_run():
    cfg = load_config(None, ["model.architecture=rwkv4", "model.d_ff=40"])
    assert cfg.architecture == "rwkv4" and cfg.mixer == "rwkv4" and cfg.mixer_options == {}
    defaults = {f: getattr(RWKV4Config, f) for f in ("layer_norm_eps", "rescale_every")}
    assert cfg.model == {
        "architecture": "rwkv4", "d_model": 128, "n_layers": 3, "d_ff": 40,
        "tie_embeddings": False, **defaults,
    }
    assert load_config(None, ["model.architecture=rwkv4", "mixer=rwkv4"]) is not None
    assert load_config(None, []).architecture == "transformer"
    again = load_config(None, [])
    path = again.replace(model={"architecture": "rwkv4"})  # another architecture: its defaults
    assert path.model == {**cfg.model, "d_ff": None} and path.mixer == "rwkv4"
    model = cfg.model_config(vocab_size=256, max_seq_len=64, causal=True)
    assert model == RWKV4Config(vocab_size=256, d_model=128, n_layers=3, d_ff=40, max_seq_len=64)


def test_an_rwkv4_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["model.architecture=rwkv4", "model.rescale_every=0"])
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "c.toml") == cfg


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.n_heads=2"], r"'model\.n_heads' is not a setting of model\.architecture = "
                              r"'rwkv4'; its settings: d_model, n_layers, d_ff"),
        (["mixer=aft-local"], r"one time mix, mixer = 'rwkv4' with no mixer_options; got "
                              r"mixer = 'aft-local'"),
        (["mixer_options.window=3"], r"got mixer = 'rwkv4' with mixer_options \{'window': 3\}"),
        (["model.rescale_every=-1"], r"'rescale_every' must be an int >= 0"),
    ],
)
def test_bad_rwkv4_settings_name_themselves(sets, message):
    with pytest.raises(UsageError, match=message):
        load_config(None, ["model.architecture=rwkv4", *sets])


def test_an_unknown_architecture_and_a_setting_of_another_are_refused():
    with pytest.raises(UsageError, match=r"'model\.architecture' must be one of \['rwkv4', "
                                         r"'transformer'\], got 'rwkv9'"):
        load_config(None, ["model.architecture=rwkv9"])
    with pytest.raises(UsageError, match=r"'model\.rescale_every' is not a setting of "
                                         r"model\.architecture = 'transformer'"):
        load_config(None, ["model.rescale_every=6"])


def test_a_task_that_is_not_text_is_refused(tmp_path, capsys):
    argv = ["train", "--task", "digits-classify", "--out", str(tmp_path / "r"), *RWKV]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "model.architecture = 'rwkv4' is a language model" in err and "classifier" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("d_ff", [None, 37])
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_is_exact(d_ff, tie):
    cfg = RWKV4Config(vocab_size=99, d_model=20, n_layers=3, d_ff=d_ff, tie_embeddings=tie)
    n = sum(p.numel() for p in RWKV4LM(cfg).parameters())
    assert parameter_count(cfg) == n
    trained = estimate_memory(cfg, dtype=torch.float32, batch_size=2, seq_len=5)
    assert trained > estimate_memory(cfg, dtype=torch.float32) >= 4 * n
    with pytest.raises(ValueError, match="no classifier"):
        parameter_count(cfg, num_classes=3)


def _train(root, steps, *extra):
    data = root.parent / "data.txt"
    if not data.exists():
        write_text(data)
    argv = ["train", "--data", str(data), "--out", str(root), "--steps", str(steps), *RWKV]
    assert main([*argv, *_flags("checkpoint_interval=3", *extra)]) == 0
    return root


def _weights(run):
    return load_file(str(latest_checkpoint(run) / "model.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("rwkv4") / "run", 6)


def test_a_run_trains_an_rwkv4lm_and_reads_back(trained, capsys):
    run = load_run(trained, load_task=False)
    assert type(run.model) is RWKV4LM and run.step == 6
    assert run.model_config == RWKV4Config(vocab_size=256, d_model=24, n_layers=2, max_seq_len=16)
    saved = json.loads((latest_checkpoint(trained) / "config.json").read_text())
    assert saved["model"]["architecture"] == "rwkv4"
    start = RWKV4LM(run.model_config).state_dict()
    moved = [n for n, p in run.model.state_dict().items() if not torch.equal(p, start[n])]
    assert len(moved) == len(start)  # every parameter trained, the zero-initialised included
    assert main(["eval", str(trained)]) == 0
    assert "rwkv4 (model.architecture = rwkv4) on text" in capsys.readouterr().out


def test_resume_gives_the_weights_of_one_uninterrupted_run(trained):
    whole = _train(trained.parent / "whole", 9)
    cut = trained.parent / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(latest_checkpoint(cut))  # as if stopped after step 6
    assert main(["train", "--out", str(cut), "--resume"]) == 0
    a, b = _weights(cut), _weights(whole)
    assert latest_checkpoint(cut).name == latest_checkpoint(whole).name == "step_00000009"
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_carry_state_trains_along_streams(tmp_path):
    run = _train(tmp_path / "carry", 4, "carry_state=true", "carry_grad_windows=2")
    assert (latest_checkpoint(run) / "model.safetensors").is_file()
    assert type(load_run(run, load_task=False).model) is RWKV4LM


def test_export_is_transformers_own_format(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is missing")
    out = tmp_path / "hf"
    assert main(["export", str(trained), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "rwkv"
    hf = transformers.RwkvForCausalLM.from_pretrained(out).eval()
    ours = load_run(trained, load_task=False).model
    ids = torch.tensor([list(b"the model mixes")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    pipe = transformers.pipeline("text-generation", model=str(out), tokenizer=str(out))
    got = pipe("the ", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert got == bytes(ours.generate(ids[:, :4], 8, temperature=0)[0].tolist()).decode(
        "utf-8", "replace"
    )


def test_compare_puts_the_model_beside_a_transformer(tmp_path):
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "cmp"
    argv = ["compare", "--data", str(data), "--out", str(out), "--steps", "2"]
    mixers = "aft-decay,rwkv4:architecture=rwkv4"
    assert main([*argv, "--mixers", mixers, *TINY]) == 0
    rows = {r["mixer"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert {"aft-decay", "rwkv4:architecture=rwkv4"} <= set(rows)
    run = load_run(out / "rwkv4_architecture=rwkv4", load_task=False)
    assert type(run.model) is RWKV4LM  # with the sizes the two share: TINY's d_model, n_layers
    assert (run.model_config.d_model, run.model_config.n_layers) == (16, 1)
    assert rows["rwkv4:architecture=rwkv4"]["parameters"] == parameter_count(run.model_config)
