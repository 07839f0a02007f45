"""Checkpoints that survive a kill: atomic folders with a sha256 manifest; the run-folder lock.

Layout of one checkpoint, ``RUN/checkpoints/step_00000100/``:

* ``model.safetensors``        the model weights (tied weights stored once), safetensors format;
* ``config.json``              ``{"train": TrainConfig.to_dict(), "model": ..., "task": ...}``:
  the config as written, the TransformerConfig built from it, the task's ``info()``;
* ``train_state.safetensors``  the tensors of the training state: optimizer moments, the torch
  and NumPy RNG states;
* ``train_state.json``         the rest of it: step, tokens seen, optimizer hyper-parameters,
  Python's RNG state, each tensor replaced by ``{"tensor": its name in the .safetensors}``;
* ``carried_state.safetensors`` (``carry_state`` runs only) the model state carried from this
  step to the next (docs/training.md, "Carried state"): each tensor of the
  :class:`~aftlab.models.DecodingCache` by its field path (``states.0.gone.a``), the plain
  values (positions, ``batch_size``) as JSON in the file's metadata (``"values"``);
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

import contextlib
import errno
import json
import os
import random
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from .._checks import DTypeError, check_state_dtypes
from .._files import fsync_path, sha256_file
from .._json import dumps
from ..errors import READ_ERRORS, UsageError, reason

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
    "load_carried_state",
    "rng_state",
    "set_rng_state",
    "atomic_write_text",
    "atomic_write_bytes",
    "open_run_file",
    "run_subdir",
    "run_started",
    "lock_holder",
    "RunLock",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_TENSORS = "train_state.safetensors"
STATE_JSON = "train_state.json"
MANIFEST_FILE = "manifest.json"
FILES = (MODEL_FILE, CONFIG_FILE, STATE_TENSORS, STATE_JSON)
CARRIED_FILE = "carried_state.safetensors"  # written by carry_state runs only
LEGACY_STATE = "train_state.pt"  # a pickle, written by older versions: refused, never loaded
LOCK_FILE = ".lock"
_STARTED = time.strftime("%Y-%m-%d %H:%M:%S")  # when this process loaded aftlab (its lock says)


def _write_error(what: str, e: Exception, retry: str = "continue with --resume") -> UsageError:
    """A failed write (disk full, read-only, ...) as the one-line error of the command line."""
    return UsageError(
        f"could not write {what}: {reason(e)} (free some space or fix the permissions, then "
        f"{retry})"
    )


def _what_is(path: Path) -> str:
    """What stands at ``path``, for an error: a symbolic link (and to what), a folder, ..."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)!r}"
    if stat.S_ISREG(st.st_mode):
        return f"a file with {st.st_nlink} hard links"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    return "a named pipe" if stat.S_ISFIFO(st.st_mode) else "a socket or device"


def _not_ours(path: Path, expected: str) -> UsageError:
    return UsageError(
        f"{str(path)!r} is {_what_is(path)}, not {expected}: aftlab writes into a run folder's "
        "own files only, never through a link or into a special file (remove it, or choose "
        "another --out)"
    )


def open_run_file(path: str | Path, flags: int) -> int:
    """``os.open(path, flags)`` for a file of a run folder, never through a link.

    Refused: a symbolic link, anything but a regular file, and (opened for writing) a file with
    another hard link; so a name planted in a run folder never redirects a write.

    Raises:
        UsageError: ``path`` is one of those (named, with what it is).
        OSError: the open itself failed (e.g. disk full, read-only).
    """
    path = Path(path)
    writes = bool(flags & (os.O_WRONLY | os.O_RDWR))

    def ours(st: os.stat_result) -> bool:
        return stat.S_ISREG(st.st_mode) and not (writes and st.st_nlink > 1)

    if os.path.lexists(path) and not ours(os.lstat(path)):  # a pipe or device stays unopened
        raise _not_ours(path, "a regular file")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) and os.path.lexists(path):
            raise _not_ours(path, "a regular file") from None  # planted since the check
        raise
    if not ours(os.fstat(fd)):
        os.close(fd)
        raise _not_ours(path, "a regular file")
    return fd


