"""The training loop: resume after SIGKILL, Ctrl-C, accumulation and multi-process equivalence."""

import dataclasses
import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from aftlab.errors import UsageError
from aftlab.models import TransformerLM
from aftlab.train.build import build_task, model_config_for
from aftlab.train.checkpoint import latest_checkpoint
from aftlab.train.config import load_config
from aftlab.train.run import load_run
from aftlab.train.trainer import Trainer

from .helpers import ENV, TINY, run_aftlab, write_text


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if r["split"] == "train"], [
        r["loss"] for r in recs if r["split"] == "train"
    ]


def _weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def _config(tmp_path, *extra):
    data = write_text(tmp_path / "data.txt")
    args = [a for a in TINY if a != "--set"] + [f"data={json.dumps(str(data))}", *extra]
    return load_config(None, args)


def test_training_lowers_the_loss_and_writes_the_run(tmp_path, capsys):
    cfg = _config(tmp_path, "steps=30", "lr=1e-2", "eval_interval=10", "checkpoint_interval=10")
    summary = Trainer(cfg, run_dir=tmp_path / "run").fit()
    steps, losses = _losses(tmp_path / "run")
    assert steps == list(range(1, 31))
    assert losses[-1] < losses[0] - 1.0  # a byte model learns the word frequencies fast
    assert summary["steps"] == 30 and summary["test_bpb"] == pytest.approx(
        summary["test_loss"] / 0.6931471805599453
    )
    val = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val if r["split"] == "val"] == [10, 20]
    assert (tmp_path / "run" / "config.toml").is_file() and (
        tmp_path / "run" / "summary.json"
    ).is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_00000020",
        "step_00000030",
    ]
    out = capsys.readouterr().out
    assert "test bpb:" in out and "--- sample ---" in out


def test_a_run_stores_the_task_once_and_the_model_config_built_for_it(tmp_path):
    cfg = _config(tmp_path, "steps=1")
    Trainer(cfg, run_dir=tmp_path / "run").fit()
    saved = json.loads((latest_checkpoint(tmp_path / "run") / "config.json").read_text())
    task = build_task(cfg)
    info = json.loads((tmp_path / "run" / "task.json").read_text())
    assert info == saved["task"] == json.loads(json.dumps(task.info()))
    assert (info["task"], info["image_shape"], info["seed"]) == ("text", None, 0)
    assert saved["model"] == model_config_for(cfg, task).to_dict()
    assert saved["train"] == cfg.to_dict()


def test_a_checkpoint_with_the_earlier_task_layout_still_loads(tmp_path):
    """Checkpoints of 0.1.0 and of the versions before one task description stored this."""
    from .test_hostile_files import _edit_config

    cfg = _config(tmp_path, "steps=1")
    Trainer(cfg, run_dir=tmp_path / "run").fit()
    old = {
        "name": "text",
        "kind": "lm",
        "vocab_size": 256,
        "num_classes": None,
        "seq_len": 16,
        "metric": "bpb",
        "image_shape": None,
    }
    _edit_config(latest_checkpoint(tmp_path / "run"), lambda c: c.update(task=old))
    run = load_run(tmp_path / "run")
    assert type(run.model) is TransformerLM and run.step == 1
    resumed = Trainer(cfg.replace(steps=2), run_dir=tmp_path / "run", resume=True).fit()
    assert resumed["steps"] == 2 and resumed["resumed_from"] == 1


def test_a_device_the_machine_lacks_stops_the_trainer_before_the_run_folder(
    tmp_path, monkeypatch
):
    """The trainer's one device check (no other before it) knows how many GPUs there are."""
    counted = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: counted.append(1) or 1)
    cfg = _config(tmp_path, "device='cuda:3'")
    with pytest.raises(
        UsageError, match=r"'cuda:3' but this machine has 1 CUDA device\(s\): cuda:0 \.\. cuda:0"
    ):
        Trainer(cfg, run_dir=tmp_path / "run").fit()
    assert counted == [1] and not (tmp_path / "run").exists()


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    a = Trainer(_config(tmp_path, "steps=3", "out='a'"), run_dir=tmp_path / "a")
    b = Trainer(_config(tmp_path, "steps=3", "grad_accum=4"), run_dir=tmp_path / "b")
    a.fit(), b.fit()
    la, lb = _losses(tmp_path / "a")[1], _losses(tmp_path / "b")[1]
    # losses after the first step depend on the updated weights, so they check the gradients too
    assert la == pytest.approx(lb, abs=1e-5)
    assert la[0] != la[-1]


