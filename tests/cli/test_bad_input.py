"""Hostile or careless input to ``aftlab``: one line on stderr, exit 2, nothing written is lost.

Each case names the argument at fault; none ends in a traceback or hangs.
"""

import hashlib
import json
import os
import re
import shutil
import sys

import pytest

from aftlab.cli import main

from ..train.helpers import ENV, TINY, train_tiny


def _one_line(text: str, arg: str, message: str) -> str:
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("aftlab: error: ") and arg in line, line
    assert re.search(message, line), line
    return line


def _run(argv: list[str], capsys) -> str:
    """Run ``aftlab ARGV`` in-process; it must return 2. Returns what it wrote to stderr."""
    assert main(argv) == 2
    return capsys.readouterr().err


def _snapshot(root) -> dict[str, bytes]:
    """Every entry under the folder ``root``: a file's bytes, a link's target, a folder's name."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = b"link to " + os.fsencode(os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = b"folder"
            else:
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny finished run and its data file."""
    root = tmp_path_factory.mktemp("bad_input")
    return train_tiny(root, 2), root / "data.txt"


# --------------------------------------------------------------------------- --data


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_data_dev_null(trained, tmp_path, capsys):
    run, _ = trained
    before = _snapshot(run)
    for argv in (
        ["train", "--data", "/dev/null", "--out", str(tmp_path / "new"), *TINY],
        ["train", "--task", "enwik8", "--data", "/dev/null", "--out", str(tmp_path / "new")],
        ["eval", str(run), "--data", "/dev/null"],
    ):
        _one_line(_run(argv, capsys), "--data", "is a character device, expected a regular file")
    assert not (tmp_path / "new").exists()
    assert _snapshot(run) == before


def test_data_folder_holding_an_empty_corpus_file(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "enwik8").touch()
    argv = ["train", "--task", "enwik8", "--data", str(tmp_path / "corpus")]
    _one_line(_run([*argv, "--out", str(tmp_path / "new")], capsys), "--data", "is empty")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_data_fifo_is_refused_without_opening_it(trained, tmp_path):
    import subprocess

    run, _ = trained
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv in (
        ["train", "--data", str(fifo), "--out", str(tmp_path / "new"), *TINY],
        ["eval", str(run), "--data", str(fifo)],
        ["train", "--config", str(fifo), "--out", str(tmp_path / "new"), *TINY],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "aftlab", *argv],
            capture_output=True,
            text=True,
            timeout=60,  # opening the pipe would block forever
            env=ENV,
            cwd=tmp_path,
        )
        assert res.returncode == 2, res.stderr
        arg = "--config" if "--config" in argv else "--data"
        _one_line(res.stderr, arg, r"named pipe \(FIFO\)")
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- --out


def _out_cases(tmp):
    (tmp / "file").write_text("keep me")
    os.symlink(tmp / "missing-target", tmp / "dangling")
    return {
        "dangling": (str(tmp / "dangling"), "symbolic link .* does not exist"),
        "file": (str(tmp / "file"), "is a file, not a folder"),
        "below-file": (str(tmp / "file" / "sub"), "not a folder"),
    }


@pytest.mark.parametrize("case", ["dangling", "file", "below-file"])
@pytest.mark.parametrize("command", ["train", "compare", "plot"])
def test_out_that_cannot_be_a_folder(case, command, trained, tmp_path, capsys):
    run, data = trained
    out, message = _out_cases(tmp_path)[case]
    before = _snapshot(tmp_path)
    argv = {
        "train": ["train", "--data", str(data), "--out", out, *TINY],
        "compare": ["compare", "--data", str(data), "--mixers", "attention", "--out", out, *TINY],
        "plot": ["plot", str(run), "--out", out],
    }[command]
    if command == "plot":
        pytest.importorskip("matplotlib")
    _one_line(_run(argv, capsys), "--out", message)
    assert _snapshot(tmp_path) == before
    assert os.path.islink(tmp_path / "dangling") and not os.path.exists(tmp_path / "dangling")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_no_folder_can_be_created(trained, capsys):
    # /proc refuses new folders even to root (a chmod-ed folder would not stop root)
    _, data = trained
    out = "/proc/self/aftlab-run"
    _one_line(
        _run(["train", "--data", str(data), "--out", out, *TINY], capsys),
        "--out",
        "cannot be created",
    )
    assert not os.path.exists(out)


# --------------------------------------------------------------------------- --config


