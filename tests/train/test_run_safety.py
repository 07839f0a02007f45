"""A run folder is never code, never shared by two trainings, never mixed with an edited config,
never overwritten by a diverged run, and survives a full disk."""

import errno
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from aftlab.cli import main
from aftlab.train import checkpoint as ckpt_mod
from aftlab.train.checkpoint import latest_checkpoint, list_checkpoints

from .helpers import ENV, TINY, write_text


def _raise(token):
    raise ValueError(f"not strict JSON: {token}")


def strict_json(text):
    """``json.loads`` refusing ``NaN``, ``Infinity`` and ``-Infinity``, as strict parsers do."""
    return json.loads(text, parse_constant=_raise)


def _error_lines(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("aftlab: error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


def _snapshot(run):
    """Every file of a run folder: its bytes and inode (an atomic rewrite changes the inode)."""
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_ino)
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def _train(tmp_path, name, *extra):
    data = tmp_path / "data.txt"
    if not data.exists():
        write_text(data)
    out = tmp_path / name
    return main(["train", "--data", str(data), "--out", str(out), *TINY, *extra]), out


@pytest.fixture
def run(tmp_path, capsys):
    """A finished tiny run of 4 steps with a checkpoint at steps 2 and 4."""
    code, out = _train(tmp_path, "run", "--steps", "4", "--set", "checkpoint_interval=2")
    assert code == 0
    capsys.readouterr()
    return out


# --------------------------------------------------------------------------- 1. security


class _Payload:
    """Unpickling this calls ``os.mkdir(marker)``: what a crafted training state can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_pickle(ckpt, marker):
    """Replace the training state by a payload pickle, with a manifest that matches it."""
    for name in ("train_state.pt", "train_state.safetensors", "train_state.json"):
        (ckpt / name).unlink(missing_ok=True)
    torch.save({"step": _Payload(marker), "optimizer": {}, "rng": {}}, ckpt / "train_state.pt")
    files = {}
    for name in ("model.safetensors", "config.json", "train_state.pt"):
        raw = (ckpt / name).read_bytes()
        files[name] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    step = int(ckpt.name.split("_")[1])
    (ckpt / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


@pytest.mark.parametrize("command", ["train", "eval", "sample", "plot"])
def test_a_crafted_pickle_in_a_run_folder_never_runs(run, tmp_path, capsys, command):
    if command == "plot":
        pytest.importorskip("matplotlib")  # without it, plot stops before reading the run
    marker = tmp_path / "payload-ran"
    for _, ckpt in list_checkpoints(run):
        _plant_pickle(ckpt, marker)
    before = _snapshot(run / "checkpoints")
    argv = {
        "train": ["train", "--out", str(run), "--resume", "--steps", "6"],
        "eval": ["eval", str(run), "--batches", "1"],
        "sample": ["sample", str(run), "--tokens", "4"],
        "plot": ["plot", str(run), "--out", str(tmp_path / "plots")],
    }[command]
    assert main(argv) == 2
    assert "pickled training state (train_state.pt" in _error_lines(capsys)
    assert not marker.exists(), "the payload ran"
    assert _snapshot(run / "checkpoints") == before


# --------------------------------------------------------------------------- 2. one run, one writer


def test_a_second_training_into_a_locked_run_changes_nothing(tmp_path, capsys):
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "aftlab", "train", "--data", str(data), "--out", str(out), *TINY]
        + ["--steps", "100000", "--set", "checkpoint_interval=1", "--set", "log_interval=100000"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        deadline = time.time() + 120
        while latest_checkpoint(out) is None and time.time() < deadline:
            assert first.poll() is None, "the first training ended early"
            time.sleep(0.02)
        config = out / "config.toml"
        config_before = (config.read_bytes(), config.stat().st_ino)
        metrics_inode = (out / "metrics.jsonl").stat().st_ino
        step = list_checkpoints(out)[-1][0]
        # this test's process is the second training
        assert main(["train", "--out", str(out), "--resume", "--steps", str(step + 1)]) == 2
        line = _error_lines(capsys)
        assert f"run folder {str(out)!r} is in use: another process (pid {first.pid})" in line
        assert (config.read_bytes(), config.stat().st_ino) == config_before
        assert (out / "metrics.jsonl").stat().st_ino == metrics_inode  # not truncated, not replaced
        assert first.poll() is None  # the first one trains on, undisturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the kernel released the dead process's lock: the run resumes, its metrics in order
    step = list_checkpoints(out)[-1][0]
    assert main(["train", "--out", str(out), "--resume", "--steps", str(step + 2)]) == 0
    records = [strict_json(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, step + 3))


@pytest.mark.parametrize(
    "edit, keys",
    [
        ({"lr": "0.05", "seed": "7"}, ["lr is 0.002 there but 0.05 here", "seed is 0 there but 7"]),
        ({"batch_size": "8", "grad_clip": "0.5"}, ["batch_size is 4 there", "grad_clip is 1.0"]),
    ],
)
def test_resume_after_editing_config_toml_is_refused(run, capsys, edit, keys):
    config = run / "config.toml"
    lines = config.read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split(" = ")[0]
        if key in edit:
            lines[i] = f"{key} = {edit[key]}"
    config.write_text("\n".join(lines) + "\n")
    before = _snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "--steps", "6"]) == 2
    line = _error_lines(capsys)
    assert "cannot resume" in line and "step_00000004/config.json" in line
    assert all(k in line for k in keys), line
    assert _snapshot(run) == before


def test_resume_may_change_steps_and_intervals_but_not_below_the_checkpoint(run, capsys):
    before = _snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 2
    line = _error_lines(capsys)
    assert "steps=3: its checkpoint is at step 4 (give --steps 4 or more)" in line
    assert _snapshot(run) == before
    resumed = ["train", "--out", str(run), "--resume", "--steps", "5"]
    assert main([*resumed, "--set", "eval_interval=1", "--set", "keep_last=3"]) == 0
    assert latest_checkpoint(run).name == "step_00000005"


# --------------------------------------------------------------------------- divergence, JSON


def test_divergence_stops_with_one_line_and_keeps_the_good_checkpoints(tmp_path, capsys):
    code, out = _train(
        tmp_path, "run", "--steps", "20", "--set", "lr=1e9", "--set", "checkpoint_interval=1"
    )
    assert code == 3  # docs/training.md, "Exit status"
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith("aftlab: error: training diverged at step ")
    assert sum("error" in line for line in err) == 1
    step = int(err[-1].split("at step ")[1].split("/")[0])
    assert "--- sample ---" not in captured.out and not (out / "summary.json").exists()
    ckpts = list_checkpoints(out)
    assert ckpts and all(s < step for s, _ in ckpts)
    for _, path in ckpts:
        weights = load_file(str(path / "model.safetensors"))
        assert all(bool(torch.isfinite(w).all()) for w in weights.values()), path
    records = [strict_json(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, step))
    assert all(math.isfinite(r["loss"]) for r in records)


def test_every_json_file_is_strict_even_with_non_finite_metrics(tmp_path, capsys, monkeypatch):
    from aftlab.train import trainer

    def infinite(*args, **kwargs):  # a model whose evaluation overflows
        return {"loss": math.inf, "bpb": math.nan, "targets": 1}

    monkeypatch.setattr(trainer, "evaluate", infinite)
    code, out = _train(tmp_path, "run", "--steps", "2", "--set", "eval_interval=1")
    assert code == 0
    files = [*out.glob("*.json"), *out.glob("checkpoints/*/*.json")]
    assert {p.name for p in files} >= {"summary.json", "task.json", "config.json", "manifest.json"}
    for path in files:
        strict_json(path.read_text())
    summary = strict_json((out / "summary.json").read_text())
    assert summary["test_loss"] is None and summary["test_bpb"] is None
    records = [strict_json(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if r["split"] == "val"] == [None]
    from aftlab._json import dumps

    assert dumps({"a": [float("-inf"), 1.5]}) == '{"a": [null, 1.5]}'


# --------------------------------------------------------------------------- disk full


def test_disk_full_while_checkpointing_cleans_up_and_resume_continues(
    tmp_path, capsys, monkeypatch
):
    args = ["--steps", "6", "--set", "checkpoint_interval=2", "--set", "keep_last=5"]
    assert _train(tmp_path, "ref", *args)[0] == 0
    real_save_model = ckpt_mod.save_model
    calls = []

    def full_disk(model, filename, **kwargs):
        calls.append(filename)
        if len(calls) == 2:  # the checkpoint of step 4
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save_model(model, filename, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_model", full_disk)
    capsys.readouterr()
    code, out = _train(tmp_path, "run", *args)
    assert code == 2
    line = _error_lines(capsys)
    assert "could not write checkpoint" in line and "No space left on device" in line
    assert not list(out.rglob(".tmp-*")), "the partial checkpoint stayed"
    assert [s for s, _ in list_checkpoints(out)] == [2]
    monkeypatch.setattr(ckpt_mod, "save_model", real_save_model)
    assert main(["train", "--out", str(out), "--resume"]) == 0
    ref, got = (
        load_file(str(latest_checkpoint(d) / "model.safetensors")) for d in (tmp_path / "ref", out)
    )
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6]
    assert all(torch.equal(ref[k], got[k]) for k in ref)