def test_bf16_autocast_trains(tmp_path):
    summary = Trainer(
        _config(tmp_path, "steps=3", "precision='bf16'"), run_dir=tmp_path / "r"
    ).fit()
    assert torch.isfinite(torch.tensor(summary["test_loss"])) and summary["steps"] == 3


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_gives_the_same_weights(tmp_path):
    data = write_text(tmp_path / "data.txt")
    args = [
        "train",
        "--data",
        str(data),
        *TINY,
        "--set",
        "checkpoint_interval=1",
        "--set",
        "keep_last=2",
        "--set",
        "model.d_model=32",
        "--set",
        "seq_len=32",
        "--set",
        "sample_tokens=0",
        "--steps",
        "24",
    ]
    ref = run_aftlab(*args, "--out", str(tmp_path / "ref"), cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kill_after = rng.randint(2, 14)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aftlab", *args, "--out", str(tmp_path / "run")],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= kill_after:
            break
        time.sleep(0.005)
    time.sleep(rng.random() * 0.05)  # somewhere inside a step or a checkpoint write
    assert proc.poll() is None, f"run finished before the kill (seed {seed})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = run_aftlab(*args, "--out", str(tmp_path / "run"), "--resume", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    steps, losses = _losses(tmp_path / "run")
    assert steps == list(range(1, 25)), f"seed {seed}"
    assert losses == _losses(tmp_path / "ref")[1], f"seed {seed}"
    ref_w, got_w = _weights(tmp_path / "ref"), _weights(tmp_path / "run")
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), (
            f"{k} differs after kill at line {kill_after} (seed {seed})"
        )


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "run"
    args = [
        "train",
        "--data",
        str(data),
        *TINY,
        "--set",
        "checkpoint_interval=1000",
        "--set",
        "seq_len=32",
        "--set",
        "model.d_model=32",
        "--steps",
        "100000",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aftlab", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 3
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted at step" in stderr
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    step = json.loads((ckpt / "manifest.json").read_text())["step"]
    assert step >= 3 and _losses(out)[0][-1] == step
    # and it continues from there
    res = run_aftlab("train", "--out", str(out), "--resume", "--steps", str(step + 2), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert _losses(out)[0] == list(range(1, step + 3))


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    data = write_text(tmp_path / "data.txt")
    args = [
        "train",
        "--data",
        str(data),
        *TINY,
        "--set",
        "sample_tokens=0",
        "--steps",
        "4",
        "--set",
        "batch_size=8",
    ]
    one = run_aftlab(*args, "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    env = {"MASTER_ADDR": "127.0.0.1"}
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "-m",
            "aftlab",
            *args,
            "--set",
            "grad_accum=2",
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, **env},
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stderr
    s1, l1 = _losses(tmp_path / "one")
    s2, l2 = _losses(tmp_path / "two")
    assert s1 == s2 == [1, 2, 3, 4]
    assert l1 == pytest.approx(l2, abs=1e-5)  # steps 2-4 see weights updated with DDP's gradients
    assert l1[0] != l1[-1]


def test_pixel_task_is_scored_like_the_models_own_bits_per_dim():
    pytest.importorskip("sklearn")
    from aftlab.data import build_task
    from aftlab.models import PixelTransformer, TransformerConfig
    from aftlab.train.trainer import evaluate

    task = build_task("digits", seq_len=64)
    cfg = TransformerConfig(
        vocab_size=task.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=task.seq_len
    )
    model = PixelTransformer(cfg, image_shape=task.image_shape).eval()
    res = evaluate(model, task, "val", batch_size=8, max_batches=1)
    pixels = next(iter(task.eval_batches("val", batch_size=8, max_batches=1)))["target"]
    expected = model.bits_per_dim(pixels).mean().item()
    assert res["bits/dim"] == pytest.approx(expected, rel=1e-5)
    assert res["targets"] == pixels.numel()


def test_every_model_says_what_its_forward_reads_from_a_batch():
    """``forward_batch`` has no per-model branch: each model's ``batch_input`` names its inputs."""
    from torch import nn

    from aftlab.models import (
        PixelTransformer,
        TransformerClassifier,
        TransformerConfig,
        TransformerLM,
    )
    from aftlab.train.trainer import forward_batch

    class Spy(nn.Module):  # stands for the torch.compile / DDP wrapper the trainer calls
        def __init__(self, model):
            super().__init__()
            self.model, self.calls = model, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.model(*args, **kwargs)

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=17, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    pixels = torch.randint(0, 17, (3, 16))
    shifted = torch.cat([torch.zeros(3, 1, dtype=torch.long), pixels[:, :-1]], dim=1)
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, 11:] = False
    pix = PixelTransformer(cfg, image_shape=(4, 4)).eval()
    lm = TransformerLM(cfg).eval()
    clf = TransformerClassifier(dataclasses.replace(cfg, causal=False), num_classes=5).eval()
    cases = [  # (model, batch, what its forward must get)
        (pix, {"input": shifted, "target": pixels}, lambda: pix(pixels)),
        (lm, {"input": shifted, "target": pixels}, lambda: lm(shifted)),
        (
            lm,
            {"input": shifted, "target": pixels, "padding_mask": mask},
            lambda: lm(shifted, padding_mask=mask),
        ),
        (
            clf,
            {"input": pixels, "target": pixels[:, 0] % 5, "padding_mask": mask},
            lambda: clf(pixels, padding_mask=mask),
        ),
    ]
    with torch.no_grad():
        for model, batch, expected in cases:
            torch.testing.assert_close(forward_batch(model, batch), expected(), rtol=0, atol=0)
            spy = Spy(model)
            out = forward_batch(model, batch, wrapper=spy)
            assert spy.calls == 1
            torch.testing.assert_close(out, expected(), rtol=0, atol=0)


def test_scored_forward_runs_the_head_at_the_scored_positions_only():
    """A recall batch: ``(n, V)`` logits at the ``n`` targets that are not -100, the rows of the
    full logits there, the same loss, accuracy and gradients; over half scored: the full
    logits."""
    from aftlab.data import IGNORE_INDEX, build_task, count_correct
    from aftlab.models import RWKV4LM, RWKV4Config, TransformerConfig
    from aftlab.train.trainer import forward_batch, nll_sum, scored_forward

    MIXERS = ("attention", "aft-decay", "aft-local")
    torch.manual_seed(0)
    task = build_task("recall", seq_len=32, num_pairs=3, vocab=64)
    batch = task.train_batch(0, batch_size=5)
    target = batch["target"]
    n = int((target != IGNORE_INDEX).sum())
    assert 0 < n < target.numel()
    cfg = TransformerConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=32)
    models = [TransformerLM(dataclasses.replace(cfg, mixer=m)).double() for m in MIXERS] + [
        RWKV4LM(RWKV4Config(vocab_size=64, d_model=16, n_layers=2)).double()
    ]
    for model in models:
        name = type(model).__name__
        logits, kept = scored_forward(model, batch)
        assert logits.shape == (n, 64) and torch.equal(kept, target[target != IGNORE_INDEX])
        full = forward_batch(model, batch)
        torch.testing.assert_close(logits, full[target != IGNORE_INDEX], rtol=1e-12, atol=1e-12)
        assert count_correct(logits, kept) == count_correct(full, target), name
        grads = []
        for lg, tg in ((logits, kept), (full, target)):
            model.zero_grad()
            s, k = nll_sum(lg, tg)
            assert int(k) == n
            s.backward()
            grads.append({p: q.grad.clone() for p, q in model.named_parameters()})
        for p, g in grads[0].items():
            torch.testing.assert_close(g, grads[1][p], rtol=1e-10, atol=1e-12, msg=f"{name}: {p}")
        unselected, same = scored_forward(model, batch, select=False)
        assert unselected.shape == (5, 32, 64) and same is target
    text = {"input": batch["input"], "target": batch["input"].clone()}
    text["target"][:, :15] = IGNORE_INDEX  # over half scored (as a text batch): the full logits
    assert scored_forward(models[0], text)[0].shape == (5, 32, 64)
    text["target"][:, 15] = IGNORE_INDEX  # half scored: their rows
    assert scored_forward(models[0], text)[0].shape == (5 * 16, 64)


def test_logits_mask_is_checked():
    from aftlab.models import RWKV4LM, RWKV4Config, TransformerConfig

    lm = TransformerLM(TransformerConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2))
    rwkv = RWKV4LM(RWKV4Config(vocab_size=11, d_model=8, n_layers=1))
    idx = torch.zeros(2, 5, dtype=torch.long)
    for model in (lm, rwkv):
        with pytest.raises(TypeError, match="'logits_mask' must be a bool tensor"):
            model(idx, logits_mask=torch.ones(2, 5))
        with pytest.raises(ValueError, match="'logits_mask'"):
            model(idx, logits_mask=torch.ones(2, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="'logits_to_keep' or 'logits_mask', not both"):
            model(idx, logits_to_keep=1, logits_mask=torch.ones(2, 5, dtype=torch.bool))
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[1, 3] = True
        with torch.no_grad():  # float32 head, one row's products in another blocking
            torch.testing.assert_close(model(idx, logits_mask=mask), model(idx)[1, 3][None])
