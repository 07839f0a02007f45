"""Byte-level text tasks: a file, a folder, the stdlib default, enwik8 and text8."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from aftlab.data import BYTE_TASKS, ByteLMTask, DataError, build_task, byte_level
from aftlab.data.text import assign_files, list_text_files, stdlib_files

from .helpers import check_contract


def _corpus(n: int, seed: int = 0) -> bytes:
    """``n`` bytes of printable text with a few multi-byte characters, all distinct enough that a
    window of 24 bytes is found at one place only."""
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, size=n, dtype=np.uint8))


@pytest.fixture
def text_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = _corpus(4000)
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    return path, data


@pytest.fixture
def text_folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "docs"
    files = {f"part{i // 10}/file{i:02d}.txt": _corpus(300 + 7 * i, seed=i) for i in range(40)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(_corpus(500, seed=99))  # hidden: skipped
    (root / "image.bin").write_bytes(bytes(range(256)) * 4)  # NUL bytes: skipped
    (root / "empty.txt").write_bytes(b"")  # empty: skipped
    return root, files


def _split_bytes(task: ByteLMTask) -> dict[str, bytes]:
    return {k: bytes(v) for k, v in task.splits.items()}


def test_file_contract_and_position_split(text_file):
    path, data = text_file
    task = build_task("text", data=path, seq_len=16, seed=3)
    check_contract(task)
    assert (task.kind, task.vocab_size, task.metric, task.num_classes) == ("lm", 256, "bpb", None)
    s = _split_bytes(task)
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (3600, 200, 200)
    assert s["train"] + s["val"] + s["test"] == data  # disjoint, in order, covering the file
    assert task.info()["split_bytes"] == {"train": 3600, "val": 200, "test": 200}


def test_split_fractions_option(text_file):
    path, data = text_file
    task = build_task("text", data=path, seq_len=16, split_fractions=[50, 25, 25])
    assert [len(v) for v in task.splits.values()] == [2000, 1000, 1000]


def test_train_windows_come_from_the_train_split(text_file):
    path, _ = text_file
    task = build_task("text", data=path, seq_len=24, seed=1)
    train = bytes(task.splits["train"])
    b = task.train_batch(0, batch_size=8)
    assert torch.equal(b["input"][:, 1:], b["target"][:, :-1])
    for row_in, row_t in zip(b["input"], b["target"], strict=True):
        window = bytes(row_in.tolist()) + bytes(row_t[-1:].tolist())
        assert train.find(window) >= 0


def test_seed_changes_the_training_stream(text_file):
    path, _ = text_file
    a = build_task("text", data=path, seq_len=16, seed=0).train_batch(0, batch_size=4)
    b = build_task("text", data=path, seq_len=16, seed=1).train_batch(0, batch_size=4)
    assert not torch.equal(a["input"], b["input"])


def test_resume_reads_the_same_batches(text_file):
    """A fresh instance (a resumed run) reads at step k what an uninterrupted run read."""
    path, _ = text_file
    run = build_task("text", data=path, seq_len=16, seed=5)
    seen = [run.train_batch(k, batch_size=4) for k in range(6)]
    resumed = build_task("text", data=path, seq_len=16, seed=5)
    for k in (3, 4, 5):
        again = resumed.train_batch(k, batch_size=4)
        assert torch.equal(again["input"], seen[k]["input"])
        assert torch.equal(again["target"], seen[k]["target"])


@pytest.mark.parametrize("n", [201, 200, 17, 33])  # (n - 1) % T == 0 for 201, 33, 17
def test_eval_scores_every_byte_once(tmp_path, n):
    """Concatenating the scored targets of all windows gives the split minus its first byte."""
    data = _corpus(20 * n)
    path = tmp_path / "c.txt"
    path.write_bytes(data)
    task = build_task("text", data=path, seq_len=16)
    for split in ("val", "test"):
        x = bytes(task.splits[split])
        scored = []
        for batch in task.eval_batches(split, batch_size=3):
            assert batch["input"].shape[1] == 16
            for row_in, row_t in zip(batch["input"], batch["target"], strict=True):
                keep = row_t != -100
                # the ignored positions are a prefix; the window is a real slice of the split
                assert keep.long().diff().ge(0).all()
                window = bytes(row_in.tolist()) + bytes([int(row_t[-1])])
                assert x.find(window) >= 0
                scored += row_t[keep].tolist()
        assert bytes(scored) == x[1:]
    windows = task.eval_windows("val")
    assert len(windows) == math.ceil((len(task.splits["val"]) - 1) / 16)


def test_eval_max_batches(text_file):
    path, _ = text_file
    task = build_task("text", data=path, seq_len=8)
    assert len(list(task.eval_batches("val", batch_size=2, max_batches=3))) == 3
    total = len(list(task.eval_batches("val", batch_size=2)))
    assert total == math.ceil(len(task.eval_windows("val")) / 2) > 3


def test_encode_decode_round_trip(text_file):
    task = build_task("text", data=text_file[0], seq_len=16)
    text = "naïve café — 数据 🙂\n"
    ids = task.encode(text)
    assert ids.dtype == torch.long and ids.tolist() == list(text.encode("utf-8"))
    assert task.decode(ids) == text
    assert task.decode([104, 0xFF, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match="0..255"):
        task.decode([300])


def test_byte_tasks_are_the_byte_lm_tasks(text_file):
    """BYTE_TASKS names exactly the tasks built as a ByteLMTask; byte_level reads a task's info."""
    import typing

    from aftlab.data import _BUILDERS

    returns = {n: typing.get_type_hints(b)["return"] for n, (b, _) in _BUILDERS.items()}
    assert set(BYTE_TASKS) == {n for n, r in returns.items() if r is ByteLMTask}
    info = build_task("text", data=text_file[0], seq_len=16).info()
    assert byte_level(info)
    assert not byte_level({**info, "task": "recall"})  # 256 ids, but not bytes
    assert not byte_level({**info, "vocab_size": 64})


