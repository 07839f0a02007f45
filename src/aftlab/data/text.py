"""Byte-level language modelling: any UTF-8 text (``text``), enwik8 and text8.

Every split is a NumPy ``uint8`` memory map (of the user's file, or of one cache file that
concatenates a folder), so no corpus is ever read into Python objects.

Splits:
    * one file: by position, the first 90% of its bytes train, the next 5% val, the last 5%
      test (``split_fractions`` changes this).
    * a folder: every text file under it (recursively; hidden names skipped; see
      :func:`list_text_files`). Each file goes whole to one split: files are ordered by the
      SHA-1 of their relative path, the first ``max(1, round(0.05 n))`` go to val, the next
      as many to test, the rest to train; within a split, files follow sorted relative path.
      The split depends only on the set of relative paths. A folder with fewer than 3 text
      files is concatenated and split like one file.
    * no ``data``: the ``.py`` files of Python's standard library, split like a folder.
    * enwik8 / text8: the standard first 90,000,000 / next 5,000,000 / last 5,000,000 bytes
      of the 100,000,000-byte file; a file of any other size is split 90/5/5 by position with
      a warning (so tests and quick runs can use small files).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import (
    IGNORE_INDEX,
    DataError,
    Task,
    batch_slices,
    check_batch_args,
    check_eval_args,
    check_input_path,
    check_window_args,
    shard,
    step_rng,
    take_options,
)

__all__ = [
    "ByteLMTask",
    "build_text",
    "build_enwik8",
    "build_text8",
    "list_text_files",
    "stdlib_files",
    "cache_dir",
]

_SNIFF = 8192
_STANDARD = (90_000_000, 5_000_000, 5_000_000)
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_CACHE_VERSION = "1"


# --------------------------------------------------------------------------- the task
class ByteLMTask(Task):
    """Next-byte prediction over three ``uint8`` arrays (train, val, test).

    Training windows start at uniformly random offsets ``o`` of the train split, drawn from
    ``(seed, step)``: ``input = x[o : o + T]``, ``target = x[o + 1 : o + T + 1]``.

    Evaluation scores every byte of a split except its first exactly once: window ``k`` has
    ``input = x[kT : kT + T]``, ``target = x[kT + 1 : kT + T + 1]`` for
    ``k = 0 .. floor((n - 1) / T) - 1``; the ``r`` bytes left over go into one last window,
    the final ``T + 1`` bytes of the split, whose first ``T - r`` targets (already scored) are
    ``-100``. Every window is full length with full left context, so no padding is needed.

    Long streams (docs/training.md): :meth:`consecutive_windows` reads the train split as
    contiguous streams (``carry_state``), :meth:`document_batch` adds the file boundaries of a
    folder corpus to the training rows (``pack_documents``), :meth:`stream` is a split as one
    stream (``aftlab eval --stream``).

    Args:
        name: task name.
        splits: ``{"train", "val", "test"}`` -> 1-d ``uint8`` arrays (memory maps).
        seq_len: context ``T``; every split must hold at least ``T + 1`` bytes.
        seed: seed of the training stream.
        metric: ``"bpb"`` (bits per byte) or ``"bpc"`` (bits per character).
        source: description for :meth:`info`.
        details: extra entries for :meth:`info`.
        documents: ``{split: offsets}``, where each file of a folder corpus begins in each split
            (sorted int64 offsets from 0), or ``None`` for one file (no boundaries).
    """

    kind = "lm"
    vocab_size = 256

    def __init__(
        self,
        name: str,
        splits: dict[str, np.ndarray],
        *,
        seq_len: int,
        seed: int,
        metric: str,
        source: str,
        details: dict[str, Any] | None = None,
        documents: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.name = name
        self.documents = documents
        self.seq_len = seq_len
        self.seed = seed
        self.metric = metric
        self.splits = splits
        self.source = source
        self.details = dict(details or {})
        for split, arr in splits.items():
            if len(arr) < seq_len + 1:
                total = sum(len(a) for a in splits.values())
                raise DataError(
                    f"{name}: {source} ({total:,} bytes) is too short for seq_len={seq_len}: its "
                    f"{split} split has {len(arr):,} bytes, fewer than one context of "
                    f"seq_len+1={seq_len + 1}; use more data or a smaller seq_len"
                )

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(source=self.source, split_bytes={k: len(v) for k, v in self.splits.items()})
        out.update(self.details)
        return out

    def _train_offsets(self, step: int, *, batch_size: int, rank: int, world_size: int):
        """This rank's window starts ``o`` of the training batch of ``step``, ``(B,)`` int64."""
        n, T = len(self.splits["train"]), self.seq_len
        offsets = step_rng(self.seed, step, 1).integers(0, n - T, size=batch_size * world_size)
        return shard(offsets, batch_size=batch_size, rank=rank)

    def _rows(self, split: str, offsets: np.ndarray) -> dict[str, torch.Tensor]:
        """``input = x[o : o + T]``, ``target = x[o + 1 : o + T + 1]`` for each offset ``o``."""
        x, T = self.splits[split], self.seq_len
        rows = torch.from_numpy(np.stack([x[o : o + T + 1] for o in offsets]).astype(np.int64))
        return {"input": rows[:, :-1].contiguous(), "target": rows[:, 1:].contiguous()}

    def _train_batch(
        self, step: int, *, batch_size: int, rank: int, world_size: int
    ) -> dict[str, torch.Tensor]:
        offsets = self._train_offsets(step, batch_size=batch_size, rank=rank, world_size=world_size)
        return self._rows("train", offsets)

    # ----------------------------------------------------------------- long streams
    def document_starts(self, split: str) -> np.ndarray | None:
        """Where each file of a folder corpus begins in ``split`` (offsets from 0), or ``None``
        for one file or a corpus (enwik8, text8), which have no boundaries."""
        return None if self.documents is None else self.documents[split]

    def stream(self, split: str) -> np.ndarray:
        """``split`` (``"val"`` or ``"test"``) as one ``uint8`` stream of byte ids."""
        self._check_split(split)
        return self.splits[split]

    def stream_geometry(self, streams: int) -> tuple[int, int]:
        """``(L, W)``: the train split cut into ``streams`` contiguous streams of ``L = floor(n /
        streams)`` bytes, each read as ``W = floor((L - 1) / T)`` consecutive windows.

        Raises:
            DataError: a stream is shorter than one window (``L < T + 1``).
        """
        n, T = len(self.splits["train"]), self.seq_len
        length = n // streams
        if length < T + 1:
            raise DataError(
                f"carry_state: the train split of {self.name} ({n:,} bytes) cut into "
                f"batch_size={streams} streams gives {length:,} bytes each, fewer than one "
                f"window of seq_len+1={T + 1}; use a smaller batch_size or seq_len, or more data"
            )
        return length, (length - 1) // T

    def consecutive_windows(
        self, step: int, *, batch_size: int, rank: int = 0, world_size: int = 1, windows: int = 1
    ) -> dict[str, torch.Tensor]:
        """Windows ``w = step k .. step k + k - 1`` (``k = windows``) of every training stream.

        The train split ``x`` (``n`` bytes) is cut into ``G = batch_size * world_size``
        contiguous streams of ``L = floor(n / G)`` bytes (stream ``r`` starts at ``r L``; the
        last ``n - G L`` bytes are never read), each read as ``W = floor((L - 1) / T)`` windows
        (:meth:`stream_geometry`). Window ``w`` of stream ``r`` starts at ``o = r L + (w mod W)
        T``: ``input = x[o : o + T]``, ``target = x[o + 1 : o + T + 1]``, so window ``w + 1``
        continues window ``w`` byte for byte, and every stream wraps to its start after ``W``
        windows. This rank reads streams ``[rank B, (rank + 1) B)``. A pure function of the
        arguments, like :meth:`train_batch`.

        Returns:
            ``{"input": (k, B, T), "target": (k, B, T), "reset": (k,) bool}``; ``reset[j]`` is
            True when window ``j`` begins every stream anew (``w mod W == 0``): the state carried
            into it must be the empty one.
        """
        check_window_args(
            f"{self.name}.consecutive_windows",
            step=step,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            windows=windows,
        )
        length, W = self.stream_geometry(batch_size * world_size)
        starts = (rank * batch_size + np.arange(batch_size, dtype=np.int64)) * length
        w = step * windows + np.arange(windows, dtype=np.int64)
        parts = [self._rows("train", starts + (i % W) * self.seq_len) for i in w]
        return {
            "input": torch.stack([p["input"] for p in parts]),
            "target": torch.stack([p["target"] for p in parts]),
            "reset": torch.from_numpy(w % W == 0),
        }

    def document_batch(
        self, step: int, *, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, torch.Tensor]:
        """:meth:`train_batch`'s rows (the same bytes) with the file boundaries inside them.

        Returns:
            ``{"input": (B, T), "target": (B, T), "doc_start": (B, T) bool}``: ``doc_start`` is
            True at each row's first position and where a file begins; a target that is the
            first byte of a file (the last byte of the file before predicting it) is ``-100``.
            :func:`~aftlab.data.base.pack_rows` packs it into one row with ``cu_seqlens``.

        Raises:
            DataError: the corpus is one file (no boundaries).
        """
        check_batch_args(
            f"{self.name}.document_batch",
            step=step,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
        )
        starts = self.document_starts("train")
        if starts is None:
            return super().document_batch(
                step, batch_size=batch_size, rank=rank, world_size=world_size
            )  # raises: no documents
        offsets = self._train_offsets(step, batch_size=batch_size, rank=rank, world_size=world_size)
        batch = self._rows("train", offsets)
        begins = np.isin(offsets[:, None] + np.arange(self.seq_len + 1), starts)
        doc_start = torch.from_numpy(begins[:, :-1].copy())
        doc_start[:, 0] = True
        batch["target"][torch.from_numpy(begins[:, 1:].copy())] = IGNORE_INDEX
        return {**batch, "doc_start": doc_start}

    def eval_windows(self, split: str) -> list[tuple[int, int]]:
        """``(start, first_scored)`` of every evaluation window of ``split``.

        A window reads ``x[start : start + T + 1]``; targets before index ``first_scored`` of
        the window are ``-100``.
        """
        n, T = len(self.splits[split]), self.seq_len
        full = (n - 1) // T
        windows = [(k * T, 0) for k in range(full)]
        rest = (n - 1) - full * T
        if rest:
            windows.append((n - 1 - T, T - rest))
        return windows

    def eval_batches(
        self, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        self._check_split(split)
        check_eval_args(f"{self.name}.eval_batches", batch_size=batch_size, max_batches=max_batches)
        x, T = self.splits[split], self.seq_len
        windows = self.eval_windows(split)
        for s in batch_slices(len(windows), batch_size=batch_size, max_batches=max_batches):
            chunk = windows[s]
            rows = torch.from_numpy(np.stack([x[s : s + T + 1] for s, _ in chunk]).astype(np.int64))
            target = rows[:, 1:].clone()
            for j, (_, first) in enumerate(chunk):
                target[j, :first] = IGNORE_INDEX
            yield {"input": rows[:, :-1].contiguous(), "target": target}

    def encode(self, text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a LongTensor ``(len,)`` of ids 0..255."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, tokens: torch.Tensor | np.ndarray | list[int]) -> str:
        """Text of a 1-d sequence of byte ids (invalid UTF-8 becomes U+FFFD)."""
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        bad = [t for t in ids if not 0 <= t < 256]
        if bad:
            raise ValueError(
                f"{self.name}.decode: 'tokens' must be byte ids in 0..255, got {bad[0]}"
            )
        return bytes(ids).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- sources
def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where concatenated corpora are cached.

    ``override``, else ``$AFTLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/aftlab``, else
    ``~/.cache/aftlab``.
    """
    if override is not None:
        return Path(override)
    if os.environ.get("AFTLAB_CACHE_DIR"):
        return Path(os.environ["AFTLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aftlab"


def _looks_like_text(head: bytes) -> bool:
    """No NUL byte and valid UTF-8, allowing a multi-byte character cut at the end."""
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.reason == "unexpected end of data" and err.start >= len(head) - 3
    return True


def _sniff(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_SNIFF)
    except OSError as err:
        raise DataError(f"cannot read {str(path)!r} ({err.strerror}); check --data") from None


def list_text_files(root: Path) -> list[Path]:
    """Relative paths of the non-empty text files under ``root``, sorted.

    Walks ``root`` recursively without following directory links, skips names starting with
    ``.`` (``.git``, ``.venv``) and ``__pycache__``, and keeps a file when its first 8 KiB
    hold no NUL byte and are valid UTF-8.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for fn in filenames:
            path = Path(dirpath) / fn
            if fn.startswith(".") or not path.is_file() or path.stat().st_size == 0:
                continue
            if _looks_like_text(_sniff(path)):
                found.append(path.relative_to(root))
    return sorted(found, key=lambda p: p.as_posix())


def stdlib_files() -> tuple[Path, list[Path]]:
    """Python's standard library root and its ``.py`` files, relative and sorted.

    Skips ``site-packages``, ``dist-packages``, the test packages (``test``, ``tests``,
    ``idle_test``), ``__pycache__`` and hidden names.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith(".")]
        for fn in filenames:
            path = Path(dirpath) / fn
            if fn.endswith(".py") and path.is_file() and path.stat().st_size > 0:
                found.append(path.relative_to(root))
    return root, sorted(found, key=lambda p: p.as_posix())


def assign_files(files: list[Path], *, fraction: float = 0.05) -> dict[str, list[Path]]:
    """Split files whole, by the SHA-1 of their relative paths.

    Files ordered by ``sha1(relative POSIX path)``: the first ``k = max(1, round(fraction n))``
    go to val, the next ``k`` to test, the rest to train; each split keeps sorted path order.
    The split is a function of the set of paths only (not of contents or listing order).
    Needs ``n >= 3``.
    """
    files = sorted(files, key=lambda p: p.as_posix())
    n = len(files)
    k = max(1, round(fraction * n))
    by_hash = sorted(files, key=lambda p: hashlib.sha1(p.as_posix().encode()).hexdigest())
    val, test = set(by_hash[:k]), set(by_hash[k : 2 * k])
    return {
        "train": [p for p in files if p not in val and p not in test],
        "val": [p for p in files if p in val],
        "test": [p for p in files if p in test],
    }


def _position_split(n: int, fractions: tuple[float, float, float]) -> tuple[int, int]:
    """Ends of train and val when ``n`` bytes are split by position in ``fractions``."""
    total = sum(fractions)
    train_end = math.floor(n * fractions[0] / total)
    val_end = train_end + math.floor(n * fractions[1] / total)
    return train_end, val_end


def _concat_cached(
    root: Path, groups: dict[str, list[Path]], *, tag: str, cache: Path
) -> tuple[np.ndarray, dict[str, tuple[int, int]], np.ndarray]:
    """Concatenate ``groups`` (train, val, test in order) into one cache file; memory-map it.

    The file name hashes the root, the relative paths, sizes and modification times, so a
    changed folder gets a new file; it is written to a temporary file, fsynced and renamed,
    so concurrent builders (one per rank) and a kill mid-write leave no partial cache.

    Returns:
        The memory map, ``{split: (start, end)}`` byte ranges and the offset where each file
        begins in the file (int64, in concatenation order).
    """
    h = hashlib.sha256(f"{_CACHE_VERSION}\0{root.resolve()}\0".encode())
    ranges, pos, begins = {}, 0, []
    for split in ("train", "val", "test"):
        start = pos
        for rel in groups[split]:
            st = (root / rel).stat()
            h.update(f"{split}\0{rel.as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            begins.append(pos)
            pos += st.st_size
        ranges[split] = (start, pos)
    path = cache / f"{tag}-{h.hexdigest()[:20]}.bin"
    if not (path.is_file() and path.stat().st_size == pos):
        _write_atomic(
            path,
            root,
            [rel for split in ("train", "val", "test") for rel in groups[split]],
            size=pos,
        )
    return np.memmap(path, dtype=np.uint8, mode="r"), ranges, np.array(begins, dtype=np.int64)


def _write_atomic(path: Path, root: Path, files: list[Path], *, size: int) -> None:
    """Write the concatenation of ``files`` to ``path``: temporary file, fsync, rename."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            for rel in files:
                with open(root / rel, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        if os.path.getsize(tmp) != size:
            raise DataError(f"files under {root} changed while being read; run again")
        os.replace(tmp, path)
    except OSError as err:
        raise DataError(
            f"cannot write the data cache {path} ({err.strerror or err}); set AFTLAB_CACHE_DIR to "
            "a writable folder with free space"
        ) from err
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _folder_splits(
    root: Path, files: list[Path], *, tag: str, cache: Path, fractions: tuple[float, float, float]
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, np.ndarray]]:
    """``(splits, details, documents)`` of a folder: the memory-mapped splits, what :meth:`info`
    adds, each split's file starts (:meth:`ByteLMTask.document_starts`)."""
    if len(files) >= 3:
        groups = assign_files(files, fraction=fractions[1] / sum(fractions))
        rule = "by file (SHA-1 of relative path)"
    else:
        groups = {"train": files, "val": [], "test": []}
        rule = "by position (fewer than 3 files)"
    mm, ranges, begins = _concat_cached(root, groups, tag=tag, cache=cache)
    if len(files) < 3:
        train_end, val_end = _position_split(len(mm), fractions)
        ranges = {"train": (0, train_end), "val": (train_end, val_end), "test": (val_end, len(mm))}
    splits = {k: mm[a:b] for k, (a, b) in ranges.items()}
    documents = {  # each split's file starts, from its own offset 0 (a split begins one)
        k: np.union1d([0], begins[(begins >= a) & (begins < b)] - a) for k, (a, b) in ranges.items()
    }
    details = {"files": {k: len(v) for k, v in groups.items()}, "split_rule": rule}
    return splits, details, documents


def _fractions(task: str, value: Any) -> tuple[float, float, float]:
    try:
        fr = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        fr = ()
    if len(fr) != 3 or min(fr) <= 0:
        raise DataError(
            f"task {task!r}: option 'split_fractions' must be 3 positive numbers (train, val, "
            f"test), got {value!r}"
        )
    return fr  # type: ignore[return-value]


def build_text(
    *, data: str | os.PathLike | None, seq_len: int, seed: int, **options: Any
) -> ByteLMTask:
    """The ``text`` task: byte-level LM of a UTF-8 file, a folder, or Python's stdlib sources.

    Options:
        cache_dir (str): where folder concatenations are cached (default: see :func:`cache_dir`).
        split_fractions (list of 3 numbers): train/val/test proportions, default ``[90, 5, 5]``
            (by position for one file; for a folder the val/test share of files).
    """
    opts = take_options(
        "text", options, {"cache_dir": (str, None), "split_fractions": ((list, tuple), None)}
    )
    fractions = (
        _fractions("text", opts["split_fractions"]) if opts["split_fractions"] else (90.0, 5.0, 5.0)
    )
    cache = cache_dir(opts["cache_dir"])
    splits, source, details, documents = _text_splits(data, cache=cache, fractions=fractions)
    return ByteLMTask(
        "text",
        splits,
        seq_len=seq_len,
        seed=seed,
        metric="bpb",
        source=source,
        details=details,
        documents=documents,
    )


def _text_splits(
    data: str | os.PathLike | None, *, cache: Path, fractions: tuple[float, float, float]
) -> tuple[dict[str, np.ndarray], str, dict[str, Any], dict[str, np.ndarray] | None]:
    """``(splits, source, details, documents)`` of the ``text`` task: stdlib sources, a folder
    or a file (``documents`` None: one file has no boundaries)."""
    if data is None:
        root, files = stdlib_files()
        if len(files) < 3:
            raise DataError(
                f"no Python standard library sources found under {root}; pass --data PATH to a "
                "text file or folder"
            )
        tag = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
        splits, details, docs = _folder_splits(
            root, files, tag=tag, cache=cache, fractions=fractions
        )
        source = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library (.py)"
        return splits, source, {**details, "root": str(root)}, docs
    path = _existing(data, "text")
    if path.is_dir():
        files = list_text_files(path)
        if not files:
            raise DataError(
                f"the folder {path} holds no non-empty UTF-8 text files; point --data at a text "
                "file or a folder of them"
            )
        splits, details, docs = _folder_splits(
            path, files, tag="text", cache=cache, fractions=fractions
        )
        return splits, str(path), details, docs
    if not _looks_like_text(_sniff(path)):
        raise DataError(
            f"{path} does not look like UTF-8 text (NUL bytes or invalid UTF-8 in its first "
            "8 KiB); give a text file, or use --task enwik8 for the raw enwik8 file"
        )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    train_end, val_end = _position_split(len(mm), fractions)
    splits = {"train": mm[:train_end], "val": mm[train_end:val_end], "test": mm[val_end:]}
    return splits, str(path), {"split_rule": "by position"}, None


def _existing(data: str | os.PathLike | None, task: str) -> Path:
    """``data`` as a non-empty regular file or a folder, else a :class:`DataError`."""
    if data is None or str(data) == "":
        raise DataError(
            f"task {task!r} needs a local copy of its data: pass --data PATH "
            "(nothing is downloaded)"
        )
    path = check_input_path(data, what="data path", arg="--data", folder_ok=True)
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"data file {str(path)!r} is empty; check --data")
    return path


def _corpus(
    task: str, *, data: str | os.PathLike | None, seq_len: int, seed: int, options: dict[str, Any]
) -> ByteLMTask:
    opts = take_options(task, options, {"split": (str, "auto")})
    if opts["split"] not in ("auto", "standard", "proportional"):
        raise DataError(
            f"task {task!r}: option 'split' must be 'auto', 'standard' or 'proportional', got "
            f"{opts['split']!r}"
        )
    path = _existing(data, task)
    if path.is_dir():
        if not (path / task).is_file():
            raise DataError(
                f"the folder {path} has no file named {task!r}; pass --data PATH/TO/{task}"
            )
        path = _existing(path / task, task)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    n = len(mm)
    standard = sum(_STANDARD)
    if opts["split"] == "standard" and n != standard:
        raise DataError(
            f"{path} has {n:,} bytes but the standard {task} split needs the full "
            f"{standard:,}-byte file; use the original file or the option split='proportional'"
        )
    if task == "text8":
        head = bytes(mm[: 1 << 16])
        if head.strip(b" abcdefghijklmnopqrstuvwxyz"):
            raise DataError(
                f"{path} does not look like text8 (only a-z and spaces); use --task text for "
                "other text"
            )
    if n == standard and opts["split"] != "proportional":
        train_end, val_end = _STANDARD[0], _STANDARD[0] + _STANDARD[1]
        rule = "standard 90M/5M/5M"
    else:
        if opts["split"] == "auto":
            warnings.warn(
                f"{path} has {n:,} bytes, not the {standard:,} of {task}: splitting 90/5/5 by "
                "position, so results are not comparable with published ones",
                stacklevel=3,
            )
        train_end, val_end = _position_split(n, (90, 5, 5))
        rule = "proportional 90/5/5"
    splits = {"train": mm[:train_end], "val": mm[train_end:val_end], "test": mm[val_end:]}
    return ByteLMTask(
        task,
        splits,
        seq_len=seq_len,
        seed=seed,
        metric="bpc",
        source=str(path),
        details={"split_rule": rule},
    )


def build_enwik8(
    *, data: str | os.PathLike | None, seq_len: int, seed: int, **options: Any
) -> ByteLMTask:
    """The ``enwik8`` task (bytes of the first 10^8 bytes of English Wikipedia; bpc).

    Options:
        split (str): ``"auto"`` (standard for the 100,000,000-byte file, else 90/5/5 with a
            warning), ``"standard"`` (error unless the full file) or ``"proportional"``.
    """
    return _corpus("enwik8", data=data, seq_len=seq_len, seed=seed, options=options)


def build_text8(
    *, data: str | os.PathLike | None, seq_len: int, seed: int, **options: Any
) -> ByteLMTask:
    """The ``text8`` task (lower-case a-z and space; bpc). Options as :func:`build_enwik8`."""
    return _corpus("text8", data=data, seq_len=seq_len, seed=seed, options=options)
