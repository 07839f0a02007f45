"""Training and evaluation on long streams: carry_state, its checkpoint and resume,
pack_documents, and the streamed evaluation (``aftlab eval --stream``)."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from aftlab.data import ByteLMTask
from aftlab.data.base import pack_rows
from aftlab.errors import UsageError
from aftlab.models import TransformerConfig, TransformerLM
from aftlab.train.build import build_model, build_task, model_config_for
from aftlab.train.checkpoint import latest_checkpoint, list_checkpoints, load_carried_state
from aftlab.train.config import load_config
from aftlab.train.streams import (
    CarriedWindows,
    evaluate_stream,
    flatten_state,
    restore_state,
    stream_refusal,
)
from aftlab.train.trainer import Trainer, evaluate, forward_batch

from .helpers import TINY, write_text

#: a causal model whose state has a fixed size: what carry_state trains
STATEFUL = ["mixer='aft-decay'", "model.positional='none'"]


def _config(tmp_path: Path, *extra: str, data: Path | None = None):
    data = data or write_text(tmp_path / "data.txt")
    args = [a for a in TINY if a != "--set"] + [f"data={json.dumps(str(data))}", *extra]
    return load_config(None, args)


def _train_losses(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["split"] == "train"]


def _model(cfg):
    """The run's model as the trainer builds it (same seed, same initial weights) and its task."""
    task = build_task(cfg)
    torch.manual_seed(cfg.seed)
    return build_model(model_config_for(cfg, task), task.info()), task


def _mean_nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))


# --------------------------------------------------------------------------- carry_state