def test_config_that_is_not_utf8(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(b"lr = 0.001\n# caf\xe9\n")
    for argv in (
        ["train", "--config", str(cfg), "--out", str(tmp_path / "new")],
        ["compare", "--config", str(cfg), "--out", str(tmp_path / "new")],
    ):
        _one_line(_run(argv, capsys), "--config", r"not UTF-8 text \(byte 0xe9")
    assert not (tmp_path / "new").exists()
    assert cfg.read_bytes() == b"lr = 0.001\n# caf\xe9\n"


# --------------------------------------------------------------------------- sample, eval


def _fill(arg: bytes, paths: dict[str, bytes]) -> bytes:
    for key, value in paths.items():
        arg = arg.replace(b"{" + key.encode() + b"}", value)
    return arg


@pytest.mark.parametrize(
    "argv, arg",
    [
        (["sample", "{run}", "--prompt", b"abc\xff"], "--prompt"),
        (["train", "--data", "{data}", "--out", b"{tmp}/r\xff", *TINY], "--out"),
        (["train", "--set", b"data='{tmp}/d\xff.txt'", "--out", "{tmp}/r", *TINY], "--set"),
    ],
    ids=["sample-prompt", "train-out", "train-set"],
)
def test_argv_bytes_that_are_not_utf8(argv, arg, trained, tmp_path):
    import subprocess

    run, data = trained
    shutil.copy(data, os.fsdecode(bytes(tmp_path) + b"/d\xff.txt"))
    before = _snapshot(tmp_path)
    paths = {"run": os.fsencode(run), "data": os.fsencode(data), "tmp": bytes(tmp_path)}
    argv = [_fill(os.fsencode(a) if isinstance(a, str) else a, paths) for a in argv]
    res = subprocess.run(  # the bytes arrive in sys.argv as surrogate escapes
        [sys.executable, "-m", "aftlab", *argv],
        capture_output=True,
        timeout=120,
        env=ENV,
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    _one_line(res.stderr.decode("utf-8", "replace"), arg, "not valid UTF-8")
    assert res.stdout == b""
    assert _snapshot(tmp_path) == before  # no run folder under a mangled name


@pytest.mark.parametrize(
    "argv, arg, message",
    [
        (["--seed", "18446744073709551616"], "--seed", r"\[0, 2\*\*64\)"),
        (["--seed", "-1"], "--seed", r"\[0, 2\*\*64\)"),
        (["--temperature", "inf"], "--temperature", "finite"),
        (["--top-p", "0"], "--top-p", r"must be in \(0, 1\]"),
        (["--top-p", "1.5"], "--top-p", r"must be in \(0, 1\]"),
        (["--top-p", "nan"], "--top-p", r"must be in \(0, 1\]"),
    ],
)
def test_sample_arguments_out_of_range(argv, arg, message, trained, capsys):
    run, _ = trained
    before = _snapshot(run)
    _one_line(_run(["sample", str(run), "--tokens", "4", *argv], capsys), arg, message)
    assert _snapshot(run) == before


@pytest.mark.parametrize("device", ["foo", "meta", "cuda:99"])
@pytest.mark.parametrize("command", ["eval", "sample"])
def test_unknown_or_unusable_device(command, device, trained, capsys):
    run, _ = trained
    message = "CUDA" if device.startswith("cuda") else "must be auto, cpu, cuda or cuda:N"
    _one_line(_run([command, str(run), "--device", device], capsys), "--device", message)


def test_train_on_a_device_the_machine_lacks(trained, tmp_path, capsys):
    _, data = trained
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(out), *TINY, "--set", "device='cuda:99'"]
    _one_line(_run(argv, capsys), "--set device is 'cuda:99'", "CUDA")
    assert not out.exists()


def _with_nan_weights(run, dest):
    """A copy of ``run`` whose newest weights are all NaN, with its manifest updated to match."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(run, dest)
    ckpt = sorted((dest / "checkpoints").iterdir())[-1]
    weights = ckpt / "model.safetensors"
    tensors = {k: v.clone().fill_(float("nan")) for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    raw = weights.read_bytes()
    manifest["files"]["model.safetensors"] = {
        "sha256": hashlib.sha256(raw).hexdigest(),
        "bytes": len(raw),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_run_with_nan_weights(command, trained, tmp_path, capsys):
    run = _with_nan_weights(trained[0], tmp_path / "nan_run")
    before = _snapshot(run)
    argv = [command, str(run)] + (["--tokens", "4"] if command == "sample" else [])
    line = _one_line(_run(argv, capsys), str(run), "weights .* are not finite")
    assert "NaN" in line
    assert _snapshot(run) == before
