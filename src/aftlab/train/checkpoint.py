"""Checkpoints that survive a kill: atomic folders with a sha256 manifest; the run-folder lock.

Layout of one checkpoint, ``RUN/checkpoints/step_00000100/``:

* ``model.safetensors``        the model weights (tied weights stored once), safetensors format;
* ``config.json``              ``{"train": TrainConfig.to_dict(), "model": ..., "task": ...}``;
* ``train_state.safetensors``  the tensors of the training state: optimizer moments, the torch
  and NumPy RNG states;
* ``train_state.json``         the rest of it: step, tokens seen, optimizer hyper-parameters,
  Python's RNG state, each tensor replaced by ``{"tensor": its name in the .safetensors}``;
* ``manifest.json``            ``{"step": 100, "files": {name: {"sha256": ..., "bytes": ...}}}``.

Nothing is pickled: a checkpoint is safetensors and JSON, so loading one cannot run code. A
checkpoint of an older aftlab with a pickled ``train_state.pt`` is refused, never unpickled.

A checkpoint is written into ``checkpoints/.tmp-step_...`` (every file flushed and ``fsync``-ed,
the manifest last), then renamed into place with ``os.replace`` and the folder ``fsync``-ed, so a
folder named ``step_*`` is always complete; a failed write (disk full) removes its ``.tmp-*``
folder, and one left by a kill is removed when the run is next locked (:class:`RunLock`).
Loading verifies every checksum: a truncated or edited file is reported, never loaded. Old
checkpoints beyond the last ``keep_last`` are renamed away, then deleted.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from .._files import fsync_path as _fsync_path
from .._files import sha256_file as _sha256
from .._json import dumps
from .errors import UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "rng_state",
    "set_rng_state",
    "atomic_write_text",
    "RunLock",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_TENSORS = "train_state.safetensors"
STATE_JSON = "train_state.json"
MANIFEST_FILE = "manifest.json"
FILES = (MODEL_FILE, CONFIG_FILE, STATE_TENSORS, STATE_JSON)
LEGACY_STATE = "train_state.pt"  # a pickle, written by older versions: refused, never loaded
LOCK_FILE = ".lock"


def _write_error(what: str, e: Exception) -> UsageError:
    """A failed write (disk full, read-only, ...) as the one-line error of the command line."""
    reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
    return UsageError(
        f"could not write {what}: {reason} (free some space or fix the permissions, then "
        "continue with --resume)"
    )


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temporary file, fsync, ``os.replace``.

    Raises:
        UsageError: the write failed (e.g. disk full); the temporary file is removed and
            ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_error(str(path), e) from None


def rng_state() -> dict[str, Any]:
    """Every random generator's state: Python, NumPy, torch CPU and (when present) CUDA.

    Made of tensors, numbers and lists only, so that :func:`save_checkpoint` stores it without
    pickling.
    """
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by :func:`rng_state` (lists may stand for its tuples)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _split_tensors(obj: Any, tensors: dict[str, torch.Tensor], name: str) -> Any:
    """``obj`` as JSON data: each tensor goes into ``tensors`` and becomes ``{"tensor": name}``.

    Every JSON object of the result is a tag: ``{"tensor": name}``, ``{"dict": {...}}`` (string
    keys) or ``{"int_dict": {...}}`` (integer keys, as in an optimizer's state).
    """
    if isinstance(obj, torch.Tensor):
        tensors[name] = obj.detach().cpu().contiguous()
        return {"tensor": name}
    if isinstance(obj, dict):
        tag = "dict" if all(isinstance(k, str) for k in obj) else "int_dict"
        if tag == "int_dict" and not all(isinstance(k, int) for k in obj):
            raise TypeError(f"training state {name}: keys must be all str or all int")
        return {tag: {str(k): _split_tensors(v, tensors, f"{name}.{k}") for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return [_split_tensors(v, tensors, f"{name}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"training state {name}: cannot store a {type(obj).__name__}")


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_split_tensors` (tuples come back as lists)."""
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    if isinstance(obj, dict):
        ((tag, value),) = obj.items()
        if tag == "tensor":
            return tensors[value]
        if tag in ("dict", "int_dict"):
            key = int if tag == "int_dict" else str
            return {key(k): _join_tensors(v, tensors) for k, v in value.items()}
        raise ValueError(f"unknown tag {tag!r}")
    return obj


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
    model: nn.Module | dict[str, torch.Tensor],
    config: dict[str, Any],
    train_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep_last``.

    The caller holds the run's :class:`RunLock` (no other process writes into ``run_dir``).

    Args:
        run_dir: the run folder; checkpoints go to ``run_dir/checkpoints/step_{step:08d}``.
        step: optimizer steps completed.
        model: the (unwrapped) model whose weights are saved, or its full state dict with each
            tied tensor under one name (a sharded model's, gathered by
            :func:`aftlab.train.distributed.full_model_state`).
        config: JSON-serialisable configs (``{"train": ..., "model": ...}``).
        train_state: optimizer state, RNG states and counters: nested dicts (string or integer
            keys), lists, tuples, tensors, numbers, strings and ``None``.
        keep_last: number of checkpoints to keep.

    Returns:
        The checkpoint folder.

    Raises:
        UsageError: the write failed (e.g. disk full); the partial ``.tmp-*`` folder is removed
            and the checkpoints already there are untouched.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tensors: dict[str, torch.Tensor] = {}
    state_json = json.dumps(
        _split_tensors(train_state, tensors, "state"), allow_nan=False, indent=1, sort_keys=True
    )
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        meta = {"format": "pt", "step": str(step)}
        if isinstance(model, nn.Module):
            save_model(model, str(tmp / MODEL_FILE), metadata=meta)
        else:
            save_file(model, str(tmp / MODEL_FILE), metadata=meta)
        save_file(tensors, str(tmp / STATE_TENSORS), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        (tmp / STATE_JSON).write_text(state_json, encoding="utf-8")
        files = {}
        for fname in FILES:
            _fsync_path(tmp / fname)
            files[fname] = {"sha256": _sha256(tmp / fname), "bytes": (tmp / fname).stat().st_size}
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
            f.write(dumps({"step": step, "files": files}, indent=2, sort_keys=True))
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
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        raise _write_error(f"checkpoint {str(root / name)!r}", e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; the debris after a failure
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        trash = root / f".tmp-del-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; return the manifest.

    Raises:
        UsageError: a file is missing, has the wrong size or the wrong sha256, or the checkpoint
            has a pickled training state (an older aftlab's ``train_state.pt``, never loaded).
    """
    path = Path(path)
    what = "delete this checkpoint folder to fall back to the previous one, or retrain"
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files, step = manifest["files"], manifest["step"]
        if not (isinstance(files, dict) and isinstance(step, int)):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"checkpoint {str(path)!r} has no readable {MANIFEST_FILE} ({what})"
        ) from None
    if LEGACY_STATE in files or (path / LEGACY_STATE).exists():
        raise UsageError(
            f"checkpoint {str(path)!r} has a pickled training state ({LEGACY_STATE}, written by an "
            "older aftlab); aftlab does not load pickles, which can run code: retrain the run"
        )
    for fname in FILES:
        f = path / fname
        entry = files.get(fname)
        if not isinstance(entry, dict) or not f.is_file():
            raise UsageError(f"checkpoint {str(path)!r} is incomplete: {fname} is missing ({what})")
        if f.stat().st_size != entry.get("bytes") or _sha256(f) != entry.get("sha256"):
            raise UsageError(
                f"checkpoint {str(path)!r} is damaged: {fname} does not match its sha256 in "
                f"{MANIFEST_FILE} (truncated or modified; {what})"
            )
    return manifest


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a verified checkpoint folder."""
    verify_checkpoint(path)
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except ValueError as e:
        raise UsageError(
            f"checkpoint {str(path)!r} has an unreadable {CONFIG_FILE} ({e})"
        ) from None


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    map_location: str | torch.device = "cpu",
    with_state: bool = True,
) -> dict[str, Any]:
    """Verify a checkpoint, load its weights into ``model`` and return its training state.

    Args:
        path: the checkpoint folder.
        model: receives the weights.
        map_location: where the weights go (the training state's tensors stay on the CPU).
        with_state: read the training state (``False``: return only ``{"step": ...}`` from the
            manifest; evaluation, sampling and plotting never read the training state).

    Raises:
        UsageError: damaged checkpoint, weights that do not fit ``model`` (config mismatch), or
            an unreadable training state.
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
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
        return {"step": manifest["step"]}
    try:
        tensors = load_file(str(path / STATE_TENSORS), device="cpu")
        state = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
        return _join_tensors(state, tensors)
    except Exception as e:  # a consistent but malformed state: safetensors' and json's errors
        raise UsageError(
            f"checkpoint {str(path)!r} has an unreadable training state ({type(e).__name__}: "
            f"{e}); delete this checkpoint folder to fall back to the previous one"
        ) from None


class RunLock:
    """An exclusive lock on a run folder: one training process writes into it at a time.

    ``flock`` on ``RUN/.lock`` (non-blocking); the kernel releases it when the process ends,
    however it ends, so a lock never outlives its holder. While it is held, every ``.tmp-*`` in
    the run folder and its ``checkpoints/`` is debris of an earlier, dead process
    (:meth:`remove_stale_temporaries`).

    Args:
        run_dir: the run folder (created if absent).

    Raises:
        UsageError: another process holds the lock, or the folder cannot be created.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created = False  # this lock made the folder (removed again if left empty)
        try:
            try:
                self.run_dir.mkdir(parents=True)
                self._created = True
            except FileExistsError:
                pass
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(
                f"cannot use run folder {str(self.run_dir)!r}: {e.strerror or e}"
            ) from None
        if fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip()
                self._created = False  # the holder's folder now: touch nothing
                self.release()
                raise UsageError(
                    f"run folder {str(self.run_dir)!r} is in use: another process "
                    f"({'pid ' + holder if holder else 'unknown pid'}) is training into it; "
                    "wait for it to finish, or choose another --out"
                ) from None
            except OSError as e:  # e.g. a network filesystem without flock
                self._created = False
                self.release()
                raise UsageError(
                    f"cannot lock run folder {str(self.run_dir)!r}: {e.strerror or e} (use a "
                    "local filesystem for --out)"
                ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def remove_stale_temporaries(self) -> None:
        """Delete the ``.tmp-*`` files and folders a killed writer left (safe under the lock)."""
        for stale in [*self.run_dir.glob(".tmp-*"), *self.run_dir.glob("checkpoints/.tmp-*")]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def release(self) -> None:
        """Give the lock back (closing the file releases the ``flock``).

        A folder this lock created, in which nothing else was written (the run failed at once,
        e.g. on bad data), is removed again.
        """
        if self._fd is None:
            return
        if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            (self.run_dir / LOCK_FILE).unlink()
            self.run_dir.rmdir()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