def test_carry_state_carries_the_state_of_the_first_window_into_the_second_step(tmp_path):
    cfg = _config(
        tmp_path, *STATEFUL, "carry_state=true", "steps=2", "checkpoint_interval=1", "keep_last=5"
    )
    summary = Trainer(cfg, run_dir=tmp_path / "run").fit()
    assert math.isfinite(summary["train_loss"])
    model, task = _model(cfg)
    B = cfg.batch_size
    windows = task.consecutive_windows(0, batch_size=B, windows=2)
    step1 = list_checkpoints(tmp_path / "run")[0][1]
    tensors, values = load_carried_state(step1)
    # the state saved after step 1 is the initial model's after window 0, as safetensors
    with torch.no_grad():
        _, expected = model.prefill(windows["input"][0])
    want, want_values = flatten_state(expected)
    assert tensors.keys() == want.keys() and values == want_values
    assert values["position"] == cfg.seq_len and values["batch_size"] == B
    for name in want:
        torch.testing.assert_close(tensors[name], want[name])
    with safe_open(str(step1 / "carried_state.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["values"]) == values
    # step 2 reads window 1 from that state, with the weights after step 1
    model.load_state_dict(load_file(str(step1 / "model.safetensors")), strict=False)
    carried = restore_state(model.init_cache(B), tensors, values)
    with torch.no_grad():
        from_state = model.prefill(windows["input"][1], cache=carried)[0]
        from_nothing = model.prefill(windows["input"][1])[0]
    loss2 = _train_losses(tmp_path / "run")[1]
    assert loss2 == pytest.approx(_mean_nll(from_state, windows["target"][1]), rel=1e-6)
    assert abs(loss2 - _mean_nll(from_nothing, windows["target"][1])) > 2e-5  # 4x the tolerance
    assert (from_state - from_nothing).abs().max() > 1e-2  # the state changes the logits


def test_a_resumed_carry_state_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    # 32 streams of 337 bytes: 21 windows of 16 each, so step 7 (windows 21..23) wraps and resets
    extra = [*STATEFUL, "carry_state=true", "carry_grad_windows=3", "batch_size=32"]
    extra += ["grad_accum=2", "checkpoint_interval=4", "sample_tokens=0"]
    data = write_text(tmp_path / "data.txt")
    whole = _config(tmp_path, *extra, "steps=8", data=data)
    Trainer(whole, run_dir=tmp_path / "whole").fit()

    class StopAfter4(Trainer):  # as a Ctrl-C after step 4 does: checkpoint, stop
        def _logged_step(self, progress):
            super()._logged_step(progress)
            if self.step == 4:
                self._stop_signal = signal.SIGINT

    assert StopAfter4(whole, run_dir=tmp_path / "cut").fit() == {"interrupted": True, "step": 4}
    Trainer(whole, run_dir=tmp_path / "cut", resume=True).fit()
    assert _train_losses(tmp_path / "cut") == _train_losses(tmp_path / "whole")
    a, b = latest_checkpoint(tmp_path / "whole"), latest_checkpoint(tmp_path / "cut")
    for name in ("model.safetensors", "carried_state.safetensors"):
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
    _, values = load_carried_state(b)
    assert values["position"] == 3 * 16 and values["batch_size"] == 32  # 2 windows after 21


def test_the_trainer_runs_k_windows_per_step_from_the_carried_cache(tmp_path, monkeypatch):
    calls = []
    forward = CarriedWindows.forward

    def spy(self, windows, cache, reset):
        calls.append((tuple(windows.shape), cache.position, reset))
        return forward(self, windows, cache, reset)

    monkeypatch.setattr(CarriedWindows, "forward", spy)
    extra = [*STATEFUL, "carry_state=true", "carry_grad_windows=2", "grad_accum=2", "steps=3"]
    summary = Trainer(_config(tmp_path, *extra), run_dir=tmp_path / "run").fit()
    T = 16
    assert calls == [
        ((2, 2, T), 0, (True, False)),  # step 1, micro-batch 0: windows 0, 1 from nothing
        ((2, 2, T), 0, (True, False)),  # micro-batch 1
        ((2, 2, T), 2 * T, (False, False)),  # step 2: windows 2, 3 from the state after 1
        ((2, 2, T), 2 * T, (False, False)),
        ((2, 2, T), 4 * T, (False, False)),
        ((2, 2, T), 4 * T, (False, False)),
    ]
    assert summary["tokens_seen"] == 3 * 2 * 4 * T  # steps x windows x rows x tokens


@pytest.mark.slow
def test_two_processes_carry_the_state_of_their_streams_like_one(tmp_path):
    import subprocess
    import sys

    from .helpers import ENV, run_aftlab
    from .test_trainer import _free_port

    data = write_text(tmp_path / "data.txt")
    args = ["train", "--data", str(data), *TINY, "--steps", "3", "--set", "batch_size=8"]
    args += ["--set", "sample_tokens=0", "--set", "carry_state=true"]
    args += [x for pair in zip(["--set"] * 2, STATEFUL, strict=True) for x in pair]
    one = run_aftlab(*args, "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    torchrun += ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    two = subprocess.run(
        [*torchrun, "-m", "aftlab", *args, "--set", "grad_accum=2", "--out", str(tmp_path / "two")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "MASTER_ADDR": "127.0.0.1"},
    )
    assert two.returncode == 0, two.stderr[-3000:]
    losses = _train_losses(tmp_path / "one")
    assert losses == pytest.approx(_train_losses(tmp_path / "two"), abs=1e-5)
    a = load_carried_state(latest_checkpoint(tmp_path / "one"))
    b = load_carried_state(latest_checkpoint(tmp_path / "two"))  # gathered from both ranks
    assert a[1] == b[1] and a[1]["batch_size"] == 8 and a[0].keys() == b[0].keys()
    for name in a[0]:
        torch.testing.assert_close(a[0][name], b[0][name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["mixer='attention'", "model.positional='rotary'"], "state of 'attention' grows"),
        (["mixer='aft-decay'"], "the learned positional table limits it to max_seq_len = 16"),
        (["mixer='aft-full'", "model.positional='none'"], "aft-full limits it to max_seq_len = 16"),
        ([*STATEFUL, "batch_size=1024"], "batch_size=1024 streams gives 10 bytes each"),
    ],
)
def test_carry_state_refuses_what_cannot_carry_a_state(tmp_path, extra, message):
    cfg = _config(tmp_path, *extra, "carry_state=true")
    with pytest.raises(UsageError, match=f"carry_state: .*{message}"):
        Trainer(cfg, run_dir=tmp_path / "run").fit()
    assert not (tmp_path / "run").exists()


def test_carry_state_and_pack_documents_refuse_tasks_without_streams_or_documents(tmp_path):
    recall = load_config(None, ["task='recall'", "seq_len=32", *STATEFUL, "carry_state=true"])
    with pytest.raises(UsageError, match="carry_state: task 'recall' is not one stream of tokens"):
        Trainer(recall, run_dir=tmp_path / "a").fit()
    one_file = _config(tmp_path, "pack_documents=true")
    with pytest.raises(UsageError, match="pack_documents: task 'text' has no document boundaries"):
        Trainer(one_file, run_dir=tmp_path / "b").fit()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["carry_grad_windows=2"], "'carry_grad_windows' must be 1 unless carry_state = true"),
        (["carry_state=true", "carry_grad_windows=0"], "'carry_grad_windows' must be > 0"),
        (["carry_state=true", "pack_documents=true"], "carry_state and pack_documents exclude"),
    ],
)
def test_stream_options_are_checked_with_the_config(args, message):
    with pytest.raises(UsageError, match=message):
        load_config(None, args)


