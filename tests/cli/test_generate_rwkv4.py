"""``aftlab generate`` on an RWKV-4 model: a tiny random transformers folder with a BPE
tokenizer trained here (nothing downloaded), and a BlinkDL ``.pth``; the same text as
transformers' own ``pipeline("text-generation")``."""

from __future__ import annotations

import pytest
import torch

from aftlab.cli import main

from ..models.rwkv4_helpers import random_hf, to_blinkdl

tokenizers = pytest.importorskip("tokenizers", reason="the hf extra (tokenizers)")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers)")

CORPUS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 20
PROMPT = "the quick"


def _bpe(vocab_size: int) -> tokenizers.Tokenizer:
    """A BPE of at most ``vocab_size`` ids trained on :data:`CORPUS`."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=["[UNK]"]))
    assert tok.get_vocab_size() <= vocab_size
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A transformers RWKV-4 folder (random weights, vocab 99) with its own tokenizer.json."""
    out = tmp_path_factory.mktemp("rwkv4") / "hf"
    hf = random_hf(2)
    hf.save_pretrained(out)  # before any eval forward: the weights at their trained scale
    tok = _bpe(hf.config.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    return out


def _generate(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["generate", *argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert printed.err.startswith("prefill: ")
    return printed.out


def test_a_transformers_rwkv4_folder_prints_the_pipelines_greedy_text(folder, capsys):
    argv = ["--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0"]
    out = _generate(capsys, str(folder), *argv)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    pipe = transformers.pipeline(
        "text-generation", model=str(folder), tokenizer=tok, device="cpu"
    )
    expected = pipe(PROMPT, max_new_tokens=12, do_sample=False, return_full_text=True)
    ids = tok(PROMPT)["input_ids"]
    # the text of the prompt's ids and the 12 new ones, decoded once (the command's output)
    from aftlab.models import RWKV4LM

    lm = RWKV4LM.from_pretrained(folder)
    new = lm.generate(torch.tensor([ids]), 12, temperature=0)[0].tolist()
    assert out == tok.decode(new) + "\n"
    assert out.strip() == expected[0]["generated_text"].strip()


def test_a_blinkdl_pth_with_tokenizer(folder, tmp_path, capsys):
    from aftlab.models import RWKV4LM
    from aftlab.models.rwkv4_io import hf_state_dict

    pth = tmp_path / "model.pth"
    torch.save(to_blinkdl(hf_state_dict(RWKV4LM.from_pretrained(folder))), pth)
    argv = ["--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0"]
    out = _generate(capsys, str(pth), "--tokenizer", str(folder / "tokenizer.json"), *argv)
    assert out == _generate(capsys, str(folder), *argv)
