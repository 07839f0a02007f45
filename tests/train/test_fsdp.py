"""Sharded training (FSDP2, ``--parallel fsdp``) with 2 CPU processes over gloo.

A 2-process FSDP run must compute what one process computes, write the checkpoint one process
writes, and resume with another number of processes (2 -> 1, 1 -> 2) on the same trajectory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .helpers import ENV, TINY, run_aftlab, write_text

pytestmark = pytest.mark.slow

ARGS = [
    *TINY,
    "--set",
    "model.n_layers=2",  # two blocks, each its own FSDP unit
    "--set",
    "batch_size=8",
    "--set",
    "grad_accum=2",  # FSDP skips the reduce-scatter of the first micro-batch
    "--set",
    "checkpoint_interval=2",
    "--set",
    "keep_last=3",
    "--set",
    "eval_interval=2",
]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` with 2 processes on this machine."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "MASTER_ADDR": "127.0.0.1"},
    )


def _train(out: Path, *extra: str, procs: int, cwd: Path) -> subprocess.CompletedProcess:
    args = ["train", "--data", str(cwd / "data.txt"), *ARGS, "--out", str(out), *extra]
    res = _torchrun("-m", "aftlab", *args, cwd=cwd) if procs == 2 else run_aftlab(*args, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _assert_weights_close(a: Path, b: Path, *, atol: float) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


def _resume_copy(src: Path, dst: Path) -> Path:
    """``src`` as it was at step 2: a copy without its step-4 checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(_ckpt(dst, 4))
    (dst / "summary.json").unlink()
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``one``: 1 process (DDP setting); ``two``: 2 FSDP processes; same config, 4 steps."""
    root = tmp_path_factory.mktemp("fsdp")
    write_text(root / "data.txt")
    one = root / "one"
    _train(one, "--steps", "4", procs=1, cwd=root)
    two = root / "two"
    res = _train(two, "--steps", "4", "--parallel", "fsdp", procs=2, cwd=root)
    assert "2 process(es) fsdp" in res.stderr
    return root, one, two


def test_two_fsdp_processes_train_and_save_like_one(runs):
    _, one, two = runs
    l1, l2 = _losses(one), _losses(two)
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(v)) for v in l2.values())
    assert list(l1.values()) == pytest.approx(list(l2.values()), abs=1e-5)
    assert l1[1] != l1[4]
    for step in (2, 4):
        a, b = _ckpt(one, step), _ckpt(two, step)
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        _assert_weights_close(a, b, atol=1e-5)  # the tied head stored once, as one process does
        sa, sb = load_file(a / "train_state.safetensors"), load_file(b / "train_state.safetensors")
        assert sorted(sa) == sorted(sb)  # optimizer moments numbered as one process numbers them
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-5, msg=k)
        ja, jb = (json.loads((c / "train_state.json").read_text())["dict"] for c in (a, b))
        assert (ja.pop("world_size"), jb.pop("world_size")) == (1, 2)
        assert ja == jb


def test_fsdp_run_reads_like_a_single_process_one(runs):
    root, one, two = runs
    res = run_aftlab("eval", str(two), "--batches", "2", "--device", "cpu", cwd=root)
    assert res.returncode == 0, res.stderr
    bpb = float(res.stdout.split("test bpb:")[1].split()[0])
    # the same 2 test batches the 1-process run scored at its end, with the same weights
    expected = json.loads((one / "summary.json").read_text())["test_bpb"]
    assert bpb == pytest.approx(expected, abs=1e-3)
    res = run_aftlab("sample", str(two), "--tokens", "8", "--device", "cpu", cwd=root)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


def test_fsdp_run_saved_with_two_processes_resumes_with_one(runs):
    root, _, two = runs
    resumed = _resume_copy(two, root / "two-then-one")
    _train(resumed, "--resume", "--steps", "4", procs=1, cwd=root)
    l2, lr = _losses(two), _losses(resumed)
    assert list(lr) == [1, 2, 3, 4]
    assert [lr[3], lr[4]] == pytest.approx([l2[3], l2[4]], abs=1e-5)
    # restored optimizer moments: fresh ones would move the weights by ~lr = 2e-3
    _assert_weights_close(_ckpt(resumed, 4), _ckpt(two, 4), atol=1e-5)


def test_single_process_run_resumes_with_two_fsdp_processes(runs):
    root, one, _ = runs
    resumed = _resume_copy(one, root / "one-then-two")
    res = _train(resumed, "--resume", "--steps", "4", "--parallel", "fsdp", procs=2, cwd=root)
    assert "resuming" in res.stderr
    lo, lr = _losses(one), _losses(resumed)
    assert [lr[3], lr[4]] == pytest.approx([lo[3], lo[4]], abs=1e-5)
    _assert_weights_close(_ckpt(resumed, 4), _ckpt(one, 4), atol=1e-5)


ROUND_TRIP = """
import os
import sys
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from aftlab.models import TransformerConfig
from aftlab.train.build import build_model
from aftlab.train.checkpoint import load_checkpoint, read_checkpoint_config
from aftlab.train.distributed import (
    full_model_state, full_optimizer_state, load_optimizer_state, wrap_model,
)
from aftlab.train.optim import build_optimizer

