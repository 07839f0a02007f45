"""aftlab.hf: Auto* registration, generate with aftlab's decoding state, save/load, export."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")

from aftlab.cli import main  # noqa: E402
from aftlab.hf import AftlabConfig, AftlabForCausalLM  # noqa: E402
from aftlab.mixers import SequenceMixer  # noqa: E402
from aftlab.mixers.registry import available_mixers, get_mixer_class  # noqa: E402
from aftlab.models import TransformerConfig, TransformerLM  # noqa: E402

from ..train.helpers import TINY, write_text  # noqa: E402

V = 31
# every mixer with a decoding state (the _init_state/_step hooks): the causal ones
CAUSAL = [
    m for m in available_mixers() if get_mixer_class(m)._init_state is not SequenceMixer._init_state
]
OPTIONS = {"aft-local": {"window": 3}, "aft-conv": {"kernel_size": 3}}  # smaller than T


def test_every_decoding_mixer_is_tested():
    # the parametrisations below must not go empty (and silently skip) if the hooks move again
    assert {"attention", "aft-full", "aft-local", "aft-simple", "aft-conv", "aft-decay"} <= set(
        CAUSAL
    )


def _model(mixer: str = "attention", **kw) -> AftlabForCausalLM:
    cfg = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_seq_len=24, mixer=mixer)
    cfg["mixer_options"] = OPTIONS.get(mixer, {})
    return AftlabForCausalLM(AftlabConfig(**{**cfg, **kw})).eval()


def test_config_maps_every_transformer_config_field():
    tc = TransformerConfig(
        vocab_size=40, d_model=24, n_layers=3, n_heads=3, d_ff=50, max_seq_len=33,
        mixer="aft-local", mixer_options={"window": 5}, norm="post", activation="relu",
        positional="sinusoidal", dropout=0.1, bias=False, tie_embeddings=False,
        layer_norm_eps=1e-6, final_norm=False,
    )  # fmt: skip
    cfg = AftlabConfig.from_transformer_config(tc)
    assert cfg.to_transformer_config() == tc
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (24, 3, 3)
    assert cfg.tie_word_embeddings is False
    again = AftlabConfig.from_dict(cfg.to_dict())
    assert again.to_transformer_config() == tc


def test_config_rejects_bad_values_and_encoders():
    with pytest.raises(ValueError, match="'norm' must be one of"):
        AftlabConfig(norm="middle")
    with pytest.raises(ValueError, match="causal=True"):
        AftlabConfig.from_transformer_config(TransformerConfig(causal=False))


def test_auto_classes_resolve_offline(tmp_path):
    model = _model("aft-simple")
    model.save_pretrained(tmp_path)
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), AftlabConfig)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is AftlabForCausalLM
    assert isinstance(
        transformers.AutoModelForCausalLM.from_config(model.config), AftlabForCausalLM
    )


def test_forward_matches_transformer_lm_and_loss():
    model = _model("aft-full")
    ids = torch.randint(0, V, (2, 7))
    expected = model.model(ids)
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0)
    ce = torch.nn.functional.cross_entropy(expected[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ce)
    # padding honoured without a state; refused with one
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, -2:] = 0
    padded = model(ids, attention_mask=mask)
    assert padded.cache is None
    torch.testing.assert_close(padded.logits, model.model(ids, padding_mask=mask.bool()))
    with pytest.raises(ValueError, match="'attention_mask' has padding"):
        model(ids, attention_mask=mask, use_cache=True)


@pytest.mark.parametrize("mixer", CAUSAL)
def test_cache_continues_the_sequence(mixer):
    """Prefill 5 tokens, feed 2 more through the returned state: the full forward's logits."""
    model = _model(mixer)
    ids = torch.randint(0, V, (2, 7))
    full = model(ids, use_cache=False).logits
    first = model(ids[:, :5], use_cache=True)
    torch.testing.assert_close(first.logits, full[:, :5])
    nxt = model(ids[:, 5:], cache=first.cache)
    assert nxt.cache is first.cache and nxt.cache.position == 7
    torch.testing.assert_close(nxt.logits, full[:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", CAUSAL)
def test_greedy_generate_equals_aftlab_generate(mixer):
    model = _model(mixer)
    prompt = torch.randint(0, V, (3, 5))
    ours = model.model.generate(prompt, 9, temperature=0)
    theirs = model.generate(prompt, max_new_tokens=9, do_sample=False)
    assert torch.equal(theirs, ours)


def test_generate_prefills_once_then_steps(monkeypatch):
    """The state is carried: one prefill pass, then one step per new token, never a re-run."""
    model = _model("aft-decay")
    calls = {"prefill": 0, "step": 0, "forward": 0}
    bb, lm = model.model.backbone, model.model
    for obj, name in ((bb, "prefill_embeddings"), (lm, "step"), (lm, "forward")):
        original = getattr(obj, name)

        def counted(*a, _orig=original, _name=name, **k):
            calls[_name.split("_")[0]] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(obj, name, counted)
    model.generate(torch.randint(0, V, (2, 4)), max_new_tokens=6, do_sample=False)
    assert calls == {"prefill": 1, "step": 5, "forward": 0}


def test_sampling_is_seeded_and_respects_max_new_tokens():
    model = _model("aft-local")
    prompt = torch.randint(0, V, (2, 4))
    kw = dict(do_sample=True, temperature=0.8, top_k=7, top_p=0.9, max_new_tokens=6)
    torch.manual_seed(3)
    a = model.generate(prompt, **kw)
    torch.manual_seed(3)
    b = model.generate(prompt, **kw)
    assert a.shape == (2, 10) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    assert ((a >= 0) & (a < V)).all()
    draws = set()
    for seed in range(4):
        torch.manual_seed(seed)
        draws.add(tuple(model.generate(prompt, **{**kw, "top_k": None, "top_p": 1.0})[0].tolist()))
    assert len(draws) > 1, "sampling gave the same sequence for every seed"
    torch.manual_seed(0)
    top1 = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=1)
    assert torch.equal(top1, model.generate(prompt, max_new_tokens=6, do_sample=False))


def test_generate_refuses_beam_search():
    with pytest.raises(ValueError, match="beam search"):
        _model().generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, num_beams=2)


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_is_safetensors_and_exact(tmp_path, tie):
    model = _model("aft-conv", tie_embeddings=tie, positional="sinusoidal")
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt")) for f in files)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "aftlab"
    loaded = AftlabForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, V, (2, 9))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    head, emb = loaded.model.head.weight, loaded.model.backbone.token_embedding.weight
    assert (head is emb) == tie


