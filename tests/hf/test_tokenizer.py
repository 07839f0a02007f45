"""aftlab.hf.tokenizer: the byte tokenizer, and the exported folder's tokenizer in transformers."""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")

from aftlab.cli import main  # noqa: E402
from aftlab.hf.tokenizer import TOKENIZER_FILES, byte_tokenizer, write_byte_tokenizer  # noqa: E402
from aftlab.train.run import load_run  # noqa: E402

from ..train.helpers import TINY, train_tiny  # noqa: E402

TEXTS = ["def main(x):\n\treturn x + 1", "naïve café — 数据 🙂 λ\n", "", "\x00\x7f~ !"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_the_utf8_bytes_and_decode_round_trips(text):
    tok = byte_tokenizer()
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.get_vocab_size() == 256 and sorted(tok.get_vocab().values()) == list(range(256))


def test_decode_of_any_bytes_is_pythons_replacing_decode():
    """What aftlab sample prints for the same ids: invalid or cut UTF-8 becomes U+FFFD alike."""
    tok, rng = byte_tokenizer(), random.Random(0)
    pieces = [0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x99, 0x82, 0xC3, 0xA9, 0x80, 0xFF, 0x41]
    for _ in range(500):
        n = rng.randrange(9)
        ids = [rng.choice([rng.randrange(256), rng.choice(pieces)]) for _ in range(n)]
        assert tok.decode(ids) == bytes(ids).decode("utf-8", "replace"), ids


def test_written_folder_loads_with_auto_tokenizer(tmp_path):
    paths = write_byte_tokenizer(tmp_path)
    assert [p.name for p in paths] == list(TOKENIZER_FILES) and all(p.is_file() for p in paths)
    assert json.loads(paths[1].read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert auto.decode(ids) == text  # no clean-up of spaces before punctuation
    assert auto.decode(list(b" , . ! ?")) == " , . ! ?"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny trained text run and its export (with the byte tokenizer)."""
    root = tmp_path_factory.mktemp("tok")
    run = train_tiny(root, 3)
    out = root / "hf"
    assert main(["export", str(run), str(out)]) == 0
    return run, out


def test_export_of_a_text_run_writes_the_tokenizer(exported):
    _, out = exported
    assert all((out / name).is_file() for name in TOKENIZER_FILES)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the model über"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))


def test_pipeline_greedy_text_equals_aftlab_generate(exported):
    run, out = exported
    trained = load_run(run, load_task=False).model
    pipe = transformers.pipeline("text-generation", model=str(out), tokenizer=str(out))
    for prompt in ("the ", "über "):
        got = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        ids = torch.tensor([list(prompt.encode("utf-8"))])
        ours = trained.generate(ids, 8, temperature=0)[0].tolist()
        assert got == bytes(ours).decode("utf-8", "replace"), (got, ours)


def test_export_of_a_run_whose_ids_are_not_bytes_writes_no_tokenizer(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "hf"
    argv = ["train", "--task", "copy", "--out", str(run), "--steps", "2", *TINY]
    assert main([*argv, "--set", "task_options.eval_size=4"]) == 0
    capsys.readouterr()
    assert main(["export", str(run), str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out)
    assert "no tokenizer.json written" in printed.err and len(printed.err.splitlines()) == 1
    assert (out / "config.json").is_file()
    assert not any((out / name).exists() for name in TOKENIZER_FILES)
