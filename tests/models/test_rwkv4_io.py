"""Loading and saving RWKV-4: Hugging Face folders (aftlab's and transformers' own: safetensors,
sharded, pytorch_model.bin), BlinkDL ``.pth`` files, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aftlab.models import RWKV4LM, RWKV4Config
from aftlab.models.rwkv4_io import blinkdl_to_hf, hf_names

from .rwkv4_helpers import (
    V,
    assert_float32_close,
    blinkdl_name,
    random_hf,
    random_lm,
    to_blinkdl,
)

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers", reason="the test extra (transformers)")


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (3, 11))


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return getattr(out, "logits", out)


def _same_weights(a: RWKV4LM, b: RWKV4LM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sa.items():
        assert t.dtype == sb[name].dtype and torch.equal(t, sb[name]), name


# --------------------------------------------------------------------------- aftlab's folders
def test_save_pretrained_loads_in_transformers(tmp_path):
    lm = random_lm(7)
    lm.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.RwkvForCausalLM.from_pretrained(tmp_path).eval()
    cfg = hf.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (
        99, 32, 7, 37)  # fmt: skip
    assert cfg.rescale_every == 6 and cfg.tie_word_embeddings is False
    idx = _ids()
    assert_float32_close("transformers' logits", _logits(hf, idx), _logits(lm, idx))


def test_from_pretrained_round_trip(tmp_path):
    lm = random_lm(7, layer_norm_eps=1e-6, rescale_every=3, max_seq_len=77)
    lm.save_pretrained(tmp_path)
    again = RWKV4LM.from_pretrained(tmp_path)
    assert again.config == lm.config and not again.training
    _same_weights(again, lm)
    idx = _ids()
    assert torch.equal(_logits(again, idx), _logits(lm, idx))


def test_tied_embeddings_round_trip(tmp_path):
    lm = random_lm(2, tie_embeddings=True)
    assert lm.head.weight is lm.embeddings.weight
    lm.save_pretrained(tmp_path)
    again = RWKV4LM.from_pretrained(tmp_path)
    assert again.config.tie_embeddings and again.head.weight is again.embeddings.weight
    _same_weights(again, lm)
    hf = transformers.RwkvForCausalLM.from_pretrained(tmp_path).eval()
    idx = _ids()
    assert_float32_close("transformers' logits", _logits(hf, idx), _logits(lm, idx))


def test_save_pretrained_refuses_a_used_path(tmp_path):
    (tmp_path / "x.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty; choose a new folder"):
        random_lm(2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a file; choose a new folder"):
        random_lm(2).save_pretrained(tmp_path / "x.txt")
    assert (tmp_path / "x.txt").read_text() == "mine"


# --------------------------------------------------------------------------- transformers' folders
# transformers' save_pretrained runs before any eval forward: RwkvForCausalLM rescales its
# weights in place at its first eval forward and save_pretrained then writes them rescaled
# (transformers 5.24: its own from_pretrained of such a folder is off by 0.6 in the logits)
def test_loads_transformers_save_pretrained(tmp_path):
    hf = random_hf(7)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    lm = RWKV4LM.from_pretrained(tmp_path)
    assert lm.config == RWKV4Config(vocab_size=99, d_model=32, n_layers=7, d_ff=37,
                                    max_seq_len=64)  # fmt: skip
    idx = _ids()
    assert_float32_close("logits", _logits(lm, idx), _logits(hf, idx))



def test_from_hf_saves_a_rescaled_model_at_its_trained_scale(tmp_path):
    hf = random_hf(7)
    idx = _ids()
    want = _logits(hf, idx)  # this eval forward divided HF's weights in place
    assert hf.rwkv.layers_are_rescaled
    RWKV4LM.from_hf(hf).save_pretrained(tmp_path)
    again = transformers.RwkvForCausalLM.from_pretrained(tmp_path).eval()
    assert_float32_close("logits", _logits(again, idx), want)

def test_loads_a_sharded_folder(tmp_path):
    hf = random_hf(7)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    idx = _ids()
    assert_float32_close("logits", _logits(RWKV4LM.from_pretrained(tmp_path), idx),
                         _logits(hf, idx))  # fmt: skip


def test_loads_a_pytorch_model_bin_folder(tmp_path):
    hf = random_hf(2)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    idx = _ids()
    assert_float32_close("logits", _logits(RWKV4LM.from_pretrained(tmp_path), idx),
                         _logits(hf, idx))  # fmt: skip


# --------------------------------------------------------------------------- BlinkDL .pth
def test_blinkdl_names_invert():
    for name in hf_names(3).values():
        assert blinkdl_to_hf(blinkdl_name(name)) == name


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_loads_a_blinkdl_pth(tmp_path, zipfile):
    hf = random_hf(7)
    blink = to_blinkdl(hf.state_dict())
    assert blink["blocks.3.att.time_mix_k"].shape == (1, 1, 32)
    assert {"emb.weight", "blocks.0.ln0.weight", "blocks.6.ffn.time_mix_r", "head.weight",
            "ln_out.bias", "blocks.2.att.time_decay"} <= set(blink)  # fmt: skip
    path = tmp_path / "RWKV-4-tiny.pth"
    torch.save(blink, path, _use_new_zipfile_serialization=zipfile)
    lm = RWKV4LM.from_pretrained(path)
    # the shape read off the tensors; the released models' context and rescaling
    assert lm.config == RWKV4Config(vocab_size=99, d_model=32, n_layers=7, d_ff=37,
                                    max_seq_len=1024, rescale_every=6)  # fmt: skip
    # the raw time_decay is read as it is (w = exp(time_decay), as both write it)
    assert torch.equal(lm.blocks[2].att.time_decay, blink["blocks.2.att.time_decay"])
    idx = _ids()
    assert_float32_close("logits", _logits(lm, idx), _logits(hf, idx))


class _Payload:
    """Unpickled, it opens (creates) ``marker``: a pickle that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_that_runs_code_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    tensors = to_blinkdl(random_hf(2).state_dict())
    torch.save({**tensors, "payload": _Payload(marker)}, path)
    with pytest.raises(ValueError) as e:
        RWKV4LM.from_pretrained(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    assert "not a weights-only checkpoint, refused without running it" in msg
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: an unrestricted load runs it
    assert marker.exists()


def test_a_pth_of_something_else(tmp_path):
    path = tmp_path / "x.pth"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(ValueError, match="expected a dict of tensors"):
        RWKV4LM.from_pretrained(path)
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="no tensor 'rwkv.embeddings.weight': not an RWKV-4"):
        RWKV4LM.from_pretrained(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a weights-only checkpoint"):
        RWKV4LM.from_pretrained(path)


# --------------------------------------------------------------------------- bad folders
@pytest.fixture
def folder(tmp_path) -> Path:
    """aftlab's folder of a 2-block model."""
    random_lm(2).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_a_missing_tensor_names_itself(folder):
    _edit_weights(folder, lambda t: t.pop("rwkv.blocks.1.attention.time_first"))
    with pytest.raises(ValueError, match=r"missing tensor 'rwkv.blocks.1.attention.time_first' "
                                         r"\(1 missing\)"):  # fmt: skip
        RWKV4LM.from_pretrained(folder)


def test_an_unexpected_tensor_names_itself(folder):
    _edit_weights(folder, lambda t: t.update({"rwkv.blocks.0.attention.extra": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'rwkv.blocks.0.attention.extra' "
                                         r"\(1 not RWKV-4's\)"):  # fmt: skip
        RWKV4LM.from_pretrained(folder)


def test_a_wrong_shape_names_both_shapes(folder):
    _edit_weights(folder, lambda t: t.update({"rwkv.blocks.1.feed_forward.key.weight":
                                              torch.zeros(128, 33)}))  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor 'rwkv.blocks.1.feed_forward.key.weight' has "
                                         r"shape \(128, 33\), expected \(37, 32\)"):  # fmt: skip
        RWKV4LM.from_pretrained(folder)


def test_an_integer_tensor_is_refused(folder):
    ints = torch.zeros(32, dtype=torch.int64)
    _edit_weights(folder, lambda t: t.update({"rwkv.ln_out.bias": ints}))
    with pytest.raises(ValueError, match="'rwkv.ln_out.bias' is torch.int64, expected a float"):
        RWKV4LM.from_pretrained(folder)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_another_model_type_is_refused(folder):
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(ValueError, match="config.json: 'model_type' must be 'rwkv' .*got 'gpt2'"):
        RWKV4LM.from_pretrained(folder)


def test_config_values_are_checked(folder):
    _edit_config(folder, attention_hidden_size=16)
    with pytest.raises(ValueError, match="'attention_hidden_size' 16 differs from 'hidden_size'"):
        RWKV4LM.from_pretrained(folder)
    _edit_config(folder, attention_hidden_size=None, num_hidden_layers=0)
    with pytest.raises(ValueError, match="config.json: .*'n_layers' must be a positive int"):
        RWKV4LM.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a readable JSON file"):
        RWKV4LM.from_pretrained(folder)


def test_missing_files_and_paths(folder, tmp_path):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights"):
        RWKV4LM.from_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        RWKV4LM.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        RWKV4LM.from_pretrained(tmp_path / "nowhere")


def test_a_damaged_safetensors_file(folder):
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        RWKV4LM.from_pretrained(folder)

