"""benchmarks/plot_mqar.py: which run of a cell the MQAR table and plot report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def collect(benchmark_script):
    return benchmark_script("plot_mqar").collect


def _table(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    config = {"seq_len": 64, "task_options": {"num_pairs": 4}}
    (folder / "results.json").write_text(json.dumps({"rows": rows, "config": config}))


def _row(mixer: str, val: float, test: float) -> dict:
    return {"mixer": mixer, "val_metric": val, "test_metric": test}


def _summary(folder: Path, mixer: str, test_accuracy: float) -> None:
    (folder / mixer).mkdir(parents=True)
    run = {"mixer": mixer, "metric": "accuracy", "test_accuracy": test_accuracy}
    (folder / mixer / "summary.json").write_text(json.dumps(run))


def test_a_mixer_in_two_folders_of_a_cell_counts_at_its_best_validation_not_test(tmp_path, collect):
    _table(tmp_path / "d64-T64-lr1", [_row("attention", 0.9, 0.8)])
    _table(tmp_path / "d64-T64-lr2", [_row("attention", 0.5, 0.95)])
    assert collect(tmp_path) == {("attention", 64): {64: 0.8}}


def test_a_folder_without_results_json_is_read_from_its_runs_summaries(tmp_path, collect):
    _summary(tmp_path / "d128-T64-b", "aft-local", 0.284)
    _summary(tmp_path / "d128-T64-b", "aft-simple", 0.271)
    assert collect(tmp_path) == {("aft-local", 128): {64: 0.284},
                                              ("aft-simple", 128): {64: 0.271}}


def test_a_summary_without_validation_yields_to_a_run_with_it(tmp_path, collect):
    _summary(tmp_path / "d64-T128-a", "aft-full", 0.99)
    _table(tmp_path / "d64-T128-b", [_row("aft-full", 0.1, 0.14)])
    assert collect(tmp_path) == {("aft-full", 64): {128: 0.14}}


def test_folders_outside_the_grid_are_not_read(tmp_path, collect):
    _table(tmp_path / "probe-d64-T64", [_row("attention", 1.0, 1.0)])
    assert collect(tmp_path) == {}
