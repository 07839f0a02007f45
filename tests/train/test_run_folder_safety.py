"""Nothing planted in a run folder redirects a write; a run folder that vanishes stops the run; a
folder left with only a lock is a new run; full and read-only disks are one line."""

import builtins
import errno
import io
import os
import shutil
import socket
from pathlib import Path

import pytest

from aftlab.cli import main
from aftlab.train.checkpoint import RunLock, atomic_write_text, list_checkpoints
from aftlab.train.trainer import Trainer

from .helpers import TINY, train_tiny, write_text
from .test_run_safety import _error_lines, _snapshot

VICTIM = b"a file of the user's, outside the run folder\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run of 2 steps (copied by :func:`run` for each test)."""
    return train_tiny(tmp_path_factory.mktemp("finished"), 2)


@pytest.fixture
def run(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    capsys.readouterr()
    return out


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


def _resume(run, *extra):
    return main(["train", "--out", str(run), "--resume", "--steps", "4", *extra])


def _fail_writes(monkeypatch, under, code):
    """Every write at or below ``under`` fails with ``code``, whichever call makes it (a full or
    read-only disk; root ignores permissions, so chmod cannot make one)."""
    under = Path(under).absolute()

    def inside(path):
        try:
            return Path(os.fspath(path)).absolute().is_relative_to(under)
        except TypeError:  # a file descriptor
            return False

    def refuse(path):
        raise OSError(code, os.strerror(code), str(path))

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def fake_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.lexists(path):  # an existing one: EEXIST, as Linux says
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def _after_step(monkeypatch, step, action):
    """Run ``action()`` right after training step ``step`` (the trainer runs on, unaware)."""
    real = Trainer._train_step

    def train_step(self):
        loss = real(self)
        if self.step == step:
            action()
        return loss

    monkeypatch.setattr(Trainer, "_train_step", train_step)


# --------------------------------------------------------------------------- 1. links


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_lock_that_is_a_link_or_not_a_file_is_refused_and_nothing_is_written(
    run, victim, capsys, kind
):
    lock = run / ".lock"
    lock.unlink()
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    before = _snapshot(run)
    assert _resume(run) == 2
    line = _error_lines(capsys)
    what = {"symlink": "a symbolic link to ", "hardlink": "2 hard links", "fifo": "named pipe"}
    assert f"{str(lock)!r} is " in line and what[kind] in line, line
    assert victim.read_bytes() == VICTIM
    assert _snapshot(run) == before


def test_a_link_at_metrics_jsonl_is_refused(run, tmp_path, capsys):
    target = tmp_path / "elsewhere.jsonl"  # a link to a file that does not exist yet
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)
    assert _resume(run) == 2
    assert f"{str(run / 'metrics.jsonl')!r} is a symbolic link to" in _error_lines(capsys)
    assert not target.exists()


def test_a_link_at_tb_is_refused(run, tmp_path, capsys):
    pytest.importorskip("torch.utils.tensorboard")
    other = tmp_path / "other"
    other.mkdir()
    (run / "tb").symlink_to(other)
    assert _resume(run, "--log", "tensorboard") == 2
    assert f"{str(run / 'tb')!r} is a symbolic link to" in _error_lines(capsys)
    assert not list(other.iterdir())


def test_checkpoints_replaced_by_a_link_during_training_are_never_written_through(
    run, tmp_path, capsys, monkeypatch
):
    other = tmp_path / "other"

    def plant():
        shutil.move(run / "checkpoints", other)
        (run / "checkpoints").symlink_to(other)

    _after_step(monkeypatch, 3, plant)
    assert _resume(run) == 2
    assert f"{str(run / 'checkpoints')!r} is a symbolic link to" in _error_lines(capsys)
    assert [p.name for p in other.iterdir()] == ["step_00000002"]


def test_an_atomic_write_never_writes_through_a_planted_temporary_file(tmp_path, victim):
    path = tmp_path / "summary.json"
    (tmp_path / f".tmp-summary.json-{os.getpid()}").symlink_to(victim)
    atomic_write_text(path, "{}")
    assert victim.read_bytes() == VICTIM
    assert path.read_text() == "{}" and not path.is_symlink()


@pytest.mark.parametrize("planted", ["plots", "plots/loss.png"])
def test_plot_never_writes_through_a_link(run, tmp_path, victim, capsys, planted):
    pytest.importorskip("matplotlib")
    other = tmp_path / "other"
    other.mkdir()
    if planted == "plots":
        (run / "plots").symlink_to(other)
        assert main(["plot", str(run)]) == 2
        assert f"{str(run / 'plots')!r} is a symbolic link to" in _error_lines(capsys)
        assert not list(other.iterdir())
    else:
        (run / "plots").mkdir()
        (run / "plots" / "loss.png").symlink_to(victim)
        assert main(["plot", str(run)]) == 0  # the link is replaced by the figure
        assert victim.read_bytes() == VICTIM
        png = run / "plots" / "loss.png"
        assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------------------- 8. a stuck folder


def _stuck(tmp_path, lock_text):
    """What a run killed between taking its lock and writing config.toml leaves."""
    out = tmp_path / "stuck"
    out.mkdir()
    (out / ".lock").write_text(lock_text)
    (out / ".tmp-config.toml-4242").write_text("half")
    return out


