"""Long streams of the text tasks: consecutive windows (carry_state), file boundaries and
packed rows (pack_documents), a split as one stream (eval --stream)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from aftlab.data import DataError, build_task
from aftlab.data.base import pack_rows
from aftlab.data.text import assign_files, list_text_files


def _bytes(n: int, seed: int) -> bytes:
    """``n`` printable bytes without ``@`` (the file marker of :func:`_folder`)."""
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(65, 91, size=n, dtype=np.uint8))


def _folder(root: Path, sizes: list[int]) -> dict[str, bytes]:
    """Files ``f00.txt ..`` of the given sizes; each begins with ``@``, found nowhere else."""
    root.mkdir(parents=True)
    files = {f"f{i:02d}.txt": b"@" + _bytes(n - 1, seed=i) for i, n in enumerate(sizes)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


@pytest.fixture
def stream_task(tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes(_bytes(2000, seed=1))
    # 90 / 5 / 5 by position: train = the first 1800 bytes
    return build_task("text", data=path, seq_len=8, cache_dir=str(tmp_path / "c")), path


# --------------------------------------------------------------------------- carry_state


def test_consecutive_windows_are_contiguous_streams_that_wrap(stream_task):
    task, path = stream_task
    x = np.frombuffer(path.read_bytes()[:1800], dtype=np.uint8).astype(np.int64)
    B, T = 4, 8
    L, W = task.stream_geometry(B)
    assert (L, W) == (450, 56)  # floor(1800 / 4), floor(449 / 8)
    got = task.consecutive_windows(0, batch_size=B, windows=W + 2)
    assert got["input"].shape == got["target"].shape == (W + 2, B, T)
    for w in range(W + 2):
        for r in range(B):
            o = r * L + (w % W) * T
            assert torch.equal(got["input"][w, r], torch.from_numpy(x[o : o + T]))
            assert torch.equal(got["target"][w, r], torch.from_numpy(x[o + 1 : o + T + 1]))
    # each window continues the one before: its first byte is the last target before it
    assert torch.equal(got["input"][1:W, :, 0], got["target"][: W - 1, :, -1])
    assert got["reset"].tolist() == [w % W == 0 for w in range(W + 2)]
    assert got["reset"][0] and got["reset"][W] and got["reset"].sum() == 2


def test_consecutive_windows_are_a_pure_function_of_the_step_and_shard_by_rank(stream_task):
    task, _ = stream_task
    k = 3
    group = task.consecutive_windows(5, batch_size=4, windows=k)
    for j in range(k):  # step 5 of k windows = windows 15, 16, 17 read one per step
        one = task.consecutive_windows(5 * k + j, batch_size=4)
        assert torch.equal(group["input"][j], one["input"][0])
        assert bool(group["reset"][j]) == bool(one["reset"][0])
    again = task.consecutive_windows(5, batch_size=4, windows=k)
    assert all(torch.equal(group[key], again[key]) for key in group)
    parts = [
        task.consecutive_windows(5, batch_size=2, rank=r, world_size=2, windows=k) for r in (0, 1)
    ]
    for key in ("input", "target"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), group[key])


def test_streams_shorter_than_one_window_and_bad_arguments_are_refused(stream_task):
    task, _ = stream_task
    with pytest.raises(DataError, match=r"carry_state: .* batch_size=300 streams gives 6 bytes"):
        task.consecutive_windows(0, batch_size=300)
    with pytest.raises(ValueError, match="'windows' must be > 0, got 0"):
        task.consecutive_windows(0, batch_size=2, windows=0)
    with pytest.raises(ValueError, match="'rank' must be < world_size=2, got 2"):
        task.consecutive_windows(0, batch_size=2, rank=2, world_size=2)


def test_tasks_that_are_not_streams_refuse_carry_state_and_eval_stream():
    task = build_task("recall", seq_len=32)
    with pytest.raises(DataError, match="carry_state: task 'recall' is not one stream of tokens"):
        task.consecutive_windows(0, batch_size=2)
    with pytest.raises(DataError, match="eval --stream: task 'recall' is not one stream"):
        task.stream("test")
    with pytest.raises(DataError, match="pack_documents: task 'recall' has no document bound"):
        task.document_batch(0, batch_size=2)
    assert task.document_starts("train") is None


def test_stream_is_the_split(stream_task):
    task, path = stream_task
    assert bytes(task.stream("test")) == path.read_bytes()[1900:]
    with pytest.raises(ValueError, match="'split' must be 'val' or 'test'"):
        task.stream("train")


# --------------------------------------------------------------------------- pack_documents


def test_document_starts_are_the_file_offsets_of_each_split(tmp_path):
    files = _folder(tmp_path / "docs", [40 + 13 * i for i in range(12)])
    task = build_task("text", data=tmp_path / "docs", seq_len=8, cache_dir=str(tmp_path / "c"))
    groups = assign_files(list_text_files(tmp_path / "docs"))
    for split in ("train", "val", "test"):
        sizes = [len(files[p.as_posix()]) for p in groups[split]]
        expected = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        assert task.document_starts(split).tolist() == expected.tolist()
        x = np.asarray(task.splits[split])
        assert (np.flatnonzero(x == ord("@")) == expected).all()  # each marker starts a file


def test_a_folder_split_by_position_keeps_the_boundary_inside_a_split(tmp_path):
    _folder(tmp_path / "two", [1000, 1000])  # fewer than 3 files: 90/5/5 by position
    task = build_task("text", data=tmp_path / "two", seq_len=8, cache_dir=str(tmp_path / "c"))
    assert task.document_starts("train").tolist() == [0, 1000]
    assert task.document_starts("val").tolist() == [0] == task.document_starts("test").tolist()


def test_document_batch_marks_file_starts_and_ignores_targets_across_them(tmp_path):
    _folder(tmp_path / "docs", [30 + 3 * i for i in range(20)])  # short files: many boundaries
    task = build_task("text", data=tmp_path / "docs", seq_len=16, cache_dir=str(tmp_path / "c"))
    seen = 0
    for step in range(4):
        plain = task.train_batch(step, batch_size=8)
        got = task.document_batch(step, batch_size=8)
        assert torch.equal(got["input"], plain["input"])  # the same bytes as without packing
        marker = got["input"] == ord("@")
        assert torch.equal(got["doc_start"][:, 1:], marker[:, 1:]) and got["doc_start"][:, 0].all()
        crosses = plain["target"] == ord("@")  # the last byte of a file predicting the next's first
        assert torch.equal(got["target"] == -100, crosses)
        assert torch.equal(got["target"][~crosses], plain["target"][~crosses])
        seen += int(crosses.sum())
    assert seen > 0
    halves = [task.document_batch(3, batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    for key in ("input", "target", "doc_start"):
        assert torch.equal(torch.cat([h[key] for h in halves]), got[key])


def test_pack_rows_builds_cu_seqlens_from_rows_and_file_starts():
    doc_start = torch.zeros(3, 5, dtype=torch.bool)
    doc_start[0, 2] = doc_start[2, 1] = doc_start[2, 4] = True  # row 1: one piece
    batch = {
        "input": torch.arange(15).reshape(3, 5),
        "target": torch.arange(1, 16).reshape(3, 5),
        "doc_start": doc_start,  # column 0 left False: a row start begins a document anyway
    }
    packed = pack_rows(batch)
    assert packed["cu_seqlens"].dtype == torch.int32
    assert packed["cu_seqlens"].tolist() == [0, 2, 5, 10, 11, 14, 15]
    assert torch.equal(packed["input"], torch.arange(15)[None])
    assert torch.equal(packed["target"], torch.arange(1, 16)[None])
    assert not doc_start[:, 0].any()  # the batch is left as it was


def test_a_single_file_has_no_documents(stream_task):
    task, _ = stream_task
    assert task.document_starts("train") is None
    with pytest.raises(DataError, match="pack_documents: task 'text' has no document boundaries"):
        task.document_batch(0, batch_size=2)
