"""Compile the C++ kernels on first use into a per-user cache, safely across processes.

The cache entry is ``<root>/<key>/aftlab_kernels.so`` with ``key`` made of the torch and Python
versions and a hash of the sources, the compiler flags and the compiler. A build holds an
``fcntl.flock`` on ``<root>/<key>.lock`` (released by the kernel when the process dies, unlike a
lock *file*), compiles into a fresh ``<key>.tmp*`` folder and renames it to ``<key>`` when done,
so a reader sees either no entry or a complete one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

NAME = "aftlab_kernels"
_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(_CSRC.glob("*.h")))


def compiler() -> str | None:
    """Path of the C++ compiler torch would use (``$CXX``, else ``c++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cflags() -> list[str]:
    """Compiler flags. AVX2/FMA only where the CPU has them (it is part of the cache key)."""
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
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


def build(*, verbose: bool = False) -> Path:
    """Return the path of the compiled library, compiling it first if the cache lacks it.

    Raises whatever the compiler raises (the caller turns it into a warning and a fallback).
    """
    import fcntl  # POSIX only; an ImportError means "no kernels here"

    lib = library_path()
    if lib.exists():
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
        if lib.exists():  # built by the process we waited for
            return lib
        for stale in root.glob(f"{key}.tmp*"):  # left by a killed build: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if lib.parent.exists():  # an entry without its library
            shutil.rmtree(lib.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp", dir=root))
        print(
            f"aftlab: compiling the CPU kernels once into {lib.parent} (about a minute)",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        from torch.utils.cpp_extension import load

        # Compiles into tmp and loads the library from there (this process keeps it mapped).
        load(
            NAME,
            [str(s) for s in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(tmp),
            is_python_module=False,
            verbose=verbose,
        )
        os.rename(tmp, lib.parent)  # atomic: other processes see all of it or nothing
        print(
            f"aftlab: kernels compiled in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return lib