def test_a_stored_config_without_the_later_keys_reads_as_off():
    from aftlab.train.config import LATER_KEYS, STORED_KEYS, TrainConfig, check_stored

    old = {k: v for k, v in TrainConfig().to_dict().items() if k not in LATER_KEYS}
    check_stored(old, "old")  # no error: runs before these keys trained without them
    cfg = TrainConfig.from_dict(old)
    assert (cfg.carry_state, cfg.carry_grad_windows, cfg.pack_documents) == (False, 1, False)
    assert not set(LATER_KEYS) & set(STORED_KEYS)


def test_restore_state_checks_names_shapes_and_values():
    model = TransformerLM(
        TransformerConfig(vocab_size=8, d_model=8, n_layers=2, n_heads=2, mixer="aft-decay")
    )
    tensors, values = flatten_state(model.init_cache(3))
    name = next(iter(tensors))
    restored = restore_state(model.init_cache(3), tensors, values)
    assert flatten_state(restored)[1] == values
    with pytest.raises(ValueError, match=rf"no tensor '{name}', which the model's state has"):
        restore_state(model.init_cache(3), {k: v for k, v in tensors.items() if k != name}, values)
    shape = rf"'{name}' is torch.float\d+ \(2, .*needs torch.float\d+ \(3"
    with pytest.raises(ValueError, match=shape):
        restore_state(model.init_cache(3), {**tensors, name: tensors[name][:2]}, values)
    with pytest.raises(ValueError, match="'extra' is not part of the model's state"):
        restore_state(model.init_cache(3), {**tensors, "extra": tensors[name]}, values)
    with pytest.raises(ValueError, match="'position' is str '0', the model's state needs a int"):
        restore_state(model.init_cache(3), tensors, {**values, "position": "0"})


# --------------------------------------------------------------------------- pack_documents


def _folder(root: Path, n_files: int = 24) -> Path:
    """Text files of 40.. bytes, each beginning with ``@`` (found nowhere else)."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n_files):
        body = bytes(rng.integers(97, 123, size=40 + 5 * i, dtype=np.uint8))
        (root / f"f{i:02d}.txt").write_bytes(b"@" + body)
    return root


def test_pack_documents_trains_on_packed_micro_batches(tmp_path, monkeypatch):
    seen = []
    forward = TransformerLM.forward

    def spy(self, idx, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            seen.append((idx.clone(), kwargs["cu_seqlens"].clone()))
        return forward(self, idx, **kwargs)

    monkeypatch.setattr(TransformerLM, "forward", spy)
    folder = _folder(tmp_path / "docs")
    cfg = _config(tmp_path, "pack_documents=true", "grad_accum=2", "steps=2", data=folder)
    summary = Trainer(cfg, run_dir=tmp_path / "run").fit()
    assert math.isfinite(summary["train_loss"]) and len(seen) == 4  # 2 steps x 2 micro-batches
    task = build_task(cfg)
    for step in range(2):
        batch = task.document_batch(step, batch_size=4)
        for i in range(2):
            want = pack_rows({k: v[2 * i : 2 * i + 2] for k, v in batch.items()})
            idx, cu = seen[2 * step + i]
            assert torch.equal(idx, want["input"]) and torch.equal(cu, want["cu_seqlens"])
    assert any(len(cu) > 3 for _, cu in seen)  # some file begins inside a row


@pytest.mark.parametrize("mixer", ["attention", "aft-simple", "aft-decay", "aft-local", "aft-conv"])
def test_no_position_of_a_packed_row_sees_another_file(tmp_path, mixer):
    folder = _folder(tmp_path / "docs", n_files=30)
    cfg = _config(tmp_path, f"mixer='{mixer}'", "seq_len=32", data=folder)
    model, task = _model(cfg)
    model.eval()
    batch = next(
        b for s in range(50) if (b := task.document_batch(s, batch_size=3))["doc_start"].sum() > 4
    )
    packed = pack_rows(batch)
    cu = packed["cu_seqlens"].tolist()
    with torch.no_grad():
        logits = forward_batch(model, packed)
        for a, b in zip(cu, cu[1:], strict=False):  # each document alone, from position 0
            alone = model(packed["input"][:, a:b])
            torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-5, atol=1e-5)
        changed = packed["input"].clone()
        changed[:, cu[1] : cu[2]] = (changed[:, cu[1] : cu[2]] + 1) % 256  # the second document
        other = forward_batch(model, {**packed, "input": changed})
    keep = torch.ones(cu[-1], dtype=torch.bool)
    keep[cu[1] : cu[2]] = False
    torch.testing.assert_close(other[:, keep], logits[:, keep], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other[:, cu[1] : cu[2]], logits[:, cu[1] : cu[2]])


# --------------------------------------------------------------------------- eval --stream


def _text_task(tmp_path: Path, n: int, seq_len: int) -> ByteLMTask:
    """A text task whose test split is ``n`` bytes of ``write_text``'s English-like text."""
    raw = write_text(tmp_path / "t.txt", 4 * n).read_bytes()
    x = np.frombuffer(raw, dtype=np.uint8)
    splits = {"train": x[: 2 * n], "val": x[2 * n : 3 * n], "test": x[3 * n : 4 * n]}
    return ByteLMTask("text", splits, seq_len=seq_len, seed=0, metric="bpb", source="t")


