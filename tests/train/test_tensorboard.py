"""``--log tensorboard``: the scalars of metrics.jsonl, read back with TensorBoard's own reader."""

import json
import shutil
import sys

import pytest

from aftlab.cli import main
from aftlab.train.trainer import Trainer

from .helpers import TINY, write_text
from .test_trainer import _config

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

#: What TensorBoard must show: loss, validation, learning rate, tokens/s, memory.
REQUIRED = {
    "train/loss",
    "train/lr",
    "train/tokens_per_s",
    "train/peak_memory_bytes",
    "val/loss",
    "val/bpb",
}


def _jsonl_scalars(run_dir):
    """``{"<split>/<key>": [(step, value, time), ...]}`` of every number in metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        for key, value in r.items():
            if key not in ("step", "time", "split"):
                out.setdefault(f"{r['split']}/{key}", []).append((r["step"], value, r["time"]))
    return out


def _tb_scalars(run_dir):
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def _assert_same(run_dir):
    jsonl, tb = _jsonl_scalars(run_dir), _tb_scalars(run_dir)
    assert REQUIRED <= set(jsonl)
    assert set(tb) == set(jsonl)
    for tag, expected in jsonl.items():
        got = tb[tag]
        assert [s for s, _, _ in got] == [s for s, _, _ in expected], tag
        for (_, v, t), (_, v0, t0) in zip(got, expected, strict=True):
            assert v == pytest.approx(v0, rel=1e-6), tag  # TensorBoard stores float32
            assert t == pytest.approx(t0, abs=1e-3), tag


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tmp_path):
    cfg = _config(tmp_path, "steps=6", "eval_interval=2", "log='tensorboard'")
    Trainer(cfg, run_dir=tmp_path / "run").fit()
    _assert_same(tmp_path / "run")


def test_a_resumed_run_drops_the_events_after_its_checkpoint(tmp_path):
    """As metrics.jsonl drops its lines after the checkpoint, TensorBoard hides those events:
    here a validation point at step 4 that the resumed session (evaluating at 5) never rewrites.
    """
    run = tmp_path / "run"
    common = ["checkpoint_interval=2", "keep_last=5", "log='tensorboard'"]
    Trainer(_config(tmp_path, "steps=6", "eval_interval=2", *common), run_dir=run).fit()
    for step in (4, 6):  # as if killed after step 4 and before its checkpoint was saved
        shutil.rmtree(run / "checkpoints" / f"step_{step:08d}")
    cfg = _config(tmp_path, "steps=6", "eval_interval=5", *common, f"out={json.dumps(str(run))}")
    Trainer(cfg, run_dir=run, resume=True).fit()
    assert [s for s, _, _ in _tb_scalars(run)["val/loss"]] == [2, 5]
    _assert_same(run)


def test_without_tensorboard_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    data = write_text(tmp_path / "data.txt")
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(data), "--steps", "2", "--out", str(out)]
    assert main([*argv, "--log", "tensorboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'aftlab[tensorboard]'" in err[0], err
    assert not out.exists()