def test_export_cli_round_trip(tmp_path, capsys):
    data = write_text(tmp_path / "data.txt")
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(run), "--steps", "3"]
    assert main([*argv, "--mixer", "aft-simple", *TINY]) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out) and printed.err == ""
    from aftlab.train.run import load_run

    trained = load_run(run, load_task=False).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(trained, TransformerLM) and hf.config.mixer == "aft-simple"
    ids = torch.tensor([list(b"the model mixes")])
    assert torch.equal(hf(ids).logits, trained(ids))
    greedy = hf.generate(ids[:, :4], max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, trained.generate(ids[:, :4], 5, temperature=0))
    # OUT_DIR exists now: refused, one line, exit 2, nothing overwritten
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0]
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("case", ["missing", "empty", "file"])
def test_export_bad_run_dir_is_one_line_exit_2(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case == "empty":
        run.mkdir()
    elif case == "file":
        run.write_text("x")
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aftlab: error: ") and str(run) in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("use_cache", [True, False])
def test_bad_input_ids_are_named_as_the_caller_wrote_them(use_cache):
    model = _model("aft-simple")
    with pytest.raises(ValueError, match=r"AftlabForCausalLM: 'input_ids' ids must be in \[0,"):
        model(torch.full((1, 3), V), use_cache=use_cache)
