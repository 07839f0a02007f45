"""Synthetic sequence tasks generated on the fly: associative recall (MQAR) and copying.

Both are ``kind="lm"`` tasks scored by accuracy: the target is ``-100`` everywhere except the
positions whose next token is determined by the earlier ones, and the trainer counts correct
arg-max predictions there (:func:`aftlab.data.count_correct`). Training examples of ``step``
come from ``(seed, step)``; the val and test sets come from fixed seeds that do not depend on
the task seed, so every run is evaluated on the same examples.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import torch

from .base import (
    IGNORE_INDEX,
    DataError,
    Task,
    batch_slices,
    check_eval_args,
    shard,
    step_rng,
    take_options,
)

__all__ = ["SyntheticTask", "mqar", "copying", "build_recall", "build_copy"]

_SPLIT_SEEDS = {"val": 1, "test": 2}


def _sample_without_replacement(
    rng: np.random.Generator, n_rows: int, n: int, k: int, log_p: np.ndarray | None = None
) -> np.ndarray:
    """``(n_rows, k)`` distinct ids from ``0 .. n - 1`` per row, with weights ``exp(log_p)``.

    Gumbel-top-k: the ``k`` largest of ``log p_i + G_i`` (``G_i`` standard Gumbel) are a draw of
    ``k`` items without replacement, in draw order, from the distribution ``p``.
    """
    scores = rng.gumbel(size=(n_rows, n))
    if log_p is not None:
        scores = scores + log_p
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def mqar(
    rng: np.random.Generator,
    n: int,
    *,
    seq_len: int,
    vocab: int,
    num_pairs: int,
    power_a: float,
    random_non_queries: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Multi-query associative recall examples (Arora et al. 2023, "Zoology").

    Each example shows ``P = num_pairs`` key-value pairs ``k_1 v_1 ... k_P v_P`` (keys distinct,
    from ``1 .. vocab/2 - 1``; values distinct, from ``vocab/2 .. vocab - 1``), then every key
    once more, at the even offsets ``2 g_i`` of the rest of the sequence; the gaps ``g_i`` are
    drawn without replacement with ``p(g) ∝ a g^(a - 1)``, ``g = 1 .. (T - 2P)/2`` (small ``a``
    favours early, short-range queries). At a query position the target is the key's value;
    elsewhere ``-100``. Positions that are neither pairs nor queries hold 0, or random tokens
    with ``random_non_queries``.

    Args:
        rng: the generator.
        n: number of examples.
        seq_len: ``T``.
        vocab: ``V``.
        num_pairs: ``P``.
        power_a: ``a`` of the gap distribution.
        random_non_queries: fill the unused positions with random tokens instead of 0.

    Returns:
        ``input (n, T)`` and ``target (n, T)`` int64 arrays.
    """
    P, T = num_pairs, seq_len
    half = vocab // 2
    keys = 1 + _sample_without_replacement(rng, n, half - 1, P)
    values = half + _sample_without_replacement(rng, n, vocab - half, P)
    space = (T - 2 * P) // 2
    g = np.arange(1, space + 1, dtype=np.float64)
    gaps = _sample_without_replacement(
        rng, n, space, P, log_p=np.log(power_a) + (power_a - 1) * np.log(g)
    )
    z = np.zeros((n, T + 1), dtype=np.int64)
    z[:, 0 : 2 * P : 2] = keys
    z[:, 1 : 2 * P : 2] = values
    rows = np.arange(n)[:, None]
    query_pos = 2 * P + 2 * gaps
    z[rows, query_pos] = keys
    labels = np.full((n, T + 1), IGNORE_INDEX, dtype=np.int64)
    labels[rows, query_pos + 1] = values
    inp, target = z[:, :T], labels[:, 1:]
    if random_non_queries:
        noise = rng.integers(0, vocab, size=inp.shape)
        inp = np.where(inp == 0, noise, inp)
    return inp, target


