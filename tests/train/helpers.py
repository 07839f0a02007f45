"""Shared pieces of the training and CLI tests: a small text file and a tiny model config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: A model and budget small enough that a run takes about a second.
TINY = [
    "--set",
    "model.d_model=16",
    "--set",
    "model.n_layers=1",
    "--set",
    "model.n_heads=2",
    "--set",
    "seq_len=16",
    "--set",
    "batch_size=4",
    "--set",
    "warmup=2",
    "--set",
    "eval_interval=0",
    "--set",
    "eval_batches=2",
    "--set",
    "test_batches=2",
    "--set",
    "sample_tokens=8",
    "--set",
    "log_interval=1",
    "--set",
    "device='cpu'",
]


def write_text(path: Path, n_bytes: int = 12_000) -> Path:
    """A deterministic English-like UTF-8 text file of about ``n_bytes`` bytes."""
    words = [
        "the",
        "model",
        "mixes",
        "tokens",
        "with",
        "weights",
        "über",
        "attention",
        "free",
        "λ",
        "def",
        "return",
        "(x)",
        "and",
        "a",
        "sum",
        "of",
        "keys",
    ]
    out, i = [], 0
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(words[(i * 7 + i // 3) % len(words)])
        i += 1
        if i % 11 == 0:
            out.append("\n")
    path.write_text(" ".join(out), encoding="utf-8")
    return path


def train_tiny(root: Path, steps: int) -> Path:
    """Train a :data:`TINY` run of ``steps`` steps on ``root/data.txt`` (written here) into
    ``root/run`` with the real command line, in this process; return the run folder."""
    from aftlab.cli import main

    data, out = write_text(root / "data.txt"), root / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--steps", str(steps), *TINY]
    assert main(args) == 0
    return out


#: Environment of the subprocesses: one thread each, so that runs are bitwise reproducible.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_aftlab(
    *args: str, cwd: Path, timeout: float = 120, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m aftlab ARGS`` in a subprocess and return its completed process."""
    env = {**ENV, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "aftlab", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