def run_subdir(path: str | Path) -> Path:
    """The folder ``path`` of a run folder (``checkpoints``, ``tb``, ``plots``), created if absent.

    Raises:
        UsageError: ``path`` is a symbolic link or not a folder.
        OSError: it cannot be created (e.g. read-only).
    """
    path = Path(path)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise _not_ours(path, "a folder") from None
    return path


def atomic_write_bytes(
    path: str | Path, data: bytes, *, retry: str = "continue with --resume"
) -> None:
    """Write ``data`` to ``path`` atomically: new temporary file, fsync, ``os.replace``.

    The temporary file is created anew (``O_EXCL``), so nothing planted at its name (a link) is
    written through; ``os.replace`` replaces a link at ``path`` rather than following it.

    Raises:
        UsageError: the write failed (e.g. disk full); the temporary file is removed and
            ``path`` is left as it was. ``retry`` ends the message (what to do after).
    """
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # an earlier process's, with this pid (or a planted link)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _write_error(str(path), e, retry) from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write_bytes`).

    Raises:
        UsageError: the write failed (e.g. disk full); the temporary file is removed and
            ``path`` is left as it was.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


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
    carried: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
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
        carried: the carried state as ``(tensors, values)`` by field path
            (:func:`aftlab.train.streams.flatten_state`), written to ``carried_state.safetensors``
            (the values JSON in its metadata); ``None``: no such file.

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
        root.parent.mkdir(parents=True, exist_ok=True)
        run_subdir(root)  # never a link
        tmp.mkdir()
        meta = {"format": "pt", "step": str(step)}
        if isinstance(model, nn.Module):
            save_model(model, str(tmp / MODEL_FILE), metadata=meta)
        else:
            save_file(model, str(tmp / MODEL_FILE), metadata=meta)
        save_file(tensors, str(tmp / STATE_TENSORS), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        (tmp / STATE_JSON).write_text(state_json, encoding="utf-8")
        written = FILES
        if carried is not None:
            state = {k: v.detach().cpu().clone() for k, v in carried[0].items()}  # no shared memory
            values = json.dumps(carried[1], allow_nan=False, sort_keys=True)
            save_file(state, str(tmp / CARRIED_FILE), metadata={"format": "pt", "values": values})
            written = (*FILES, CARRIED_FILE)
        files = {}
        for fname in written:
            fsync_path(tmp / fname)
            size = (tmp / fname).stat().st_size
            files[fname] = {"sha256": sha256_file(tmp / fname), "bytes": size}
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
            f.write(dumps({"step": step, "files": files}, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        final = root / name
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one away first
            old = root / f".tmp-old-{name}-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(root)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        raise _write_error(f"checkpoint {str(root / name)!r}", e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; the debris after a failure
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        trash = root / f".tmp-del-{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return final


def _check_location(path: Path) -> None:
    """Refuse a checkpoint folder that is a link, or that lies outside ``RUN/checkpoints``."""
    refused = f"checkpoint {str(path)!r} is refused"
    if path.is_symlink():
        raise UsageError(
            f"{refused}: it is a symbolic link (to {os.readlink(path)!r}), and a checkpoint must "
            "be a folder of its own run; remove the link"
        )
    inside = path.parent.parent.resolve() / path.parent.name
    if path.resolve().parent != inside:
        raise UsageError(
            f"{refused}: it resolves to {str(path.resolve())!r}, and a checkpoint must lie inside "
            f"its run's {str(inside)!r}; remove the link on the way"
        )


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; return the manifest.

    Raises:
        UsageError: the folder or one of its files is a symbolic link, or the folder lies
            outside its run's ``checkpoints/``; the manifest's step is not the folder's
            ``step_N``; a file is missing, has the wrong size or the wrong sha256, or the
            checkpoint has a pickled training state (an older aftlab's ``train_state.pt``,
            never loaded).
    """
    path = Path(path)
    what = "delete this checkpoint folder to fall back to the previous one, or retrain"
    _check_location(path)
    for fname in (MANIFEST_FILE, *FILES, CARRIED_FILE):
        if (path / fname).is_symlink():
            raise UsageError(
                f"checkpoint {str(path)!r} is refused: its {fname} is a symbolic link, and a "
                f"checkpoint's files must be its own ({what})"
            )
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files, step = manifest["files"], manifest["step"]
        if not (isinstance(files, dict) and isinstance(step, int)):
            raise TypeError
    except (*READ_ERRORS, KeyError, TypeError):
        raise UsageError(
            f"checkpoint {str(path)!r} has no readable {MANIFEST_FILE} ({what})"
        ) from None
    named = _STEP_RE.match(path.name)
    if named and int(named.group(1)) != step:
        raise UsageError(
            f"checkpoint {str(path)!r} is refused: its {MANIFEST_FILE} says step {step}, and a "
            f"checkpoint's step must match its folder's name (renamed or copied in?; {what})"
        )
    if LEGACY_STATE in files or (path / LEGACY_STATE).exists():
        raise UsageError(
            f"checkpoint {str(path)!r} has a pickled training state ({LEGACY_STATE}, written by an "
            "older aftlab); aftlab does not load pickles, which can run code: retrain the run"
        )
    if (path / CARRIED_FILE).exists() and CARRIED_FILE not in files:
        raise UsageError(
            f"checkpoint {str(path)!r} is damaged: its {CARRIED_FILE} is not in {MANIFEST_FILE} "
            f"(copied in?; {what})"
        )
    for fname in (*FILES, *([CARRIED_FILE] if CARRIED_FILE in files else [])):
        f = path / fname
        entry = files.get(fname)
        if not isinstance(entry, dict) or not f.is_file():
            raise UsageError(f"checkpoint {str(path)!r} is incomplete: {fname} is missing ({what})")
        if f.stat().st_size != entry.get("bytes") or sha256_file(f) != entry.get("sha256"):
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
    except READ_ERRORS as e:
        raise UsageError(
            f"checkpoint {str(path)!r} has an unreadable {CONFIG_FILE} ({reason(e)})"
        ) from None


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    map_location: str | torch.device = "cpu",
    with_state: bool = True,
) -> dict[str, Any]:
    """Verify a checkpoint, load its weights into ``model`` and return its training state.

    A floating-point weight of any precision is cast to the model's dtype; any other dtype
    (integer, bool, complex) must be the model's own (:func:`aftlab._checks.check_state_dtypes`).

    Args:
        path: the checkpoint folder.
        model: receives the weights.
        map_location: where the weights go (the training state's tensors stay on the CPU).
        with_state: read the training state (``False``: return only ``{"step": ...}`` from the
            manifest; evaluation, sampling and plotting never read the training state).

    Raises:
        UsageError: damaged checkpoint, weights of a dtype or shape that do not fit ``model``
            (config mismatch), or an unreadable training state.
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        weights = load_file(str(path / MODEL_FILE), device=str(map_location))
    except READ_ERRORS as e:
        raise UsageError(
            f"checkpoint {str(path)!r} has an unreadable {MODEL_FILE} ({reason(e)}); delete this "
            "checkpoint folder to fall back to the previous one"
        ) from None
    own = model.state_dict()
    try:
        dtypes = {k: v.dtype for k, v in weights.items()}
        check_state_dtypes(f"checkpoint {str(path)!r}: {MODEL_FILE}", dtypes, own)
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except DTypeError as e:
        raise UsageError(str(e)) from None
    except (RuntimeError, ValueError) as e:
        raise UsageError(
            f"checkpoint {str(path)!r} does not match the model built from the config "
            f"({reason(e)}); use the config the run was trained with"
        ) from None
    # a tied weight (the head sharing the embedding) is stored once, under one of its names
    loaded = {own[k].data_ptr() for k in weights if k in own and own[k].numel()}
    missing = [k for k in missing if own[k].data_ptr() not in loaded]
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


def load_carried_state(
    path: str | Path,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The carried state ``(tensors, values)`` of a checkpoint verified by :func:`load_checkpoint`
    (``carried_state.safetensors``), or ``None`` when it has none.

    Raises:
        UsageError: the file is unreadable, or its metadata holds no JSON ``values``.
    """
    f = Path(path) / CARRIED_FILE
    if not f.is_file():
        return None
    try:
        tensors = load_file(str(f), device="cpu")
        with safe_open(str(f), framework="pt") as handle:
            values = json.loads((handle.metadata() or {})["values"])
        if not isinstance(values, dict):
            raise TypeError(f"values is a {type(values).__name__}, not an object")
    except Exception as e:  # safetensors', json's and the metadata's errors alike
        raise UsageError(
            f"checkpoint {str(path)!r} has an unreadable {CARRIED_FILE} ({type(e).__name__}: "
            f"{e}); delete this checkpoint folder to fall back to the previous one"
        ) from None
    return tensors, values


def run_started(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run: anything but nothing, or its lock and ``.tmp-*`` debris.

    A run killed between taking the lock and writing ``config.toml`` leaves only those; its
    folder is a new run (the debris is removed under the lock).
    """
    d = Path(run_dir)
    if not d.exists():
        return False
    if not d.is_dir():
        return True
    names = [p.name for p in d.iterdir()]
    debris = all(n == LOCK_FILE or n.startswith(".tmp-") for n in names)
    return not (debris and (not names or LOCK_FILE in names))


def _holder(raw: bytes) -> str:
    """Who a lock file names: ``(pid 1234) on host 'h', started 2026-01-01 12:00:00``."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        info = json.loads(text)
        return f"(pid {int(info['pid'])}) on host {info['host']!r}, started {info['started']}"
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"(pid {text})" if text.isdigit() else "(unknown pid)"  # an older aftlab's: a pid


def lock_holder(run_dir: str | Path) -> str:
    """The process ``run_dir``'s lock file names (its last holder), as :func:`_holder` says it."""
    try:
        fd = open_run_file(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except (OSError, UsageError):
        return "(unknown pid)"
    try:
        return _holder(os.pread(fd, 512, 0))
    finally:
        os.close(fd)


class RunLock:
    """An exclusive lock on a run folder: one training process writes into it at a time.

    ``flock`` on ``RUN/.lock`` (non-blocking); the kernel releases it when the process ends,
    however it ends, so a lock never outlives its holder. The file names its holder (pid, host,
    start time) and is never a link (:func:`open_run_file`). While it is held, every ``.tmp-*``
    in the run folder and its ``checkpoints/`` is debris of an earlier, dead process
    (:meth:`remove_stale_temporaries`).

    Args:
        run_dir: the run folder (created if absent).

    Raises:
        UsageError: another process holds the lock, ``.lock`` is a link or not a regular file,
            or the folder cannot be created.
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
            self._fd = open_run_file(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise UsageError(
                f"cannot use run folder {str(self.run_dir)!r}: {e.strerror or e}"
            ) from None
        if fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(os.pread(self._fd, 512, 0))
                self._created = False  # the holder's folder now: touch nothing
                self.release()
                raise UsageError(
                    f"run folder {str(self.run_dir)!r} is in use: another process {holder} is "
                    "training into it; wait for it to finish, or choose another --out"
                ) from None
            except OSError as e:  # e.g. a network filesystem without flock
                self._created = False
                self.release()
                raise UsageError(
                    f"cannot lock run folder {str(self.run_dir)!r}: {e.strerror or e} (use a "
                    "local filesystem for --out)"
                ) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _STARTED}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, dumps(me).encode(), 0)

    def intact(self) -> bool:
        """Whether the lock file held is still ``RUN/.lock`` (not deleted, nor moved with RUN)."""
        try:
            held, here = os.fstat(self._fd), os.lstat(self.run_dir / LOCK_FILE)
        except (OSError, TypeError):
            return False
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)

    def remove_stale_temporaries(self) -> None:
        """Delete the ``.tmp-*`` files and folders a killed writer left (safe under the lock)."""
        for stale in [*self.run_dir.glob(".tmp-*"), *self.run_dir.glob("checkpoints/.tmp-*")]:
            if stale.is_dir() and not stale.is_symlink():
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
        if (
            self._created
            and self.intact()
            and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]
        ):
            (self.run_dir / LOCK_FILE).unlink()
            self.run_dir.rmdir()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