dist.init_process_group("gloo")
ckpt = sys.argv[1]
config = read_checkpoint_config(ckpt)
torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
model = build_model(TransformerConfig.from_dict(config["model"]), config["task"])
state = load_checkpoint(ckpt, model)
wrap_model(model, parallel="fsdp", device=torch.device("cpu"))
emb = model.backbone.token_embedding.weight
assert emb.to_local().shape[0] < emb.shape[0], "not sharded"
train = config["train"]
optimizer = build_optimizer(
    model, lr=train["lr"], weight_decay=train["weight_decay"], betas=train["betas"]
)
load_optimizer_state(model, optimizer, state["optimizer"])
weights = full_model_state(model)
optim = full_optimizer_state(model, optimizer)
if dist.get_rank() == 0:
    saved = load_file(ckpt + "/model.safetensors")
    assert sorted(weights) == sorted(saved), (sorted(weights), sorted(saved))
    for k in saved:
        assert torch.equal(weights[k], saved[k]), k
    want = state["optimizer"]
    groups = [g["params"] for g in optim["param_groups"]]
    assert groups == [g["params"] for g in want["param_groups"]]
    assert sorted(optim["state"]) == sorted(want["state"]) and want["state"]
    for i, moments in want["state"].items():
        assert sorted(optim["state"][i]) == sorted(moments), i
        for k, v in moments.items():
            assert torch.equal(optim["state"][i][k], v), (i, k)
    print("bit-identical")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as aftlab train does: gloo may abort in exit-time destructors (cli/commands.py)
"""


def test_sharding_a_checkpoint_and_gathering_it_is_bit_identical(runs):
    root, one, _ = runs
    script = root / "round_trip.py"
    script.write_text(ROUND_TRIP)
    res = _torchrun(str(script), str(_ckpt(one, 2)), cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "bit-identical" in res.stdout


def test_parallel_setting_is_checked(tmp_path):
    res = run_aftlab("train", "--set", "parallel=zero", "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert res.returncode == 2
    assert "'parallel' must be one of ['ddp', 'fsdp'], got 'zero'" in res.stderr
    assert not (tmp_path / "r").exists()


def test_an_rwkv4_model_shards_its_blocks_and_trains_like_one_process(tmp_path):
    """``model.architecture = "rwkv4"`` under 2 FSDP processes: the losses and weights of one
    process (wrap_model shards its RWKV4Blocks, then the root)."""
    write_text(tmp_path / "data.txt")
    pairs = [(f, v) for f, v in zip(ARGS[::2], ARGS[1::2], strict=True) if "n_heads" not in v]
    args = [x for pair in pairs for x in pair] + ["--set", "model.architecture=rwkv4"]
    for name, extra in (("one", []), ("two", ["--parallel", "fsdp"])):
        cmd = ["train", "--data", str(tmp_path / "data.txt"), *args, "--steps", "2", *extra]
        cmd += ["--out", str(tmp_path / name)]
        run = _torchrun if extra else run_aftlab
        res = run("-m", "aftlab", *cmd, cwd=tmp_path) if extra else run(*cmd, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2]
    assert list(l1.values()) == pytest.approx(list(l2.values()), abs=1e-5)
    _assert_weights_close(_ckpt(tmp_path / "one", 2), _ckpt(tmp_path / "two", 2), atol=1e-5)
