"""Compile the C++ kernels on first use into a per-user cache, safely across processes.

The cache entry is ``<root>/<key>/aftlab_kernels.so`` with ``key`` made of the torch and Python
versions and a hash of the sources, the compiler flags and the compiler. A build holds an
``fcntl.flock`` on ``<root>/<key>.lock`` (released by the kernel when the process dies, unlike a
lock *file*), compiles into a fresh ``<key>.tmp*`` folder and renames it to ``<key>`` when done,
so a reader sees either no entry or a complete one.

Next to the library, ``aftlab_kernels.json`` records its size and sha256, written (and the library
fsynced) before that rename. The library is checked against it before it is loaded, since mapping
a truncated library faults (SIGBUS) instead of raising; one that does not match is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from .._files import fsync_path, sha256_file

NAME = "aftlab_kernels"
RECORD = f"{NAME}.json"  # the build record: {"bytes": ..., "sha256": ...} of the library
_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(_CSRC.glob("*.h")))


def compiler() -> str | None:
    """Path of the C++ compiler torch would use (``$CXX``, else ``c++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


# torch's AVX512 capability means F, DQ, VL and BW (ATen's CPU feature checks). GCC's default
# 256-bit preference is kept: 512-bit loops measured slower for aft-conv's band on an AMD EPYC
# (benchmarks/band_ab.py-style A/B, docs/kernels.md)
AVX512 = ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw"]


def cflags() -> list[str]:
    """Compiler flags. AVX2/FMA/F16C only where the CPU has AVX2 (every such x86 CPU has FMA and
    F16C), and AVX-512 (F, DQ, VL, BW: what torch's ``AVX512`` capability requires) where torch
    reports it; the flags are part of the cache key."""
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if cap == "AVX512":
        flags += AVX512
    return flags


def cache_root() -> Path:
    """``$AFTLAB_CACHE/kernels``, else ``$XDG_CACHE_HOME/aftlab/kernels`` or ``~/.cache/...``."""
    if os.environ.get("AFTLAB_CACHE"):
        return Path(os.environ["AFTLAB_CACHE"]) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "aftlab" / "kernels"


def build_key() -> str:
    """Name of the cache entry for this torch, Python, source text, flags and compiler."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(" ".join(cflags()).encode() + b"\0" + str(compiler()).encode())
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    return f"torch{torch.__version__}-py{py}-{h.hexdigest()[:16]}"


def library_path() -> Path:
    """Where the compiled library of this build key lives (whether or not it exists yet)."""
    return cache_root() / build_key() / f"{NAME}.so"


def seal(folder: Path) -> None:
    """Write the build record of the library in ``folder``; fsync the library, record, folder."""
    lib = folder / f"{NAME}.so"
    fsync_path(lib)
    with open(folder / RECORD, "w", encoding="utf-8") as f:
        json.dump({"bytes": lib.stat().st_size, "sha256": sha256_file(lib)}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(folder)


def check(lib: Path) -> str:
    """Why the library ``lib`` must not be loaded (its build record does not match), or ``""``."""
    try:
        size = lib.stat().st_size
    except FileNotFoundError:
        return "is missing"
    try:
        record = json.loads((lib.parent / RECORD).read_text(encoding="utf-8"))
        want, sha = int(record["bytes"]), str(record["sha256"])
    except FileNotFoundError:
        return f"has no build record ({RECORD})"
    except (OSError, ValueError, LookupError, TypeError, RecursionError) as e:
        return f"has an unreadable build record ({RECORD}: {type(e).__name__})"
    if size != want:
        return f"is {size} bytes, its build record says {want}"
    if sha256_file(lib) != sha:
        return "does not match the sha256 of its build record"
    return ""


def stamp(path: Path) -> tuple[int, int, int] | None:
    """``(inode, size, mtime)`` of the file at ``path``, None if absent: tells a replaced file."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _compile(folder: Path, verbose: bool) -> None:
    """Compile the library into ``folder`` (this process loads it from there)."""
    from torch.utils.cpp_extension import load

    load(
        NAME,
        [str(s) for s in SOURCES],
        extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )


def build(
    *, verbose: bool = False, failed: str = "", stale: tuple[int, int, int] | None = None
) -> Path:
    """Return the path of the compiled library, compiling it first if the cache lacks it or it
    does not match its build record (one line on stderr says which file and why).

    ``failed`` says why the library, of :func:`stamp` ``stale``, did not load: it is rebuilt
    unless another process has replaced it meanwhile.

    Raises whatever the compiler raises (the caller turns it into a warning and a fallback).
    """
    import fcntl  # POSIX only; an ImportError means "no kernels here"

    lib = library_path()
    if not (failed or check(lib)):
        return lib
    root, key = lib.parent.parent, lib.parent.name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"aftlab: waiting for another process to finish compiling the kernels "
                f"({root / key})",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        why = check(lib)  # after the wait: the process we waited for may have built it
        if not why and not (failed and stamp(lib) == stale):
            return lib
        for old in root.glob(f"{key}.tmp*"):  # left by a killed build: we hold the lock
            shutil.rmtree(old, ignore_errors=True)
        if lib.parent.exists():
            print(
                f"aftlab: rebuilding the CPU kernels (about a minute): {lib} {why or failed}",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(lib.parent)
        else:
            print(
                f"aftlab: compiling the CPU kernels once into {lib.parent} (about a minute)",
                file=sys.stderr,
                flush=True,
            )
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp", dir=root))
        t0 = time.perf_counter()
        _compile(tmp, verbose)
        seal(tmp)
        os.rename(tmp, lib.parent)  # atomic: other processes see all of it or nothing
        fsync_path(root)
        print(
            f"aftlab: kernels compiled in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return lib
