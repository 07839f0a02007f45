"""The decoding-state sizes of ``aftlab bench``: read from the states, equal to a real state's
bytes, attention's growing with T and the others' not, in the report and on their own."""

from __future__ import annotations

import json

import pytest
import torch

from aftlab._state import state_bytes
from aftlab._system import format_bytes as size
from aftlab.bench import BenchConfig, Shape, cases, run_bench
from aftlab.bench.cases import MATMUL, decoding_mixer
from aftlab.bench.measure import tensor_bytes
from aftlab.bench.report import state_table
from aftlab.bench.states import state_sizes
from aftlab.cli import main as aftlab_main
from aftlab.mixers import registry
from aftlab.mixers.base import SequenceMixer

pytestmark = pytest.mark.usefixtures("one_thread")

D, H = 16, 4
DECODING = [n for n, op in cases().items() if op is not MATMUL]


def _sizes(mixers, tokens, dtype=torch.float32):
    esize = torch.empty((), dtype=dtype).element_size()
    rows = state_sizes(cases(), mixers, tokens, Shape(1, 1, D, H, esize), dtype)
    return {(r["mixer"], r["T"]): r for r in rows}


@pytest.mark.parametrize("name", DECODING)
def test_sizes_equal_the_bytes_of_a_prefilled_state(name):
    """At T = 64 (a KV cache's capacity is exactly T) the size read on the meta device is what a
    real prompt of T tokens leaves on the CPU, for every mixer the bench decodes."""
    T = 64
    m = decoding_mixer(name, cases()[name], Shape(1, T, D, H)).eval()
    with torch.no_grad():
        _, state = m.prefill(torch.randn(1, T, D))
    row = _sizes([name], [T])[name, T]
    assert row["note"] == "" and row["state_bytes"] == tensor_bytes(state) > 0


def test_attention_grows_with_T_and_the_aft_states_do_not():
    tokens = [4096, 2**20]
    got = _sizes(["attention", "aft-simple", "aft-decay", "aft-local", "aft-full"], tokens)
    for T in tokens:
        assert got["attention", T]["state_bytes"] == 2 * T * D * 4  # k and v of every token
        assert got["aft-full", T]["state_bytes"] == 2 * T * D * 4  # its T_max = T keys, values
        for name in ("aft-simple", "aft-decay"):  # the running sums (p, a, b)
            assert got[name, T]["state_bytes"] == 3 * D * 4
    window = cases()["aft-local"].options["window"]
    local = got["aft-local", 4096]["state_bytes"]
    assert local == got["aft-local", 2**20]["state_bytes"]
    assert 2 * (window - 1) * D * 4 <= local <= 2 * window * D * 4 + 3 * D * 4 + window


def test_sizes_follow_the_state_dtypes_not_the_inputs():
    """bfloat16 inputs: attention caches bfloat16 keys, the AFT running sums stay float32."""
    got = _sizes(["attention", "aft-simple"], [4096], torch.bfloat16)
    assert got["attention", 4096]["state_bytes"] == 2 * 4096 * D * 2
    assert got["aft-simple", 4096]["state_bytes"] == 3 * D * 4


def test_state_bytes_walks_nested_states_and_grows_only_marked_dims():
    from aftlab.mixers.attention import KVCache
    from aftlab.ops.state import RunningSums

    kv = KVCache(torch.zeros(1, 2, 16, 3, device="meta"), torch.zeros(1, 2, 16, 3))
    assert state_bytes(kv, 100) == 2 * 2 * 100 * 3 * 4
    sums = RunningSums.empty(1, 5, device="meta", dtype=torch.float64)
    assert state_bytes([sums, (sums,)], 100) == 2 * state_bytes(sums, 7) > 0


def test_a_mixer_without_decoding_gets_a_note(monkeypatch):
    class NoDecoding(SequenceMixer):
        def _forward(self, x, padding_mask):
            return x

    monkeypatch.setitem(registry._MIXERS, "no-decoding", NoDecoding)
    row = _sizes(["no-decoding"], [16])["no-decoding", 16]
    assert row["state_bytes"] is None and "no decoding state" in row["note"]
    assert row["note"] in "\n".join(state_table([row], D, H, "float32"))


def test_table_puts_the_kv_cache_first_with_fractions():
    rows = list(_sizes(["aft-simple", "attention"], [4096]).values())
    lines = state_table(rows, D, H, "float32")
    assert lines[0].startswith("## Decoding state per layer")
    body = [line for line in lines if line.startswith("| a")]
    assert body[0] == f"| attention (KV cache) | {size(2 * 4096 * D * 4)} |"
    assert body[1] == "| aft-simple | 192 B (1/2,731) |"  # 524,288 / 192 = 2,730.7
    assert size(3 * 2**30) == "3 GiB" and size(1536) == "1.5 KiB" and size(0) == "0 B"


def test_state_sizes_only_times_nothing(capsys):
    cfg = BenchConfig(mixers=["attention", "aft-local"], dim=D, heads=H, state_sizes_only=True)
    lines = []
    result = run_bench(cfg, argv=["aftlab", "bench"], log=lines.append)
    assert result["results"] == [] and "limits" not in result
    assert {r["T"] for r in result["state_sizes"]} == {4096, 65536, 2**20}
    assert any(line.startswith("| aft-local | ") for line in lines)
    assert aftlab_main(["bench", "--state-sizes-only", "--state-tokens", "8,16", "--dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "| T=8 | T=16 |" in out and "| attention (KV cache) | 512 B | 1 KiB |" in out


def test_report_holds_the_state_table(tmp_path):
    cfg = BenchConfig(
        mixers=["attention", "aft-simple"], lengths=[16], modes=["forward"], batch=1, dim=D,
        heads=H, repeats=1, limits_size="tiny", isolate=False, out=tmp_path,
        state_tokens=[32],
    )  # fmt: skip
    run_bench(cfg, argv=["aftlab", "bench"], log=None)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Decoding state per layer" in summary and "| aft-simple | 192 B (1/21) |" in summary
    data = json.loads((tmp_path / "results.json").read_text())
    assert {(r["mixer"], r["state_bytes"]) for r in data["state_sizes"]} == {
        ("attention", 2 * 32 * D * 4),
        ("aft-simple", 3 * D * 4),
    }


def test_bad_state_tokens_exit_2(capsys):
    assert aftlab_main(["bench", "--state-sizes-only", "--state-tokens", "0"]) == 2
    assert "--state-tokens" in capsys.readouterr().err
