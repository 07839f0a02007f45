"""Pixel tasks: digits (generation and classification) and CIFAR-10 from fake pickle batches."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch

from aftlab.data import DataError, build_task, images
from aftlab.data.base import epoch_indices

from .helpers import check_contract, write_cifar


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits, (1797, 64) levels and (1797,) labels (the ``test`` extra has it)."""
    datasets = pytest.importorskip("sklearn.datasets")
    bunch = datasets.load_digits()
    return bunch.data.astype(np.int64), bunch.target.astype(np.int64)


def test_digits_generation(digits):
    x, _ = digits
    task = build_task("digits", seq_len=128)  # image tasks fix their own length
    check_contract(task)
    assert (task.kind, task.vocab_size, task.seq_len, task.metric) == ("lm", 17, 64, "bits/dim")
    assert task.image_shape == (8, 8) and task.grid is None and task.num_classes is None
    b = task.train_batch(0, batch_size=5)
    # shifted right with a 0 start value: every pixel is predicted from the ones before it
    assert torch.equal(b["input"][:, 0], torch.zeros(5, dtype=torch.long))
    assert torch.equal(b["input"][:, 1:], b["target"][:, :-1])
    assert int(b["target"].max()) <= 16
    rows = {tuple(r) for r in x.tolist()}
    assert all(tuple(r) in rows for r in b["target"].tolist())


def test_digits_split_and_eval_coverage(digits):
    x, y = digits
    task = build_task("digits-classify")
    idx = np.arange(len(x))
    expected = {"train": idx % 10 < 8, "val": idx % 10 == 8, "test": idx % 10 == 9}
    assert task.info()["split_images"] == {k: int(m.sum()) for k, m in expected.items()}
    for split in ("val", "test"):
        batches = list(task.eval_batches(split, batch_size=50))
        assert [len(b["target"]) for b in batches][:-1] == [50] * (len(batches) - 1)
        inputs = torch.cat([b["input"] for b in batches])
        labels = torch.cat([b["target"] for b in batches])
        assert torch.equal(inputs, torch.from_numpy(x[expected[split]]))
        assert torch.equal(labels, torch.from_numpy(y[expected[split]]))


def test_digits_classification(digits):
    x, y = digits
    task = build_task("digits-classify", seq_len=64)
    check_contract(task)
    assert (task.kind, task.num_classes, task.grid, task.metric) == (
        "classify",
        10,
        (8, 8),
        "accuracy",
    )
    b = task.train_batch(3, batch_size=6)
    lookup = {tuple(r): int(label) for r, label in zip(x.tolist(), y.tolist(), strict=True)}
    for row, label in zip(b["input"].tolist(), b["target"].tolist(), strict=True):
        assert lookup[tuple(row)] == label
    with pytest.raises(ValueError, match="count_correct"):
        task.metric_from_loss(0.5)


def test_training_visits_every_train_image_once_per_epoch(digits):
    task = build_task("digits-classify", seed=2)
    n = len(task.images["train"])
    g = 100
    steps = -(-2 * n // g)
    seen = torch.cat([task.train_batch(s, batch_size=g)["input"] for s in range(steps)])
    first_epoch = {tuple(r) for r in seen[:n].tolist()}
    assert len(first_epoch) == len({tuple(r) for r in task.images["train"].tolist()})
    ids = epoch_indices(n, seed=2, start=0, count=2 * n)
    assert sorted(ids[:n]) == list(range(n)) and sorted(ids[n:]) == list(range(n))
    assert not np.array_equal(ids[:n], ids[n:])  # a new shuffle each epoch


def test_decode_image(digits):
    x, _ = digits
    task = build_task("digits")
    batch = next(task.eval_batches("test", batch_size=2))
    img = task.decode_image(batch["target"])
    assert img.shape == (2, 8, 8) and img.dtype == np.uint8
    np.testing.assert_array_equal(img[0], x[9].reshape(8, 8))  # index 9 is the first test image
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 64\)"):
        task.decode_image(torch.zeros(63, dtype=torch.long))
    with pytest.raises(ValueError, match="0..16"):
        task.decode_image(torch.full((64,), 17))


def test_digits_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    images._digits_splits.cache_clear()  # forget digits loaded by other tests
    with pytest.raises(DataError, match=r"need scikit-learn: pip install 'aftlab\[data\]'"):
        build_task("digits")


