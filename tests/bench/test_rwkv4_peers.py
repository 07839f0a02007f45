"""aftlab.bench.rwkv4_peers (``aftlab bench --suite rwkv4-peers``, benchmarks/rwkv4_peers.py):
the weights' conversion for ChatRWKV, the peers' adapters, the counting of the floors, the long
prefill's fresh process and the suite's options, at tiny shapes (what is timed is not checked)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aftlab.cli import main as aftlab_main
from aftlab.testing import assert_close

# ChatRWKV's model is TorchScript
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")


@pytest.fixture
def bench():
    from aftlab.bench import rwkv4_peers

    return rwkv4_peers


@pytest.fixture
def tiny(bench):
    """7 layers: transformers' ``rescale_every = 6`` halves the hidden state once."""
    return bench.Shape("t", 61, 16, 7, 37)


def _blinkdl_names(layers: int) -> set[str]:
    """The names of a BlinkDL RWKV-4 ``.pth`` (RWKV-LM's ``RWKV``, ChatRWKV's loader)."""
    names = {"emb.weight", "blocks.0.ln0.weight", "blocks.0.ln0.bias", "ln_out.weight",
             "ln_out.bias", "head.weight"}
    att = ["time_decay", "time_first", "time_mix_k", "time_mix_v", "time_mix_r", "key.weight",
           "value.weight", "receptance.weight", "output.weight"]
    ffn = ["time_mix_k", "time_mix_r", "key.weight", "receptance.weight", "value.weight"]
    for i in range(layers):
        names |= {f"blocks.{i}.{ln}.{p}" for ln in ("ln1", "ln2") for p in ("weight", "bias")}
        names |= {f"blocks.{i}.att.{n}" for n in att} | {f"blocks.{i}.ffn.{n}" for n in ffn}
    return names


def test_blinkdl_names_are_rwkv_lms_and_the_tensors_unchanged(bench, tiny):
    sd = bench.hf_weights(bench.hf_model(tiny))
    bd = bench.blinkdl_state_dict(sd)
    assert set(bd) == _blinkdl_names(tiny.layers)
    assert all(a is b for a, b in zip(bd.values(), sd.values(), strict=True))
    assert bd["blocks.2.att.time_mix_r"] is sd["rwkv.blocks.2.attention.time_mix_receptance"]


def test_every_parameter_is_randomised(bench, tiny):
    hf = bench.hf_model(tiny)
    for name, p in hf.named_parameters():
        assert p.unique().numel() == p.numel(), name  # no constant left (time_first: ones)


def test_hf_weights_undo_the_rescaling_of_eval_mode(bench, tiny):
    hf = bench.hf_model(tiny)
    before = bench.hf_weights(hf)
    with torch.inference_mode():
        hf.eval()(torch.zeros(1, 3, dtype=torch.long))  # divides blocks 6.. in place
    assert hf.rwkv.layers_are_rescaled
    name = "rwkv.blocks.6.feed_forward.value.weight"
    assert torch.equal(hf.state_dict()[name] * 2, before[name])
    after = bench.hf_weights(hf)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_chatrwkv_equals_transformers_on_the_same_weights(bench, tiny, tmp_path):
    if not bench.chatrwkv_available():
        pytest.skip("ChatRWKV (PyPI rwkv) not installed")
    hf = bench.hf_model(tiny)
    chat = bench.ChatRWKVPeer(bench.save_blinkdl(hf, tmp_path))
    cfg = bench.hf_config(tiny)
    cfg.rescale_every = 0  # ChatRWKV's float32 (its RESCALE_LAYER is 0 unless fp16)
    ref = bench.HFPeer(bench.hf_from_state(cfg, bench.hf_weights(hf)).eval())
    ids = bench.token_ids(tiny, 23)
    assert_close("all logits", chat.prefill(ids, last_only=False)[0],
                 ref.prefill(ids, last_only=False)[0])
    (got, st), (want, ref_st) = chat.prefill(ids[:20]), ref.prefill(ids[:20])
    assert_close("last logits", got, want)
    for t in ids[20:].tolist():
        (got, st), (want, ref_st) = chat.step(t, st), ref.step(t, ref_st)
        assert_close(f"step {t}", got, want)


def _flags() -> tuple[bool, bool, bool]:
    b = torch.backends
    return b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32


def _set_flags(flags: tuple[bool, bool, bool]) -> None:
    b = torch.backends
    b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = flags


def test_importing_chatrwkv_leaves_the_backend_flags(bench, monkeypatch):
    if not bench.chatrwkv_available():
        pytest.skip("ChatRWKV (PyPI rwkv) not installed")
    monkeypatch.delitem(sys.modules, "rwkv.model")  # imported again; restored after the test
    saved = _flags()
    try:
        _set_flags((False, False, False))  # rwkv/model.py sets each to True
        bench.chatrwkv_class()
        assert "rwkv.model" in sys.modules  # rwkv/model.py ran, and with it its flag settings
        assert _flags() == (False, False, False)
    finally:
        _set_flags(saved)


def test_counting_matches_the_model(bench, tiny):
    hf = bench.hf_model(tiny)
    params = dict(hf.named_parameters())
    assert bench.param_count(tiny) == sum(p.numel() for p in params.values())
    in_blocks = sum(p.numel() for n, p in params.items() if p.ndim == 2 and ".blocks." in n)
    assert bench.matrix_params(tiny) == in_blocks
    no_embedding = sum(p.numel() for n, p in params.items() if "embeddings" not in n)
    assert bench.weight_bytes_per_token(tiny, 2) == 2 * (no_embedding + tiny.d)
    assert sum(2 * r * i * o for r, i, o in bench.block_gemms(tiny, 9)) * tiny.layers == (
        bench.prefill_flops(tiny, 9, logits=0)
    )


