"""How a run ends (``aftlab train``'s exit status and ``--outcome`` record), and what
``aftlab compare`` does with it: only a divergence is recorded; a crash, out of memory, a full
disk or an interruption stops the comparison with its cause and is retried by a rerun."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import subprocess
import traceback

import pytest

from aftlab.cli import main
from aftlab.train import checkpoint as ckpt_mod
from aftlab.train import compare, trainer
from aftlab.train.outcome import outcome_of

from .helpers import TINY, write_text

OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 800000000000 bytes. Error code 12 (Cannot allocate memory)"
)


class _InProcess:
    """``subprocess.Popen`` of ``python -m aftlab ARGS`` run here as ``main(ARGS)`` (fast).

    An uncaught exception is a traceback on stderr and status 1, as Python's.
    """

    calls: list[list[str]] = []

    def __init__(self, cmd, stdout=None, text=None, **kwargs):
        assert cmd[1:3] == ["-m", "aftlab"], cmd
        self.args = cmd
        _InProcess.calls.append(cmd[3:])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                self.returncode = main(cmd[3:])
            except SystemExit as e:
                self.returncode = e.code
            except Exception:
                traceback.print_exc()
                self.returncode = 1
        self.stdout = io.StringIO(out.getvalue())

    def communicate(self, input=None, timeout=None):
        return self.stdout.read(), None

    def poll(self):
        return self.returncode

    wait = poll

    def kill(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def child(monkeypatch):
    """Children run in this process; ``fail(lr, fn)``: their step calls ``fn(trainer)`` at step 1
    for learning rate ``lr``. Returns ``(fail, calls)``, ``calls`` the children's arguments."""
    _InProcess.calls = []
    monkeypatch.setattr(subprocess, "Popen", _InProcess)
    failures = {}
    real_step = trainer.Trainer._train_step

    def step(self):
        loss = real_step(self)
        if self.step == 1 and self.config.lr in failures:
            failures[self.config.lr](self)
        return loss

    monkeypatch.setattr(trainer.Trainer, "_train_step", step)
    monkeypatch.setattr(compare, "_plot", lambda *args, **kwargs: None)  # matplotlib is slow
    return failures.__setitem__, _InProcess.calls


def _raise(e):
    def fn(t):
        raise e

    return fn


def _compare(tmp_path, *extra):
    data = tmp_path / "data.txt"
    if not data.exists():
        write_text(data, 20_000)
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(data), "--mixers", "attention", "--steps", "3"]
    return main([*args, "--out", str(out), *TINY, "--set", "sample_tokens=0", *extra]), out


def _error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("aftlab: error: ")]
    assert errors and err[-1] == errors[-1], err
    return errors[-1]


def test_out_of_memory_is_not_a_divergence_and_a_rerun_retries_it(tmp_path, capsys, child):
    fail, calls = child
    fail(2e-3, _raise(RuntimeError(OOM)))
    code, out = _compare(tmp_path)
    line = _error(capsys)
    assert code == 2
    assert line.startswith(
        "aftlab: error: training attention (lr 0.002, seed 0) ran out of memory: [enforce fail "
    )
    assert "can't allocate memory" in line and "not a divergence" in line
    assert str(out / "attention.outcome.json") in line
    assert not (out / "attention" / "compare-diverged.json").exists()
    record = json.loads((out / "attention.outcome.json").read_text())
    assert record["outcome"] == "out_of_memory" and record["exit_status"] == 4
    fail(2e-3, lambda t: None)  # memory freed: the rerun trains it again
    assert _compare(tmp_path)[0] == 0
    assert len(calls) == 2 and calls[1][-1] == "--resume"
    assert json.loads((out / "attention" / "summary.json").read_text())["steps"] == 3


def test_a_rerun_retries_a_crashed_run_and_reuses_a_diverged_one(tmp_path, capsys, child):
    fail, calls = child
    fail(2e-3, _raise(RuntimeError("boom")))
    code, out = _compare(tmp_path, "--lrs", "1e9,2e-3")  # 1e9 really diverges (at step 2)
    assert code == 2
    line = _error(capsys)
    assert "training attention (lr 0.002, seed 0) crashed: RuntimeError: boom" in line
    diverged = out / "attention" / "lr1e+09-seed0" / "compare-diverged.json"
    assert json.loads(diverged.read_text())["outcome"] == "diverged"
    assert not (out / "attention" / "lr0.002-seed0" / "compare-diverged.json").exists()
    fail(2e-3, lambda t: None)
    assert _compare(tmp_path, "--lrs", "1e9,2e-3")[0] == 0
    lrs = [c[c.index("--config") + 1] for c in calls]
    assert [os.path.basename(p) for p in lrs] == ["lr1e+09-seed0.toml", *["lr0.002-seed0.toml"] * 2]
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["lr"] == 2e-3 and row["val_by_lr"]["1e+09"] is None