def test_a_folder_holding_only_a_lock_and_temporaries_is_a_new_run(tmp_path, capsys):
    out = _stuck(tmp_path, "4242")  # an older aftlab's lock: its pid
    data = write_text(tmp_path / "data.txt")
    assert main(["train", "--data", str(data), "--out", str(out), "--steps", "1", *TINY]) == 0
    assert not list(out.glob(".tmp-*")) and (out / "config.toml").is_file()
    assert [s for s, _ in list_checkpoints(out)] == [1]


def test_resume_of_such_a_folder_says_it_never_began_and_whose_lock_it_is(tmp_path, capsys):
    out = _stuck(tmp_path, "")
    RunLock(out).release()  # the lock file now names this process
    assert main(["train", "--out", str(out), "--resume"]) == 2
    line = _error_lines(capsys)
    holder = f"(pid {os.getpid()}) on host {socket.gethostname()!r}, started "
    assert "holds only the lock (and temporary files) of a run that never began" in line
    assert holder in line and line.endswith("(start it without --resume)")
    assert (out / ".tmp-config.toml-4242").exists()  # nothing removed without the lock


def test_the_in_use_message_names_the_holder_host_and_start(tmp_path, capsys):
    data, out = write_text(tmp_path / "data.txt"), tmp_path / "run"
    with RunLock(out):  # flock: a second open of the file in this process is another holder
        assert main(["train", "--data", str(data), "--out", str(out), *TINY]) == 2
    line = _error_lines(capsys)
    holder = f"(pid {os.getpid()}) on host {socket.gethostname()!r}, started "
    assert f"is in use: another process {holder}" in line and "is training into it" in line


# --------------------------------------------------------------------------- 9. a vanished folder


@pytest.mark.parametrize("how", ["rm -rf RUN", "rm RUN/.lock", "mv RUN RUN2"])
def test_a_run_folder_deleted_or_moved_during_training_stops_it(tmp_path, capsys, monkeypatch, how):
    data = write_text(tmp_path / "data.txt")
    out, moved = tmp_path / "run", tmp_path / "run2"
    action = {
        "rm -rf RUN": lambda: shutil.rmtree(out),
        "rm RUN/.lock": lambda: (out / ".lock").unlink(),
        "mv RUN RUN2": lambda: out.rename(moved),
    }[how]
    _after_step(monkeypatch, 3, action)
    argv = ["train", "--data", str(data), "--out", str(out), "--steps", "6"]
    assert main([*argv, *TINY, "--set", "checkpoint_interval=2"]) == 2
    line = _error_lines(capsys)
    assert f"run folder {str(out)!r} or its .lock was deleted or moved during training" in line
    assert "stopped at step 3" in line
    if how == "rm RUN/.lock":
        assert [s for s, _ in list_checkpoints(out)] == [2] and not (out / "summary.json").exists()
    else:
        assert not out.exists()  # not recreated as a half run
    if how == "mv RUN RUN2":
        monkeypatch.undo()
        assert main(["train", "--out", str(moved), "--resume", "--steps", "4"]) == 0


# --------------------------------------------------------------------------- 10. full, read-only


class _FullDisk(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_under_metrics_jsonl_is_one_line(run, capsys, monkeypatch):
    real = Trainer._open_logs

    def open_logs(self):  # metrics.jsonl on a disk that fills up: writes stay in the buffer
        real(self)
        self._metrics.close()
        self._metrics = io.TextIOWrapper(io.BufferedWriter(_FullDisk()), encoding="utf-8")

    monkeypatch.setattr(Trainer, "_open_logs", open_logs)
    assert _resume(run) == 2
    line = _error_lines(capsys)
    assert f"could not write {str(run / 'metrics.jsonl')!r}: No space left on device" in line


def test_metrics_jsonl_that_cannot_be_created_is_one_line(tmp_path, capsys, monkeypatch):
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "run"
    _fail_writes(monkeypatch, out / "metrics.jsonl", errno.ENOSPC)
    assert main(["train", "--data", str(data), "--out", str(out), "--steps", "2", *TINY]) == 2
    line = _error_lines(capsys)
    assert f"could not write {str(out / 'metrics.jsonl')!r}: No space left on device" in line


@pytest.mark.parametrize("plots", ["absent", "present"])
def test_plot_into_a_read_only_run_folder_is_one_line(run, capsys, monkeypatch, plots):
    pytest.importorskip("matplotlib")
    if plots == "present":
        (run / "plots").mkdir()
    before = _snapshot(run)
    _fail_writes(monkeypatch, run, errno.EROFS)
    assert main(["plot", str(run)]) == 2
    line = _error_lines(capsys)
    assert "could not write" in line and "Read-only file system" in line
    assert str(run / "plots") in line and line.endswith("then run the command again)")
    monkeypatch.undo()
    assert _snapshot(run) == before


# --------------------------------------------------------------------------- 11. umask


def test_export_folders_follow_the_umask(run, tmp_path, capsys):
    pytest.importorskip("transformers")
    old = os.umask(0o027)
    try:
        assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o750