def test_flops_are_the_matrix_products_torch_counts(bench, tiny):
    hf, ids = bench.hf_model(tiny), bench.token_ids(tiny, 11)
    with FlopCounterMode(display=False) as prefill, torch.inference_mode():
        bench.HFPeer(hf.eval()).prefill(ids)
    assert prefill.get_total_flops() == bench.prefill_flops(tiny, 11)
    train = bench.hf_model(tiny).train()
    with FlopCounterMode(display=False) as step:
        bench.HFPeer(train).loss(ids.view(1, 11)).backward()
    assert step.get_total_flops() == bench.train_flops(tiny, 1, 11)


def test_prefill_and_decode_rows_name_every_peer(bench, tiny, tmp_path):
    peers = bench.build_peers(bench.hf_model(tiny), tmp_path)
    plan = bench.QUICK._replace(prefill=12, prompt=4, warmup_steps=1)
    rows = bench.prefill_rows(tiny, peers, plan, 1, rate=1e9)
    assert [r["what"] for r in rows] == ["prefill 12 tokens, last logits",
                                         "prefill 12 tokens, all logits"]
    assert set(rows[0]["peers"]) == set(peers) and rows[0]["floor"] == (
        bench.prefill_flops(tiny, 12) / 1e9
    )
    for name, (_, rel) in rows[0]["max_diff_vs_transformers"].items():
        assert rel < 1e-4, name  # rescale_every = 6 moves transformers by its LayerNorm eps
    dec = bench.decode_row(tiny, peers, plan, 3, bw=1e9)
    assert set(dec["peers"]) == set(peers) and all(v > 0 for v in dec["peers"].values())
    assert dec["floor"] == 1e3 * bench.weight_bytes_per_token(tiny, 4) / 1e9
    assert "| decode, ms/token | t | ms |" in bench.table([dec])


@pytest.mark.slow  # a fresh process imports transformers
def test_the_long_prefill_in_a_fresh_process_equals_one_prefill(bench, tmp_path):
    s = bench.SHAPES["tiny"]
    hf = bench.hf_model(s, context=40)
    plan = bench.QUICK._replace(long=40, chunk=16)
    rows = bench.long_rows(s, ["transformers"], hf, plan, 1, 1e9, tmp_path)
    seconds, loaded, peak, _ = (r["peers"]["transformers"] for r in rows)
    assert seconds > 0 and loaded > 0
    if rows[2]["peak_reset"]["transformers"]:
        assert peak >= loaded
    chunked = torch.load(tmp_path / "transformers.logits.pt", weights_only=True)
    whole, _ = bench.HFPeer(hf.eval()).prefill(bench.token_ids(s, 40, seed=3))
    assert_close("last logits", chunked, whole)


def test_aftlab_model_is_none_without_aftlab_rwkv4(bench, tiny):
    hf = bench.hf_model(tiny)
    ours = bench.aftlab_model(hf)
    if not bench.aftlab_available():
        assert ours is None
        return
    ids = bench.token_ids(tiny, 9)
    cfg = bench.hf_config(tiny)
    cfg.rescale_every = 0
    want = bench.HFPeer(bench.hf_from_state(cfg, bench.hf_weights(hf)).eval()).prefill(ids)[0]
    assert_close("aftlab's last logits", bench.AftlabPeer(ours.eval()).prefill(ids)[0], want)


def test_bad_options_exit_2_naming_them(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shapes", "169m,7b"])
    assert e.value.code == 2
    assert "--shapes: expected names of 169m, 430m, 1b5, tiny, got 7b" in capsys.readouterr().err


def test_the_script_in_benchmarks_is_the_module(benchmark_script, bench):
    assert benchmark_script("rwkv4_peers").main is bench.main


@pytest.mark.slow  # the peers at the tiny shape, timed once each
def test_aftlab_bench_runs_the_suite_into_out(tmp_path, capsys):
    argv = ["bench", "--suite", "rwkv4-peers", "--shapes", "tiny", "--parts", "prefill,decode",
            "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]
    assert aftlab_main(argv) == 0
    result = json.loads((tmp_path / "rwkv4-peers.json").read_text())
    assert [r["what"] for r in result["rows"]] == [
        "prefill 64 tokens, last logits", "prefill 64 tokens, all logits", "decode, ms/token"]
    decode = result["rows"][-1]["peers"]
    assert "aftlab" in decode and all(v > 0 for v in decode.values())
    assert result["config"]["suite"] == "rwkv4-peers" and result["machine"]["threads"] == 1
    table = (tmp_path / "rwkv4-peers.md").read_text()
    assert "| decode, ms/token | tiny | ms |" in table and table in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--shapes", "169m,7b"], "--shapes: expected names of 169m, 430m, 1b5, tiny, got 7b"),
        (["--shapes", "tiny,169m"], "--shapes: expected 'tiny' (the smoke test) alone"),
        (["--parts", "decode,nope"], "--parts: expected names of train, prefill"),
        (["--dtype", "bfloat16"], "--dtype must be float32 with --suite rwkv4-peers"),
        (["--device", "cuda"], "--device must be"),
    ],
)
def test_the_suite_refuses_bad_options_in_one_line(argv, expected, capsys):
    code = aftlab_main(["bench", "--suite", "rwkv4-peers", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err, err


def test_an_unknown_suite_is_refused(capsys):
    assert aftlab_main(["bench", "--suite", "models"]) == 2
    err = capsys.readouterr().err
    assert "--suite must be one of ['mixers', 'rwkv4-peers'], got 'models'" in err
