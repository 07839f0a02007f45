"""Training is bitwise reproducible at a fixed thread count, for AFT-local as for attention."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from aftlab.train.checkpoint import latest_checkpoint
from aftlab.train.config import load_config
from aftlab.train.trainer import Trainer

from .helpers import TINY, write_text


def test_aft_local_run_twice_with_two_threads_gives_the_same_weights(tmp_path):
    """Same seed, same data, 2 threads: the same weights, bit for bit.

    AFT-local's band of ``w = U V^T`` was gathered with ``V[cols]``, whose backward
    accumulates with ``index_put_`` in thread-schedule order: weights differed by up to 5e-5.
    """
    data = write_text(tmp_path / "data.txt")
    args = [a for a in TINY if a != "--set"] + [
        f"data={json.dumps(str(data))}",
        "mixer='aft-local'",
        "seq_len=256",  # a band large enough that the old gather ran on both threads
        "batch_size=2",
        "steps=10",
        "sample_tokens=0",
        "seed=7",
    ]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for run in ("a", "b"):
            Trainer(load_config(None, args), run_dir=tmp_path / run).fit()
    finally:
        torch.set_num_threads(n)
    a, b = (load_file(str(latest_checkpoint(tmp_path / r) / "model.safetensors")) for r in "ab")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between the two runs"