def copying(
    rng: np.random.Generator, n: int, *, seq_len: int, vocab: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Copying examples: ``s_1 .. s_L, 0, s_1 .. s_L`` then 0-padding to ``T + 1`` tokens.

    Symbols ``s_i`` are uniform in ``1 .. vocab - 1``; 0 is the separator and the padding. The
    target is ``s_i`` where the model must reproduce ``s_i`` (inputs ``0, s_1 .. s_{L-1}``),
    ``-100`` elsewhere.

    Returns:
        ``input (n, T)`` and ``target (n, T)`` int64 arrays.
    """
    L = length
    s = rng.integers(1, vocab, size=(n, L))
    z = np.zeros((n, seq_len + 1), dtype=np.int64)
    z[:, :L] = s
    z[:, L + 1 : 2 * L + 1] = s
    target = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    target[:, L : 2 * L] = s
    return z[:, :seq_len], target


@dataclass(eq=False)
class SyntheticTask(Task):
    """A generated ``kind="lm"`` task scored by accuracy at the positions with a target.

    Args:
        name: task name.
        generate: ``(rng, n) -> (input (n, T), target (n, T))``.
        seq_len: ``T``.
        vocab_size: ``V``.
        seed: seed of the training stream.
        eval_size: examples in each of val and test.
        details: the options, for :meth:`info`.
    """

    kind = "lm"
    metric = "accuracy"

    name: str
    generate: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
    _: KW_ONLY
    seq_len: int
    vocab_size: int
    seed: int = field()  # required (not Task's default)
    eval_size: int
    details: dict[str, Any]
    _eval: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, init=False, repr=False
    )

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(
            source="generated", split_examples={"val": self.eval_size, "test": self.eval_size}
        )
        out.update(self.details)
        return out

    def _train_batch(
        self, step: int, *, batch_size: int, rank: int, world_size: int
    ) -> dict[str, torch.Tensor]:
        inp, target = self.generate(step_rng(self.seed, step, 2), batch_size * world_size)
        return {
            "input": torch.from_numpy(shard(inp, batch_size=batch_size, rank=rank).copy()),
            "target": torch.from_numpy(shard(target, batch_size=batch_size, rank=rank).copy()),
        }

    def eval_set(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """All ``eval_size`` examples of ``split`` (generated once from a fixed seed)."""
        self._check_split(split)
        if split not in self._eval:
            self._eval[split] = self.generate(step_rng(_SPLIT_SEEDS[split], 0, 3), self.eval_size)
        return self._eval[split]

    def eval_batches(
        self, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        check_eval_args(f"{self.name}.eval_batches", batch_size=batch_size, max_batches=max_batches)
        inp, target = self.eval_set(split)
        for s in batch_slices(len(inp), batch_size=batch_size, max_batches=max_batches):
            yield {
                "input": torch.from_numpy(inp[s].copy()),
                "target": torch.from_numpy(target[s].copy()),
            }


def _no_data(task: str, data: Any) -> None:
    if data is not None:
        raise DataError(f"task {task!r} generates its data; drop --data")


def build_recall(
    *, data: str | os.PathLike | None, seq_len: int, seed: int, **options: Any
) -> SyntheticTask:
    """``recall``: multi-query associative recall (see :func:`mqar`).

    Options:
        num_pairs (int): key-value pairs per example, default 8; needs ``4 P <= seq_len``.
        vocab (int): vocabulary ``V``, default 256; needs ``V/2 - 1 >= P``.
        power_a (float): ``a`` of the query-gap distribution, default 0.01.
        random_non_queries (bool): random filler tokens instead of 0, default True.
        eval_size (int): examples in val and in test, default 1000.
    """
    _no_data("recall", data)
    o = take_options(
        "recall",
        options,
        {
            "num_pairs": (int, 8),
            "vocab": (int, 256),
            "power_a": ((int, float), 0.01),
            "random_non_queries": (bool, True),
            "eval_size": (int, 1000),
        },
    )
    P, V = o["num_pairs"], o["vocab"]
    if P < 1 or 4 * P > seq_len:
        raise DataError(
            f"recall: num_pairs={P} needs 1 <= 4*num_pairs <= seq_len={seq_len}; lower "
            "num_pairs or raise seq_len"
        )
    if V // 2 - 1 < P:
        raise DataError(
            f"recall: vocab={V} has {V // 2 - 1} keys, fewer than num_pairs={P}; raise vocab "
            f"to at least {2 * P + 2}"
        )
    if not o["power_a"] > 0:
        raise DataError(f"recall: option 'power_a' must be > 0, got {o['power_a']}")
    if o["eval_size"] < 1:
        raise DataError(f"recall: option 'eval_size' must be >= 1, got {o['eval_size']}")

    def generate(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        return mqar(
            rng,
            n,
            seq_len=seq_len,
            vocab=V,
            num_pairs=P,
            power_a=float(o["power_a"]),
            random_non_queries=o["random_non_queries"],
        )

    return SyntheticTask(
        "recall",
        generate,
        seq_len=seq_len,
        vocab_size=V,
        seed=seed,
        eval_size=o["eval_size"],
        details=o,
    )


def build_copy(
    *, data: str | os.PathLike | None, seq_len: int, seed: int, **options: Any
) -> SyntheticTask:
    """``copy``: reproduce a random string after a separator (see :func:`copying`).

    Options:
        vocab (int): vocabulary ``V`` (0 is the separator), default 16.
        length (int): string length ``L``, default ``seq_len // 2``; needs ``2 L <= seq_len``.
        eval_size (int): examples in val and in test, default 1000.
    """
    _no_data("copy", data)
    o = take_options(
        "copy", options, {"vocab": (int, 16), "length": (int, None), "eval_size": (int, 1000)}
    )
    L = o["length"] if o["length"] is not None else seq_len // 2
    if not 1 <= L <= seq_len // 2:
        raise DataError(f"copy: option 'length' must be in 1..seq_len//2={seq_len // 2}, got {L}")
    if o["vocab"] < 2:
        raise DataError(f"copy: option 'vocab' must be >= 2 (0 is the separator), got {o['vocab']}")
    if o["eval_size"] < 1:
        raise DataError(f"copy: option 'eval_size' must be >= 1, got {o['eval_size']}")
    V = o["vocab"]

    def generate(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        return copying(rng, n, seq_len=seq_len, vocab=V, length=L)

    return SyntheticTask(
        "copy",
        generate,
        seq_len=seq_len,
        vocab_size=V,
        seed=seed,
        eval_size=o["eval_size"],
        details={**o, "length": L},
    )
