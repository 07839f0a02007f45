"""The kernel cache's build record: a damaged or unloadable library is rebuilt, never mapped.

Each test gets a private cache (``AFTLAB_CACHE``) holding a copy of the suite's library, sealed
by the real code (:func:`_build.seal`); a rebuild copies that library in instead of compiling.
Loading happens in subprocesses: a truncated library mapped here would kill pytest (SIGBUS).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aftlab import kernels
from aftlab.kernels import _build

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"kernels unavailable: {kernels.status()['aft_simple'][1]}"
)

# `aftlab kernels` with the compile step replaced by a copy of the good library (argv[1]).
_CLI = """
import shutil, sys
from aftlab.cli import main
from aftlab.kernels import _build
_build._compile = lambda folder, verbose: shutil.copyfile(sys.argv[1], folder / f"{_build.NAME}.so")
sys.exit(main(["kernels"]))
"""


@pytest.fixture(scope="module")
def good_lib(tmp_path_factory):
    """A copy, outside any cache, of the library this process loaded."""
    copy = tmp_path_factory.mktemp("good") / f"{_build.NAME}.so"
    shutil.copyfile(_build.library_path(), copy)
    return copy


@pytest.fixture
def lib(tmp_path, monkeypatch, good_lib):
    """The library path of a private cache holding a sealed copy of the good library."""
    monkeypatch.setenv("AFTLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("AFTLAB_KERNELS", raising=False)
    path = _build.library_path()
    path.parent.mkdir(parents=True)
    shutil.copyfile(good_lib, path)
    _build.seal(path.parent)
    assert _build.check(path) == ""
    return path


def _kernels_cli(good_lib):
    return subprocess.run(
        [sys.executable, "-c", _CLI, str(good_lib)],
        capture_output=True, text=True, timeout=120,
    )


def _rebuilt(lib, good_lib, err, why):
    """One line said which library is rebuilt and why; the cache holds a good, sealed one."""
    said = [line for line in err.splitlines() if "rebuilding" in line]
    assert len(said) == 1, err
    assert said[0].startswith(f"aftlab: rebuilding the CPU kernels (about a minute): {lib} {why}")
    assert "pure-PyTorch" not in err, err
    assert _build.check(lib) == ""
    assert lib.read_bytes() == good_lib.read_bytes()


def _cpu_runs_cpp(stdout: str) -> bool:
    """Whether ``aftlab kernels`` printed the C++ kernels for every op on CPU tensors."""
    cpu = [line for line in stdout.splitlines() if " (cpu): " in line]
    return len(cpu) == len(kernels.OPS) and all(": cpp (compiled library " in x for x in cpu)


@pytest.mark.parametrize("size", [0, 64, 4096, "half"])
def test_truncated_library_is_rebuilt_before_it_is_loaded(lib, good_lib, size):
    full = lib.stat().st_size
    size = full // 2 if size == "half" else size
    os.truncate(lib, size)
    out = _kernels_cli(good_lib)
    assert out.returncode == 0, out.stderr  # 4 KiB and half: SIGBUS (rc -7) without the check
    assert _cpu_runs_cpp(out.stdout), out.stdout
    _rebuilt(lib, good_lib, out.stderr, f"is {size} bytes, its build record says {full}")


def test_library_that_fails_to_load_is_rebuilt_once(lib, good_lib):
    lib.write_bytes(b"not an ELF file\n" * 64)
    _build.seal(lib.parent)  # the record matches: only the loader can tell
    out = _kernels_cli(good_lib)
    assert out.returncode == 0, out.stderr
    assert _cpu_runs_cpp(out.stdout), out.stdout
    _rebuilt(lib, good_lib, out.stderr, "failed to load (")
    assert out.stderr.count("failed to load") == 1, out.stderr


@pytest.mark.parametrize(
    "damage, why",
    [
        ("byte", "does not match the sha256 of its build record"),
        ("no record", f"has no build record ({_build.RECORD})"),
        ("nested record", f"has an unreadable build record ({_build.RECORD}: RecursionError)"),
    ],
)
def test_library_not_matching_its_record_is_rebuilt(
    lib, good_lib, monkeypatch, capsys, damage, why
):
    record = lib.parent / _build.RECORD
    if damage == "byte":
        data = bytearray(lib.read_bytes())
        data[len(data) // 2] ^= 0xFF
        lib.write_bytes(data)
    elif damage == "no record":
        record.unlink()
    else:
        record.write_text("[" * 100_000)
    compiled = []
    monkeypatch.setattr(
        _build, "_compile",
        lambda folder, verbose: compiled.append(shutil.copyfile(good_lib, folder / lib.name)),
    )
    assert _build.build() == lib  # checked, not loaded: safe in this process
    assert len(compiled) == 1
    _rebuilt(lib, good_lib, capsys.readouterr().err, why)
    assert _build.build() == lib and len(compiled) == 1  # a matching library is kept


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_build_fsyncs_library_and_record_before_the_rename(tmp_path, monkeypatch, good_lib):
    monkeypatch.setenv("AFTLAB_CACHE", str(tmp_path))
    events = []
    fsync, rename = os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))
    )
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append("rename"), rename(a, b)))
    monkeypatch.setattr(
        _build, "_compile",
        lambda folder, verbose: shutil.copyfile(good_lib, folder / f"{_build.NAME}.so"),
    )
    lib = _build.build()
    names = [Path(e).name if e != "rename" else e for e in events]
    assert names[-2:] == ["rename", lib.parent.parent.name]  # then the cache folder
    before = names[: names.index("rename")]
    assert before[:2] == [lib.name, _build.RECORD] and before[2].startswith(lib.parent.name)
    assert _build.check(lib) == ""


def test_failed_rebuild_raises_and_leaves_no_entry(lib, monkeypatch, capsys):
    os.truncate(lib, 64)

    def broken(folder, verbose):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(_build, "_compile", broken)
    with pytest.raises(RuntimeError, match="compiler exploded"):  # load() falls back with it
        _build.build()
    assert "rebuilding" in capsys.readouterr().err
    assert _build.check(lib) == "is missing"  # the next process compiles again