def test_metric_is_bits(text_file):
    task = build_task("text", data=text_file[0], seq_len=16)
    assert task.metric_from_loss(math.log(2.0)) == pytest.approx(1.0)
    assert task.metric_from_loss(2.0) == pytest.approx(2.0 / math.log(2.0))


# --------------------------------------------------------------------------- folders
def test_list_text_files_skips_hidden_binary_and_empty(text_folder):
    root, files = text_folder
    assert [p.as_posix() for p in list_text_files(root)] == sorted(files)


def test_folder_split_by_file(text_folder):
    root, files = text_folder
    task = build_task("text", data=root, seq_len=16)
    check_contract(task)
    groups = assign_files(list_text_files(root))
    assert [len(groups[k]) for k in ("train", "val", "test")] == [36, 2, 2]
    s = _split_bytes(task)
    for split in ("train", "val", "test"):
        # each split is its files, whole, in sorted path order
        assert s[split] == b"".join(files[p.as_posix()] for p in groups[split])
    assert not set(groups["train"]) & set(groups["val"]) | set(groups["val"]) & set(groups["test"])
    assert task.info()["files"] == {"train": 36, "val": 2, "test": 2}


def test_folder_split_depends_only_on_the_paths(text_folder):
    """Not on listing order or contents: an edited file stays in its split."""
    root, _ = text_folder
    files = list_text_files(root)
    before = assign_files(files)
    assert assign_files(files[::-1]) == before
    (root / before["val"][0]).write_bytes(b"edited " * 100)
    assert assign_files(list_text_files(root)) == before


def test_folder_cache_is_reused_and_rebuilt_on_change(text_folder, tmp_path):
    root, files = text_folder
    build_task("text", data=root, seq_len=16)
    cached = sorted((tmp_path / "cache").glob("text-*.bin"))
    assert len(cached) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    mtime = cached[0].stat().st_mtime_ns
    build_task("text", data=root, seq_len=16)
    assert cached[0].stat().st_mtime_ns == mtime  # reused
    target = root / "part0/file00.txt"
    target.write_bytes(b"changed " * 50)
    os.utime(target, ns=(1, 1))
    task = build_task("text", data=root, seq_len=16)
    assert len(list((tmp_path / "cache").glob("text-*.bin"))) == 2
    assert b"changed changed" in b"".join(_split_bytes(task).values())


def test_folder_with_few_files_is_split_by_position(tmp_path):
    root = tmp_path / "two"
    root.mkdir()
    (root / "a.txt").write_bytes(b"a" * 1000)
    (root / "b.txt").write_bytes(b"b" * 1000)
    task = build_task("text", data=root, seq_len=16, cache_dir=str(tmp_path / "mycache"))
    s = _split_bytes(task)
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (1800, 100, 100)
    assert s["train"] + s["val"] + s["test"] == b"a" * 1000 + b"b" * 1000
    assert list((tmp_path / "mycache").glob("text-*.bin"))  # the cache_dir option is honoured


def test_stdlib_default():
    root, files = stdlib_files()
    assert len(files) > 100
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    assert all(p.suffix == ".py" and not skip & set(p.parts[:-1]) for p in files)
    task = build_task("text", seq_len=64)
    info = task.info()
    assert info["source"].startswith("Python") and sum(info["files"].values()) == len(files)
    groups = assign_files(files)
    first = (root / groups["train"][0]).read_bytes()
    assert bytes(task.splits["train"][: len(first)]) == first
    total = sum((root / p).stat().st_size for p in files)
    assert sum(len(v) for v in task.splits.values()) == total
    b = task.train_batch(0, batch_size=2)
    assert b["input"].shape == (2, 64)