def _lm(mixer: str, positional: str, max_seq_len: int = 8, **options) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256, d_model=16, n_layers=2, n_heads=2, max_seq_len=max_seq_len,
        mixer=mixer, positional=positional, mixer_options=options,
    )  # fmt: skip
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # weights 4x GPT-2's init: logits that depend on the context
        for p in model.parameters():
            p.mul_(4)
    return model


def test_stream_eval_carries_the_state_over_the_whole_split(tmp_path):
    task = _text_task(tmp_path, 101, seq_len=8)
    model = _lm("aft-decay", "none")
    res = evaluate_stream(model, task, "test")
    assert res["stream"] is True and res["context"] == "state carried in chunks of 8"
    assert res["targets"] == 100  # every byte but the first, once
    x = torch.from_numpy(np.asarray(task.splits["test"]).astype(np.int64))[None]
    with torch.no_grad():  # one pass over the 100 positions: what the chunks with state add up to
        whole = _mean_nll(model(x[:, :-1]), x[:, 1:])
    assert res["loss"] == pytest.approx(whole, rel=1e-5)
    assert res["bpb"] == pytest.approx(res["loss"] / math.log(2))
    windowed = evaluate(model, task, "test", batch_size=4)
    assert windowed["targets"] == 100 and abs(windowed["loss"] - res["loss"]) > 1e-3


def test_stream_eval_equals_the_windowed_eval_when_one_window_covers_the_split(tmp_path):
    task = _text_task(tmp_path, 9, seq_len=8)  # test split: seq_len + 1 bytes
    for model in (_lm("aft-decay", "none"), _lm("aft-conv", "sinusoidal")):
        res = evaluate_stream(model, task, "test")
        windowed = evaluate(model, task, "test", batch_size=2)
        assert res["targets"] == windowed["targets"] == 8
        assert res["loss"] == pytest.approx(windowed["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "mixer, positional, why",
    [
        ("attention", "learned", "the learned positional table limits it to max_seq_len = 8"),
        ("attention", "rotary", "the state of 'attention' grows with every token"),
        ("aft-local", "none", "aft-local limits it to max_seq_len = 8"),
    ],
)
def test_a_model_without_a_fixed_size_state_reads_sliding_windows(tmp_path, mixer, positional, why):
    task = _text_task(tmp_path, 61, seq_len=8)
    model = _lm(mixer, positional)
    assert why in stream_refusal(model)
    res = evaluate_stream(model, task, "test", batch_size=3)
    why = stream_refusal(model)
    assert res["context"] == f"sliding window of max_seq_len = 8, stride 4 ({why})"
    assert res["targets"] == 60
    # stride = max_seq_len: independent windows, the windowed evaluation exactly
    flat = evaluate_stream(model, task, "test", stride=8, batch_size=5)
    windowed = evaluate(model, task, "test", batch_size=2)
    assert flat["targets"] == 60 and flat["loss"] == pytest.approx(windowed["loss"], rel=1e-6)
    # stride 3: window ends 8, 11, ..., 59, 60; each scores its new bytes with 8 bytes of input
    x = torch.from_numpy(np.asarray(task.splits["test"]).astype(np.int64))
    total, ends = 0.0, [8, *range(11, 60, 3), 60]
    with torch.no_grad():
        for i, e in enumerate(ends):
            logits = model(x[None, e - 8 : e])[0]
            new = 8 if i == 0 else e - ends[i - 1]
            total += float(F.cross_entropy(logits[-new:], x[e + 1 - new : e + 1], reduction="sum"))
    res3 = evaluate_stream(model, task, "test", stride=3, batch_size=4)
    assert res3["targets"] == 60 and res3["loss"] == pytest.approx(total / 60, rel=1e-6)
    with pytest.raises(ValueError, match=r"'stride' must be in \[1, 8\], got 9"):
        evaluate_stream(model, task, "test", stride=9)
