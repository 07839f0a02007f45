"""benchmarks/streaming.py: streaming through the cache, and its report lines."""

from __future__ import annotations

import subprocess
import sys

import torch

from aftlab.testing import assert_close

from .scripts import BENCHMARKS


def test_stream_carries_the_cache_like_one_prefill(benchmark_script):
    bench = benchmark_script("streaming")
    model = bench._model("aft-decay", 2, 16, 8)  # chunks of 8 = max_seq_len, 37 tokens
    logits, cache = bench.stream(model, 37, 8)
    ids = torch.cat(list(bench.chunks(37, 8)), 1)
    assert ids.shape == (1, 37) and cache.position == 37
    with torch.inference_mode():
        whole, whole_cache = model.prefill(ids, logits_to_keep=1)  # not length-limited
    assert_close("last logits", logits, whole, atol=1e-5, rtol=1e-5)
    for got, want in zip(cache.states, whole_cache.states, strict=True):
        assert_close("log-sum", got.log_sum(), want.log_sum(), atol=1e-5, rtol=1e-5)


def test_rss_reports_each_length_and_the_ratio():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "streaming.py"), "rss", "--tokens", "64,256",
         "--chunk", "32", "--threads", "1"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    lines = out.strip().splitlines()
    assert "peak RSS" in lines[1] and "peak RSS" in lines[2]
    ratio = float(lines[3].split("ratio 256 / 64 tokens:")[1].split()[0])
    assert 0.5 < ratio < 2.0


def test_chunked_line_times_both(benchmark_script):
    line = benchmark_script("streaming")._chunked_line("aft-simple", 32, 8, 1)
    assert line.split()[0] == "aft-simple" and line.count("ratio") == 2
