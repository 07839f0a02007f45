"""aftlab.hf.to_transformers: RWKV4LM as transformers' RwkvForCausalLM, and the folder both read."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")

from aftlab.hf import to_transformers  # noqa: E402
from aftlab.models import RWKV4LM, TransformerConfig, TransformerLM  # noqa: E402
from aftlab.models.rwkv4_io import hf_names  # noqa: E402

from ..models.rwkv4_helpers import V, assert_float32_close, random_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(b: int = 3, t: int = 11) -> torch.Tensor:
    return torch.randint(0, V, (b, t))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_logits_equal(train):
    lm = random_lm(7).train(train)  # eval: rescale_every=6 acts on both sides
    hf = to_transformers(lm)
    assert isinstance(hf, transformers.RwkvForCausalLM) and hf.training is train
    idx = _ids()
    with torch.no_grad():
        assert_float32_close("logits", hf(idx).logits, lm(idx))


def test_weights_are_copied_and_read_back():
    lm = random_lm(2)
    hf = to_transformers(lm)
    theirs = {p.data_ptr() for p in hf.parameters()}
    assert not theirs & {p.data_ptr() for p in lm.parameters()}  # no shared storage
    again = RWKV4LM.from_hf(hf)
    assert again.config == lm.config
    for name, p in lm.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name
    with torch.no_grad():
        lm.head.weight.zero_()
    assert hf.head.weight.abs().sum() > 0


def test_greedy_generate_gives_the_same_tokens():
    lm = random_lm(7)
    hf = to_transformers(lm)
    prompt = _ids(1, 5)  # batch of one: transformers 5.24 mixes the rows of a larger batch
    want = lm.generate(prompt, 10, temperature=0)
    got = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None,
                      pad_token_id=0)  # fmt: skip
    assert torch.equal(got, want)


def test_dtypes_and_tied_embeddings_are_kept(tmp_path):
    random_lm(2, tie_embeddings=True).save_pretrained(tmp_path)
    lm = RWKV4LM.from_pretrained(tmp_path, dtype=torch.bfloat16)  # decays float32
    hf = to_transformers(lm)
    assert hf.head.weight is hf.rwkv.embeddings.weight
    for name, p in lm.named_parameters(remove_duplicate=False):
        theirs = hf.get_parameter(hf_names(2)[name])
        assert theirs.dtype == p.dtype, name
    idx = _ids()
    with torch.no_grad():
        logits = hf(idx).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_the_folder_is_transformers_format(tmp_path):
    lm = random_lm(7)
    lm.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf) is transformers.RwkvForCausalLM
    idx = _ids()
    with torch.no_grad():
        assert_float32_close("logits", hf(idx).logits, lm(idx))


def test_refuses_other_models():
    cfg = TransformerConfig(vocab_size=V, d_model=8, n_layers=1, n_heads=2, max_seq_len=8)
    with pytest.raises(TypeError, match="'model' must be an RWKV4LM, got TransformerLM"):
        to_transformers(TransformerLM(cfg))
