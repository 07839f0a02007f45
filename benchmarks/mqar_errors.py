"""What an MQAR model answers when it is wrong: its test predictions by the queried pair.

    python benchmarks/mqar_errors.py runs/mqar/d64-T128/aft-decay runs/mqar/d64-T128/attention

For each run folder (an ``aftlab train --task recall`` run, or one mixer of an ``aftlab
compare``), the newest checkpoint's arg-max prediction at every query of the test split,
split by which of the ``P`` pairs was queried (pair ``i`` is the ``i``-th shown, ``1 .. P``):

- ``accuracy``: the prediction is the queried key's value;
- ``in value set``: the prediction is one of the ``P`` values shown (a model that has learned
  the value set but not the lookup predicts these, right ``1/P`` of the time);
- ``answers pair j``: how often the prediction is the value of pair ``j``, whichever was
  queried (a model that forgets early pairs answers late ones).

Prints one markdown table per run: rows pair ``i`` (the queries of pair ``i``), columns the
accuracy and the two shares; the last row all queries.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from aftlab.errors import UsageError
from aftlab.train.run import load_run
from aftlab.train.trainer import forward_batch


@torch.no_grad()
def predictions(run_dir: str, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Test-split inputs ``(n, T)``, targets ``(n, T)`` and arg-max predictions ``(n, T)``."""
    run = load_run(run_dir)
    if run.config.task != "recall":
        raise UsageError(f"{run_dir}: task {run.config.task!r}, not 'recall'")
    inp, target = run.task.eval_set("test")
    batches = run.task.eval_batches("test", batch_size=batch_size)
    pred = np.concatenate([forward_batch(run.model, b).argmax(-1).numpy() for b in batches])
    return inp, target, pred


def by_pair(inp: np.ndarray, target: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """``(P + 1, 2 + P)``: per queried pair ``i`` (last row: all queries), the accuracy, the share
    of predictions in the value set and the share answering each pair ``j``'s value.

    The pairs are ``inp[:, 0:2P:2]`` (keys) and ``inp[:, 1:2P:2]`` (values); a query is a
    position with a target, its target the queried pair's value.
    """
    P = int((target[0] != -100).sum())
    values = inp[:, 1 : 2 * P : 2]  # (n, P)
    rows, cols = np.nonzero(target != -100)
    answer, guess = target[rows, cols], pred[rows, cols]
    queried = np.argmax(values[rows] == answer[:, None], axis=1)  # pair index of each query
    answers_pair = values[rows] == guess[:, None]  # (queries, P)
    out = np.empty((P + 1, 2 + P))
    for i in range(P + 1):
        sel = queried == i if i < P else slice(None)
        out[i, 0] = (guess[sel] == answer[sel]).mean()
        out[i, 1] = answers_pair[sel].any(1).mean()
        out[i, 2:] = answers_pair[sel].mean(0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders of MQAR trainings")
    a = p.parse_args()
    for run_dir in a.runs:
        try:
            table = by_pair(*predictions(run_dir))
        except UsageError as e:
            sys.exit(f"mqar_errors: {e}")
        P = table.shape[0] - 1
        print(f"\n{run_dir}\n")
        print("| queried pair | accuracy | in value set | "
              + " | ".join(f"answers {j + 1}" for j in range(P)) + " |")
        print("|---|" + "---:|" * (2 + P))
        for i, row in enumerate(table):
            name = str(i + 1) if i < P else "all"
            print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in row) + " |")


if __name__ == "__main__":
    main()
