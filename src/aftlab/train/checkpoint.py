"""Checkpoints that survive a kill: atomic folders with a sha256 manifest.

Layout of one checkpoint, ``RUN/checkpoints/step_00000100/``:

* ``model.safetensors``  the model weights (tied weights stored once), safetensors format;
* ``config.json``        ``{"train": TrainConfig.to_dict(), "model": TransformerConfig.to_dict()}``;
* ``train_state.pt``     ``torch.save`` of the optimizer state, step, tokens seen and the RNG
  states (Python, NumPy, torch CPU and CUDA); the learning rate is a function of the step;
* ``manifest.json``      ``{"step": 100, "files": {name: {"sha256": ..., "bytes": ...}}}``.

A checkpoint is written into ``checkpoints/.tmp-step_...`` (every file flushed and ``fsync``-ed,
the manifest last), then renamed into place with ``os.replace`` and the folder ``fsync``-ed, so a
folder named ``step_*`` is always complete; a kill leaves at most a ``.tmp-*`` folder, removed on
the next save. Loading verifies every checksum: a truncated or edited file is reported, never
loaded. Old checkpoints beyond the last ``keep_last`` are renamed away, then deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from .errors import UsageError

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "rng_state",
    "set_rng_state",
    "atomic_write_text",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_FILE = "train_state.pt"
MANIFEST_FILE = "manifest.json"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temporary file, fsync, ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def rng_state() -> dict[str, Any]:
    """Every random generator's state: Python, NumPy, torch CPU and (when present) CUDA."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders of a run as ``(step, path)``, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint folder of a run, or ``None``."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def save_checkpoint(
    run_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    config: dict[str, Any],
    train_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep_last``.

    Args:
        run_dir: the run folder; checkpoints go to ``run_dir/checkpoints/step_{step:08d}``.
        step: optimizer steps completed.
        model: the (unwrapped) model whose weights are saved.
        config: JSON-serialisable configs (``{"train": ..., "model": ...}``).
        train_state: optimizer state, RNG states and counters, saved with ``torch.save``.
        keep_last: number of checkpoints to keep.

    Returns:
        The checkpoint folder.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a kill during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    save_model(model, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
    with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save(train_state, f)
    files = {}
    for fname in (MODEL_FILE, CONFIG_FILE, STATE_FILE):
        _fsync_path(tmp / fname)
        files[fname] = {"sha256": _sha256(tmp / fname), "bytes": (tmp / fname).stat().st_size}
    with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
        json.dump({"step": step, "files": files}, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(tmp)
    final = root / name
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one away first
        old = root / f".tmp-old-{name}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_path(root)
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        trash = root / f".tmp-del-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; return the manifest.

    Raises:
        UsageError: a file is missing, has the wrong size or the wrong sha256.
    """
    path = Path(path)
    what = "delete this checkpoint folder to fall back to the previous one, or retrain"
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"checkpoint {str(path)!r} has no readable {MANIFEST_FILE} ({what})"
        ) from None
    for fname in (MODEL_FILE, CONFIG_FILE, STATE_FILE):
        f = path / fname
        entry = files.get(fname)
        if entry is None or not f.is_file():
            raise UsageError(f"checkpoint {str(path)!r} is incomplete: {fname} is missing ({what})")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise UsageError(
                f"checkpoint {str(path)!r} is damaged: {fname} does not match its sha256 in "
                f"{MANIFEST_FILE} (truncated or modified; {what})"
            )
    return manifest


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a verified checkpoint folder."""
    verify_checkpoint(path)
    return json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    map_location: str | torch.device = "cpu",
    with_state: bool = True,
) -> dict[str, Any]:
    """Verify a checkpoint, load its weights into ``model`` and return its training state.

    Raises:
        UsageError: damaged checkpoint, or weights that do not fit ``model`` (config mismatch).
    """
    path = Path(path)
    verify_checkpoint(path)
    try:
        missing, unexpected = load_model(
            model, str(path / MODEL_FILE), strict=False, device=str(map_location)
        )
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"checkpoint {str(path)!r} does not match the model built from the config ({first}); "
            "use the config the run was trained with"
        ) from None
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {str(path)!r} does not match the model built from the config "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); "
            "use the config the run was trained with"
        )
    if not with_state:
        return {}
    return torch.load(path / STATE_FILE, map_location=map_location, weights_only=False)