def test_a_crashed_rate_stops_the_rate_choice(tmp_path, capsys, child):
    fail, calls = child
    fail(1e-3, _raise(RuntimeError("boom")))
    code, out = _compare(tmp_path, "--lrs", "2e-3,1e-3")
    assert code == 2 and "(lr 0.001, seed 0) crashed: RuntimeError: boom" in _error(capsys)
    assert not (out / "results.json").exists() and not (out / "results.md").exists()
    assert (out / "attention" / "lr0.002-seed0" / "summary.json").is_file()  # kept
    record = json.loads((out / "attention" / "lr0.001-seed0.outcome.json").read_text())
    assert record["outcome"] == "crashed" and "RuntimeError: boom" in record["traceback"]


def test_a_full_disk_is_reported_as_such(tmp_path, capsys, child, monkeypatch):
    def full_disk(model, filename, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(ckpt_mod, "save_model", full_disk)
    code, out = _compare(tmp_path)
    line = _error(capsys)
    assert code == 2
    assert "training attention (lr 0.002, seed 0) ran out of disk space: could not write " in line
    assert "No space left on device" in line
    assert not (out / "attention" / "compare-diverged.json").exists()


def test_an_interrupted_run_stops_compare(tmp_path, capsys, child):
    fail, calls = child
    fail(2e-3, lambda t: t._on_signal(signal.SIGINT, None))  # as if Ctrl-C reached the child
    code, out = _compare(tmp_path, "--lrs", "2e-3,1e-3")
    err = capsys.readouterr().err
    assert code == 130 and len(calls) == 1  # the second rate is not trained
    assert "interrupted while training attention (lr 0.002, seed 0); rerun the same compare" in err
    assert not list(out.rglob("compare-diverged.json")) and not (out / "results.json").exists()


def test_train_exit_status_and_outcome_record(tmp_path, capsys, monkeypatch):
    data = write_text(tmp_path / "data.txt")
    base = ["train", "--data", str(data), "--steps", "3", *TINY]

    def train(name, *extra):
        record = tmp_path / f"{name}.json"
        code = main([*base, "--out", str(tmp_path / name), "--outcome", str(record), *extra])
        return code, json.loads(record.read_text())

    assert train("ok") == (0, {"outcome": "completed", "exit_status": 0, "error": None})
    code, record = train("div", "--set", "lr=1e9")
    assert code == 3 and record["outcome"] == "diverged" and record["exit_status"] == 3
    capsys.readouterr()
    monkeypatch.setattr(trainer.Trainer, "_train_step", _raise(RuntimeError(OOM)))
    code, record = train("oom")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and err[-1].startswith("aftlab: error: out of memory: [enforce fail")
    assert record["outcome"] == "out_of_memory" and record["error"] == OOM


@pytest.mark.parametrize(
    "status, record, expected",
    [
        (3, None, ("diverged", "exit status 3")),
        (1, None, ("crashed", "exit status 1")),
        (4, None, ("out_of_memory", "exit status 4")),
        (
            2,
            {"outcome": "disk_full", "exit_status": 2, "error": "no space"},
            ("disk_full", "no space"),
        ),
        (
            1,
            {"outcome": "diverged", "exit_status": 3, "error": "stale"},
            ("crashed", "exit status 1"),
        ),
        (130, None, ("interrupted", "exit status 130")),
        (-signal.SIGTERM, None, ("interrupted", "killed by SIGTERM")),
        (-signal.SIGBUS, None, ("crashed", "killed by SIGBUS")),
    ],
)
def test_outcome_of_a_child(status, record, expected):
    assert outcome_of(status, record) == expected
    if status == -signal.SIGTERM:
        outcome, cause = outcome_of(-signal.SIGKILL, None)  # the out-of-memory killer's
        assert outcome == "crashed" and "out of memory" in cause
