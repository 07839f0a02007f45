"""Files planted in a run folder, each with a manifest that matches it: a checkpoint from
elsewhere, malformed safetensors and JSON, weights that are not floating point, stored configs
with a section or a setting missing. Every reader refuses them with one line naming the file."""

import hashlib
import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from aftlab.cli import main
from aftlab.train.checkpoint import latest_checkpoint

from .test_run_safety import _error_lines, _snapshot, _train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run of 4 steps with a checkpoint at steps 2 and 4 (trained once)."""
    code, out = _train(
        tmp_path_factory.mktemp("hostile"), "run", "--steps", "4", "--set", "checkpoint_interval=2"
    )
    assert code == 0
    return out


@pytest.fixture
def run(trained, tmp_path, capsys):
    """A copy of ``trained`` for one test to damage."""
    capsys.readouterr()
    return shutil.copytree(trained, tmp_path / "run", symlinks=True)


def _argv(command, run_dir, tmp_path):
    if command == "export":
        pytest.importorskip("transformers")
    return {
        "eval": ["eval", str(run_dir), "--batches", "1"],
        "sample": ["sample", str(run_dir), "--tokens", "4"],
        "export": ["export", str(run_dir), str(tmp_path / "hf")],
        "train": ["train", "--out", str(run_dir), "--resume", "--steps", "6"],
    }[command]


def _refused(argv, capsys, *parts):
    """Run ``aftlab ARGV``: exit 2 and one error line holding every one of ``parts``."""
    assert main(argv) == 2
    line = _error_lines(capsys)
    assert "Traceback" not in line and all(p in line for p in parts), line
    return line


def _plant(ckpt, name, data: bytes):
    """Write ``data`` as the checkpoint's file ``name`` and a manifest that matches it."""
    (ckpt / name).write_bytes(data)
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest))


def _edit_config(ckpt, edit):
    """Apply ``edit`` to the checkpoint's config.json (manifest recomputed)."""
    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    _plant(ckpt, "config.json", json.dumps(config).encode())


NESTED = b"[" * 100_000 + b"]" * 100_000


# --------------------------------------------------------------------------- 3. from elsewhere


@pytest.mark.parametrize("command", ["eval", "sample", "export", "train"])
def test_a_checkpoint_linked_in_from_another_run_is_refused(run, tmp_path, capsys, command):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    link = run / "checkpoints" / "step_99999999"
    link.symlink_to(latest_checkpoint(other), target_is_directory=True)
    before, other_before = _snapshot(run), _snapshot(other)
    _refused(_argv(command, run, tmp_path), capsys, str(link), "is a symbolic link")
    assert _snapshot(run) == before and _snapshot(other) == other_before
    assert not (tmp_path / "hf").exists()


def test_a_linked_checkpoints_folder_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    _refused(["eval", str(run)], capsys, "resolves to", "must lie inside its run's")


def test_a_linked_file_in_a_checkpoint_is_refused(run, tmp_path, capsys):
    ckpt = latest_checkpoint(run)
    target = tmp_path / "elsewhere.safetensors"
    shutil.move(ckpt / "model.safetensors", target)
    (ckpt / "model.safetensors").symlink_to(target)
    _refused(["eval", str(run)], capsys, "its model.safetensors is a symbolic link")


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_checkpoint_whose_step_is_not_its_name_is_refused(run, tmp_path, capsys, command):
    copied = run / "checkpoints" / "step_99999999"
    shutil.copytree(latest_checkpoint(run), copied)  # its manifest says step 4
    before = _snapshot(run)
    _refused(
        _argv(command, run, tmp_path),
        capsys,
        str(copied),
        "says step 4, and a checkpoint's step must match its folder's name",
    )
    assert _snapshot(run) == before


# --------------------------------------------------------------------------- 5. malformed files


def _header_too_large(raw):
    return struct.pack("<Q", 2**62) + raw[8:]


def _offsets_out_of_range(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 1 << 40
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
@pytest.mark.parametrize("damage", [_header_too_large, _offsets_out_of_range])
def test_malformed_safetensors_is_one_line(run, tmp_path, capsys, command, damage):
    ckpt = latest_checkpoint(run)
    _plant(ckpt, "model.safetensors", damage((ckpt / "model.safetensors").read_bytes()))
    before = _snapshot(run)
    _refused(_argv(command, run, tmp_path), capsys, str(ckpt), "unreadable model.safetensors")
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", ["eval", "sample", "export", "train"])
def test_deeply_nested_config_json_is_one_line(run, tmp_path, capsys, command):
    ckpt = latest_checkpoint(run)
    _plant(ckpt, "config.json", NESTED)
    before = _snapshot(run)
    _refused(
        _argv(command, run, tmp_path),
        capsys,
        str(ckpt),
        "unreadable config.json (nested too deeply)",
    )
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", ["eval", "train"])
def test_deeply_nested_manifest_is_one_line(run, tmp_path, capsys, command):
    ckpt = latest_checkpoint(run)
    (ckpt / "manifest.json").write_bytes(NESTED)
    _refused(_argv(command, run, tmp_path), capsys, str(ckpt), "no readable manifest.json")


def test_deeply_nested_or_binary_config_toml_on_resume_is_one_line(run, capsys):
    config = run / "config.toml"
    config.write_bytes(b"lr = " + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    _refused(["train", "--out", str(run), "--resume"], capsys, str(config), "nested too deeply")
    config.write_bytes(b"lr = 0.002\n# caf\xe9\n")
    _refused(["train", "--out", str(run), "--resume"], capsys, str(config), "can't decode")


def test_a_nested_metrics_line_is_skipped_on_resume_and_plot(run, capsys):
    from aftlab.train.plot import read_metrics

    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], NESTED.decode(), "7", *lines[1:]]) + "\n")
    assert read_metrics(metrics) == [json.loads(x) for x in lines]
    assert main(["train", "--out", str(run), "--resume", "--steps", "5"]) == 0
    assert [r["step"] for r in read_metrics(metrics) if r["split"] == "train"] == [1, 2, 3, 4, 5]