# --------------------------------------------------------------------------- enwik8 / text8
def test_enwik8_standard_split(tmp_path):
    path = tmp_path / "enwik8"
    with open(path, "wb") as f:  # a sparse 100,000,000-byte file: the real size, no disk cost
        f.truncate(100_000_000)
    task = build_task("enwik8", data=path, seq_len=32, split="standard")
    assert [len(v) for v in task.splits.values()] == [90_000_000, 5_000_000, 5_000_000]
    assert task.metric == "bpc" and task.info()["split_rule"].startswith("standard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = build_task("enwik8", data=tmp_path, seq_len=32)  # a folder holding "enwik8"
    assert [len(v) for v in auto.splits.values()] == [90_000_000, 5_000_000, 5_000_000]


def test_enwik8_small_file_is_split_proportionally_with_a_warning(tmp_path):
    data = _corpus(10_000)
    path = tmp_path / "enwik8_small"
    path.write_bytes(data)
    with pytest.warns(UserWarning, match="90/5/5"):
        task = build_task("enwik8", data=path, seq_len=32)
    s = _split_bytes(task)
    assert [len(v) for v in s.values()] == [9000, 500, 500]
    assert s["train"] + s["val"] + s["test"] == data
    check_contract(task)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_task("enwik8", data=path, seq_len=32, split="proportional")
    with pytest.raises(DataError, match="100,000,000-byte file.*split='proportional'"):
        build_task("enwik8", data=path, seq_len=32, split="standard")


def test_text8(tmp_path):
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    path = tmp_path / "text8"
    path.write_bytes(bytes(rng.choice(letters, size=5000)))
    task = build_task("text8", data=path, seq_len=16, split="proportional")
    check_contract(task)
    assert task.metric == "bpc" and task.name == "text8"
    bad = tmp_path / "not_text8"
    bad.write_bytes(b"Hello, World! " * 400)
    with pytest.raises(DataError, match="does not look like text8"):
        build_task("text8", data=bad, seq_len=16, split="proportional")


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("task", ["text", "enwik8", "text8"])
def test_missing_and_empty_paths(tmp_path, task):
    with pytest.raises(DataError, match="does not exist; check --data"):
        build_task(task, data=tmp_path / "nope", seq_len=16)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="is empty; check --data"):
        build_task(task, data=empty, seq_len=16)


@pytest.mark.parametrize("task", ["enwik8", "text8", "cifar10"])
def test_tasks_that_need_data_say_so(task):
    with pytest.raises(DataError, match="--data"):
        build_task(task, seq_len=16)


def test_file_shorter_than_one_context(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(_corpus(300))  # val and test: 15 bytes each
    with pytest.raises(
        DataError,
        match=r"\(300 bytes\) is too short for seq_len=16: its val split has 15 bytes, fewer "
        r"than one context of seq_len\+1=17; use more data or a smaller seq_len",
    ):
        build_task("text", data=path, seq_len=16)
    assert build_task("text", data=path, seq_len=14).seq_len == 14


def test_folder_without_text(tmp_path):
    root = tmp_path / "bin"
    (root / ".hidden").mkdir(parents=True)
    (root / ".hidden" / "notes.txt").write_text("hidden text is skipped")
    (root / "a.bin").write_bytes(b"\x00\x01\x02" * 100)
    (root / "b.txt").write_bytes(b"\xff\xfe\xfa" * 100)  # not UTF-8
    with pytest.raises(DataError, match="holds no non-empty UTF-8 text files"):
        build_task("text", data=root, seq_len=16)


def test_binary_file_for_text(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(DataError, match="does not look like UTF-8 text"):
        build_task("text", data=path, seq_len=16)


def test_folder_without_the_named_corpus(tmp_path):
    with pytest.raises(DataError, match="no file named 'enwik8'"):
        build_task("enwik8", data=tmp_path, seq_len=16)


def test_bad_options(text_file):
    path, _ = text_file
    with pytest.raises(DataError, match="no option 'window'; its options are: cache_dir"):
        build_task("text", data=path, seq_len=16, window=3)
    with pytest.raises(DataError, match="'split_fractions' must be 3 positive numbers"):
        build_task("text", data=path, seq_len=16, split_fractions=[90, 10])
    with pytest.raises(DataError, match="'split' must be 'auto', 'standard' or 'proportional'"):
        build_task("enwik8", data=path, seq_len=16, split="random")
    with pytest.raises(DataError, match="option 'split' must be str, got int"):
        build_task("enwik8", data=path, seq_len=16, split=3)


def test_unwritable_cache(text_folder, tmp_path):
    root, _ = text_folder
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(DataError, match="cannot write the data cache .*set AFTLAB_CACHE_DIR"):
        build_task("text", data=root, seq_len=16, cache_dir=str(blocker / "cache"))
