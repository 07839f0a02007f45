"""File helpers shared by the checkpoints and the kernel cache: fsync by path, sha256 of a file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["fsync_path", "sha256_file"]


def fsync_path(path: Path) -> None:
    """``fsync`` the file or folder at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