def test_digits_rejects_data_and_options(tmp_path, digits):
    with pytest.raises(DataError, match="drop --data"):
        build_task("digits", data=tmp_path)
    with pytest.raises(DataError, match="has no option 'size'; its options are: none"):
        build_task("digits-classify", size=3)


# --------------------------------------------------------------------------- CIFAR-10
def test_cifar10(tmp_path):
    arrays = write_cifar(tmp_path / "cifar", n_train_per_batch=4, n_test=5)
    task = build_task("cifar10", data=tmp_path / "cifar", seq_len=3072)
    check_contract(task, batch_size=2)
    assert (task.vocab_size, task.seq_len, task.metric, task.image_shape) == (
        256,
        3072,
        "bits/dim",
        (32, 32, 3),
    )
    # val = the last min(5000, 20 // 10) = 2 train images; test = test_batch, in order
    assert task.info()["split_images"] == {"train": 18, "val": 2, "test": 5}

    def channel_last(rows):
        return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)

    val = torch.cat([b["target"] for b in task.eval_batches("val", batch_size=4)])
    np.testing.assert_array_equal(task.decode_image(val), channel_last(arrays["train"][-2:]))
    test = torch.cat([b["target"] for b in task.eval_batches("test", batch_size=2)])
    np.testing.assert_array_equal(task.decode_image(test), channel_last(arrays["test"]))
    # sequence order: value 3 (32 i + j) + c is channel c of pixel (i, j)
    img = arrays["test"][0].reshape(3, 32, 32)
    i, j, c = 5, 17, 2
    assert int(test[0, 3 * (32 * i + j) + c]) == int(img[c, i, j])
    train = {
        bytes(r)
        for r in arrays["train"][:-2].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).reshape(-1, 3072)
    }
    b = task.train_batch(0, batch_size=3)
    assert all(bytes(r.astype(np.uint8)) in train for r in b["target"].numpy())


def test_cifar10_val_size_option(tmp_path):
    write_cifar(tmp_path, n_train_per_batch=2)
    task = build_task("cifar10", data=tmp_path, val_size=4)
    assert task.info()["split_images"]["val"] == 4
    with pytest.raises(DataError, match=r"'val_size' must be in 1..9, got 10"):
        build_task("cifar10", data=tmp_path, val_size=10)


def test_cifar10_errors(tmp_path):
    with pytest.raises(DataError, match="must be the cifar-10-batches-py folder"):
        build_task("cifar10", data=tmp_path / "missing")
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DataError, match="lacks the CIFAR-10 python batch file.*data_batch_3"):
        build_task("cifar10", data=tmp_path)


def test_cifar10_bad_files(tmp_path):
    write_cifar(tmp_path)
    good = (tmp_path / "data_batch_2").read_bytes()
    (tmp_path / "data_batch_2").write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(DataError, match="data_batch_2 is not a CIFAR-10 python batch"):
        build_task("cifar10", data=tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "data_batch_2").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        build_task("cifar10", data=tmp_path)

    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError, match=r"b'data' must be uint8 of shape \(N, 3072\)"):
        build_task("cifar10", data=tmp_path)

    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, f)
    with pytest.raises(DataError, match=r"b'labels' must be 2 ints in 0..9"):
        build_task("cifar10", data=tmp_path)

    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump([1, 2, 3], f)
    with pytest.raises(DataError, match="no b'data' and b'labels'"):
        build_task("cifar10", data=tmp_path)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_pickle_protocols(tmp_path, protocol):
    """The real files are protocol-2 pickles naming ``numpy.core.multiarray`` (NumPy 1)."""
    arrays = write_cifar(tmp_path)
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    raw = pickle.dumps({b"data": data, b"labels": [3, 4]}, protocol=protocol)
    if protocol == 2:
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy.core.multiarray" in raw
    (tmp_path / "test_batch").write_bytes(raw)
    task = build_task("cifar10", data=tmp_path)
    assert task.info()["split_images"]["test"] == 2 and len(arrays["train"]) == 20
    test = next(task.eval_batches("test", batch_size=2))["target"]
    np.testing.assert_array_equal(
        task.decode_image(test), data.reshape(2, 3, 32, 32).transpose(0, 2, 3, 1)
    )