def test_a_damaged_compare_cache_is_one_line(run):
    from aftlab.errors import UsageError
    from aftlab.train.compare import _validate
    from aftlab.train.config import load_config

    (run / "val.json").write_bytes(NESTED)
    with pytest.raises(UsageError, match=r"val.json' is unreadable \(nested too deeply\)"):
        _validate(load_config(run / "config.toml"), run)


# --------------------------------------------------------------------------- 7. dtypes


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("command", ["eval", "sample"])
def test_weights_that_are_not_floating_point_are_refused(run, tmp_path, capsys, command, dtype):
    ckpt = latest_checkpoint(run)
    weights = load_file(ckpt / "model.safetensors")
    planted = tmp_path / "planted.safetensors"
    save_file({k: v.to(dtype) for k, v in weights.items()}, planted, metadata={"format": "pt"})
    _plant(ckpt, "model.safetensors", planted.read_bytes())
    name = sorted(weights)[0]
    _refused(
        _argv(command, run, tmp_path),
        capsys,
        str(ckpt),
        f"'{name}' has dtype {dtype}, expected floating point (the model's torch.float32",
    )


def test_weights_of_another_floating_dtype_are_cast(run, tmp_path, capsys):
    ckpt = latest_checkpoint(run)
    weights = load_file(ckpt / "model.safetensors")
    planted = tmp_path / "planted.safetensors"
    save_file({k: v.double() for k, v in weights.items()}, planted, metadata={"format": "pt"})
    _plant(ckpt, "model.safetensors", planted.read_bytes())
    assert main(["eval", str(run), "--batches", "1"]) == 0


def test_gpt2_weights_that_are_not_floating_point_are_refused():
    transformers = pytest.importorskip("transformers")
    from aftlab.models import TransformerLM

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    sd = transformers.GPT2LMHeadModel(cfg).state_dict()
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"].to(torch.int32)
    with pytest.raises(
        ValueError, match="'backbone.position_embedding.weight' has dtype torch.int32"
    ):
        TransformerLM.from_gpt2_state_dict(sd, n_heads=2)


# --------------------------------------------------------------------------- HF from_pretrained


@pytest.fixture
def hf_folder(tmp_path):
    pytest.importorskip("transformers")
    from aftlab.hf import AftlabConfig, AftlabForCausalLM

    cfg = AftlabConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    AftlabForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("damage", ["complex64", "header", "nested"])
def test_from_pretrained_refuses_damaged_files_and_wrong_dtypes(hf_folder, damage):
    from aftlab.hf import AftlabForCausalLM

    weights = hf_folder / "model.safetensors"
    if damage == "complex64":
        tensors = {k: v.to(torch.complex64) for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
        match = "model.safetensors: 'model.* has dtype torch.complex64, expected floating point"
    elif damage == "header":
        weights.write_bytes(_header_too_large(weights.read_bytes()))
        match = r"a .safetensors file is damaged \(.*header too large\)"
    else:
        (hf_folder / "config.json").write_bytes(NESTED)
        match = r"a JSON file is damaged \(nested too deeply\)"
    with pytest.raises(ValueError, match=f"from_pretrained\\('{hf_folder}'\\): {match}"):
        AftlabForCausalLM.from_pretrained(hf_folder)


# --------------------------------------------------------------------------- 11. stored configs


@pytest.mark.parametrize("command", ["eval", "train"])
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["model"].update(flux=1), "unknown field(s) ['flux']"),
        (lambda c: c.pop("task"), "unreadable config.json (no 'task' section)"),
        (lambda c: c["train"].pop("lr"), "has no 'lr': aftlab writes every setting there"),
    ],
    ids=["unknown-model-field", "no-task-section", "no-lr"],
)
def test_eval_and_resume_make_the_same_config_checks(run, tmp_path, capsys, command, edit, message):
    ckpt = latest_checkpoint(run)
    _edit_config(ckpt, edit)
    before = _snapshot(run)
    _refused(_argv(command, run, tmp_path), capsys, str(ckpt), message)
    assert _snapshot(run) == before


def test_resume_refuses_a_config_toml_without_lr(run, capsys):
    config = run / "config.toml"
    config.write_text(
        "".join(x for x in config.read_text().splitlines(True) if not x.startswith("lr = "))
    )
    before = _snapshot(run)
    _refused(
        ["train", "--out", str(run), "--resume", "--steps", "6"],
        capsys,
        f"config file {str(config)!r} has no 'lr'",
    )
    assert _snapshot(run) == before
