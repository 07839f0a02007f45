"""``aftlab compare --seeds / --lrs / --equal-params`` and ``NAME:KEY=VALUE`` mixer entries."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from aftlab.cli import main
from aftlab.errors import UsageError
from aftlab.train import compare
from aftlab.train.config import TrainConfig

from .helpers import TINY, write_text


def _task(metric: str) -> SimpleNamespace:
    info = {
        "task": "fake",
        "kind": "lm",
        "vocab_size": 32,
        "num_classes": None,
        "seq_len": 16,
        "metric": metric,
        "image_shape": None,
    }
    return SimpleNamespace(**info, name="fake", info=lambda: info)  # a Task's attributes


@pytest.fixture
def fake(monkeypatch):
    """``run_compare`` on a fake task with fake training: ``(val, test)`` per rate and seed."""
    calls = []

    def install(metric, val_by_lr, test_by_lr, *, diverge=()):
        task = _task(metric)
        monkeypatch.setattr(compare, "build_task", lambda cfg: task)
        monkeypatch.setattr(compare, "unigram_baseline", lambda *a, **k: 1.0)

        def train_one(cfg, run_dir):
            calls.append(cfg)
            if cfg.lr in diverge:
                return None
            return {
                "parameters": compare.count_parameters(cfg, task),
                "metric": metric,
                f"val_{metric}": val_by_lr[cfg.lr] + 0.01 * cfg.seed,
                f"test_{metric}": test_by_lr[cfg.lr] + 0.01 * cfg.seed,
                "test_loss": 1.0,
                "train_tokens_per_s": 100.0,
                "peak_memory_bytes": 2**20,
                "device": "cpu",
            }

        def validate(cfg, run_dir):
            raise AssertionError("the summary carries the validation metric")

        monkeypatch.setattr(compare, "_train_one", train_one)
        monkeypatch.setattr(compare, "_validate", validate)
        return calls

    return install


def _base(**kw) -> TrainConfig:
    model = {"d_model": 16, "n_layers": 2, "n_heads": 2}
    return TrainConfig.from_dict({"seq_len": 16, "steps": 3, "device": "cpu", "model": model, **kw})


def _rows(out):
    return {r["mixer"]: r for r in json.loads((out / "results.json").read_text())["rows"]}


@pytest.mark.parametrize(
    "metric, val, test, chosen",
    [
        # bits: lower is better; validation prefers 3e-3, the test split would prefer 1e-3
        ("bpb", {1e-3: 2.0, 3e-3: 1.5}, {1e-3: 1.2345, 3e-3: 3.1415}, 3e-3),
        # accuracy: higher is better; validation prefers 1e-3, test would prefer 3e-3
        ("accuracy", {1e-3: 0.9, 3e-3: 0.5}, {1e-3: 0.2345, 3e-3: 0.8765}, 1e-3),
    ],
)
def test_rate_is_chosen_on_validation_not_test(fake, tmp_path, metric, val, test, chosen):
    calls = fake(metric, val, test)
    out = tmp_path / "cmp"
    compare.run_compare(_base(), ["attention"], out, lrs=[1e-3, 3e-3])
    assert sorted(c.lr for c in calls) == [1e-3, 3e-3]  # every rate trained
    row = _rows(out)["attention"]
    assert row["lr"] == chosen
    assert row["test_metric"] == test[chosen]  # the chosen rate's test value, not the best one
    other = next(lr for lr in test if lr != chosen)
    text = (out / "results.json").read_text() + (out / "results.md").read_text()
    assert repr(test[other]) not in text  # the other rate's test value is reported nowhere
    assert row["val_by_lr"] == {"0.001": val[1e-3], "0.003": val[3e-3]}
    assert "best mean validation" in (out / "results.md").read_text()


def test_min_lr_scales_with_the_rate(fake, tmp_path):
    calls = fake("bpb", {1e-3: 1.0, 4e-3: 1.0}, {1e-3: 1.0, 4e-3: 1.0})
    compare.run_compare(
        _base(lr=2e-3, min_lr=2e-4), ["attention"], tmp_path / "c", lrs=[1e-3, 4e-3]
    )
    assert {c.lr: c.min_lr for c in calls} == pytest.approx({1e-3: 1e-4, 4e-3: 4e-4})


def test_a_diverged_rate_is_not_chosen(fake, tmp_path):
    fake("bpb", {1e-3: 2.0, 1e-1: 0.1}, {1e-3: 2.0, 1e-1: 0.1}, diverge=(1e-1,))
    compare.run_compare(_base(), ["aft-simple"], tmp_path / "c", lrs=[1e-3, 1e-1])
    row = _rows(tmp_path / "c")["aft-simple"]
    assert row["lr"] == 1e-3 and row["val_by_lr"]["0.1"] is None
    with pytest.raises(UsageError, match="diverged at every learning rate"):
        compare.run_compare(_base(), ["aft-simple"], tmp_path / "d", lrs=[1e-1])


def test_seed_statistics_and_table(fake, tmp_path):
    calls = fake("bpb", {2e-3: 1.0}, {2e-3: 2.0})
    out = tmp_path / "cmp"
    table = compare.run_compare(_base(seed=5), ["attention"], out, seeds=3)
    assert sorted(c.seed for c in calls) == [5, 6, 7]
    row = _rows(out)["attention"]
    values = [2.05, 2.06, 2.07]
    assert row["test_metric_values"] == pytest.approx(values)
    assert row["test_metric"] == pytest.approx(2.06)
    assert row["test_metric_std"] == pytest.approx(0.01)  # sample std (n - 1): 0.01
    assert (row["test_metric_min"], row["test_metric_max"]) == pytest.approx((2.05, 2.07))
    assert "| attention | " in table and "2.0600 ± 0.0100" in table and "2.0500–2.0700" in table
    assert "sample standard deviation" in (out / "results.md").read_text()
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].startswith("mixer,parameters,d_ff,lr,") and csv[1].startswith("attention,")


def test_the_regime_line_and_the_decoding_table_follow_the_table(fake, tmp_path):
    fake("bpb", {2e-3: 1.0}, {2e-3: 1.0})
    out = tmp_path / "cmp"
    text = compare.run_compare(
        _base(), ["attention", "aft-decay"], out, decode_positions=[100, 40]
    ).splitlines()
    regime = "The table ranks the models after 3 steps of 16 x 16 = 768 training tokens at context"
    at = next(i for i, line in enumerate(text) if line.startswith(regime))
    assert text[at - 2].startswith("| (unigram baseline) |")
    head = "| mixer | state at 40 | state at 100 | ms/token at 40 | ms/token at 100 |"
    assert text[at + 4] == head
    rows = json.loads((out / "results.json").read_text())["decoding"]
    assert [(r["mixer"], r["position"]) for r in rows] == [
        ("attention", 40), ("attention", 100), ("aft-decay", 40), ("aft-decay", 100)
    ]
    kv = {r["position"]: r["state_bytes"] for r in rows if r["mixer"] == "attention"}
    assert kv == {p: 2 * 2 * 16 * p * 4 for p in (40, 100)}  # k, v x 2 layers x d x P x fp32
    assert all(r["ms_per_token"] > 0 for r in rows)
    md = (out / "results.md").read_text()
    assert regime in md and "| aft-decay | " in md.split("Decoding one sequence")[1]


def test_decode_positions_need_a_language_model_task():
    task = SimpleNamespace(kind="classify", name="digits-classify")
    with pytest.raises(UsageError, match="needs a causal language-model task, got 'digits-"):
        compare.check_decode_positions([8], task)
    assert compare.check_decode_positions([64, 8], _task("bpb")) == [8, 64]


def test_without_decode_positions_no_decoding_is_measured(fake, tmp_path, monkeypatch):
    fake("bpb", {2e-3: 1.0}, {2e-3: 1.0})
    monkeypatch.setattr(compare, "_decoding_rows", lambda plan: pytest.fail("measured"))
    text = compare.run_compare(_base(), ["aft-decay"], tmp_path / "c")
    assert "The table ranks the models" in text and "Decoding" not in text
    assert "decoding" not in json.loads((tmp_path / "c" / "results.json").read_text())


def test_mixer_entries_carry_options(fake, tmp_path):
    calls = fake("bpb", {2e-3: 1.0}, {2e-3: 1.0})
    out = tmp_path / "cmp"
    compare.run_compare(_base(), ["aft-local:window=0", "aft-local:window=8"], out)
    assert [c.mixer_options for c in calls] == [{"window": 0}, {"window": 8}]
    assert set(_rows(out)) == {"aft-local:window=0", "aft-local:window=8", "(unigram baseline)"}


def test_equal_params_lands_within_half_a_d_ff_unit(tmp_path):
    base = _base(data=str(write_text(tmp_path / "d.txt", 4_000)))
    task = compare.build_task(base)
    target = compare.count_parameters(base.replace(mixer="attention"), task)
    d, n = base.model["d_model"], base.model["n_layers"]
    tol = n * (2 * d + 1) / 2  # one d_ff unit: a row of W_1, a column of W_2, a bias of b_1
    far = 0
    for mixer in compare.default_mixers():
        cfg = base.replace(mixer=mixer)
        far += abs(compare.count_parameters(cfg, task) - target) > tol
        matched, count = compare.match_parameters(cfg, task, target)
        assert abs(count - target) <= tol, (mixer, count, target)
        # the meta-device count is the built model's
        from aftlab.train.build import build_model, model_config_for

        model = build_model(model_config_for(matched, task), task.info())
        assert sum(p.numel() for p in model.parameters()) == count
    assert far >= 2  # aft-full/aft-local (position bias) and aft-conv differ before matching


def test_equal_params_reaches_the_runs(fake, tmp_path):
    calls = fake("bpb", {2e-3: 1.0}, {2e-3: 1.0})
    out = tmp_path / "cmp"
    table = compare.run_compare(_base(), ["attention", "aft-full"], out, equal_params=True)
    rows = _rows(out)
    assert calls[0].model["d_ff"] == 64 and calls[1].model["d_ff"] < 64
    assert rows["aft-full"]["d_ff"] == calls[1].model["d_ff"]
    assert abs(rows["aft-full"]["parameters"] - rows["attention"]["parameters"]) <= 2 * (32 + 1) / 2
    assert "| d_ff |" in table


@pytest.mark.slow
def test_seeds_give_different_runs(tmp_path):
    """Two real seeds: two runs that differ, and the spread of their test values."""
    data = write_text(tmp_path / "data.txt", 20_000)
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(data), "--mixers", "aft-simple", "--steps", "3"]
    assert main([*args, "--seeds", "2", "--out", str(out), *TINY, "--set", "lr=1e-2"]) == 0
    row = _rows(out)["aft-simple"]
    tests = [
        json.loads((out / "aft-simple" / f"lr0.01-seed{s}" / "summary.json").read_text())[
            "test_bpb"
        ]
        for s in (0, 1)
    ]
    assert row["test_metric_values"] == tests and tests[0] != tests[1]
    assert row["test_metric_std"] == pytest.approx(abs(tests[0] - tests[1]) / math.sqrt(2))
    runs = [out / "aft-simple" / f"lr0.01-seed{s}" for s in (0, 1)]
    vals = [json.loads((run / "summary.json").read_text())["val_bpb"] for run in runs]
    assert row["val_metric"] == pytest.approx(sum(vals) / 2) and vals[0] != vals[1]
    assert not list(out.rglob("val.json"))  # read from the summaries, no checkpoint reloaded


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--seeds", "0"], "--seeds must be a positive integer"),
        (["--seeds", "two"], "--seeds"),
        (["--lrs", "0"], "--lrs '0': '0' is not a positive finite number"),
        (["--lrs", "1e-3,abc"], "'abc' is not a positive finite number"),
        (["--lrs", "nan"], "not a positive finite number"),
        (["--lrs", ""], "not a positive finite number"),
        (["--lrs", "1e-3,0.001"], "repeats a rate"),
        (["--mixers", "aft-local:window"], "expected NAME or NAME:KEY=VALUE"),
        (["--mixers", "aft-local:window=8,aft-local:window=8"], "names a mixer twice"),
        (["--mixers", "nope"], "unknown mixer 'nope'"),
        (["--mixers", "aft-local:windw=8"], "windw"),
        (["--equal-params", "--set", "model.d_model=4", "--set", "model.n_heads=1"], "no d_ff"),
        (["--decode-positions", "4k"], "must be comma-separated ints, got '4k'"),
        (["--decode-positions", "0"], "--decode-positions must be integers >= 1, got 0"),
        (["--decode-positions", "64,64"], "repeats a position"),
    ],
)
def test_bad_options_one_line_exit_2(tmp_path, capsys, extra, says):
    data = write_text(tmp_path / "data.txt", 20_000)
    out = tmp_path / "cmp"
    base = ["compare", "--data", str(data), "--steps", "2", "--out", str(out), *TINY]
    if extra[0] == "--equal-params":  # aft-full's 2 T r position bias outweighs any d_ff
        base += ["--mixers", "attention,aft-full", "--set", "seq_len=256"]
    try:
        code = main([*base, *extra])
    except SystemExit as e:  # argparse's own errors (one line, see aftlab.cli._Parser)
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aftlab: error:"), err
    assert says in err[0]
    assert not out.exists()  # nothing trained, nothing written


def test_dry_run_checks_everything_and_trains_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    trained = []
    monkeypatch.setattr(compare, "_train_one", lambda *a, **k: trained.append(a))
    argv = ["compare", "--task", "text", "--mixers", "attention,aft-local:window=8", "--lrs",
            "1e-3,2e-3", "--seeds", "2", "--steps", "7", "--out", "cmp", "--dry-run"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line == ("aftlab compare: would train attention, aft-local:window=8 at lr 0.001, "
                    "0.002 with 2 seed(s): 8 run(s) of 7 steps on text, into cmp")
    assert trained == [] and list(tmp_path.iterdir()) == []
    # what a run would refuse before its first step, the dry run refuses too
    assert main([*argv[:4], "aft-local:window=8:no_such_option=1", *argv[5:]]) == 2
    assert "no_such_option" in capsys.readouterr().err
