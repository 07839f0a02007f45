"""``aftlab generate``: a run folder and an exported transformers folder; streaming; bad input."""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
import torch

from aftlab.cli import main
from aftlab.cli.generate import _Printer

from ..train.helpers import train_tiny

RATES = re.compile(
    r"^prefill: (\d+) tokens in [\d.]+ s \(([\d,.]+) tokens/s\); "
    r"decode: (\d+) tokens in [\d.]+ s \(([\d,.]+) tokens/s\)$"
)


def _text(ids) -> str:
    """What aftlab sample prints for byte ids."""
    return bytes(ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained text run (learned positions, max_seq_len 16)."""
    return train_tiny(tmp_path_factory.mktemp("generate"), 3)


@pytest.fixture(scope="module")
def model(run):
    from aftlab.train.run import load_run

    return load_run(run, load_task=False).model


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")
    out = tmp_path_factory.mktemp("generate-hf") / "hf"
    assert main(["export", str(run), str(out)]) == 0
    return out


def _generate(path, capsys, *argv: str) -> tuple[str, str]:
    capsys.readouterr()
    assert main(["generate", str(path), "--device", "cpu", *argv]) == 0  # the fixture's device
    printed = capsys.readouterr()
    return printed.out, printed.err


def _check_rates(err: str, prompt_tokens: int, new_tokens: int) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    m = RATES.match(lines[-1])
    assert m, lines[-1]
    assert (int(m[1]), int(m[3])) == (prompt_tokens, new_tokens - 1)
    assert float(m[2].replace(",", "")) > 0 and float(m[4].replace(",", "")) > 0


@pytest.mark.parametrize("prompt", ["the m", "über"])
def test_greedy_from_a_run_prints_the_models_greedy_generate(run, model, capsys, prompt):
    out, err = _generate(run, capsys, "--prompt", prompt, "--max-new-tokens", "9",
                         "--temperature", "0")  # fmt: skip
    ids = torch.tensor([list(prompt.encode())])
    assert out == _text(model.generate(ids, 9, temperature=0)[0].tolist()) + "\n"
    _check_rates(err, ids.shape[1], 9)


def test_sampling_is_the_models_seeded_sampling(run, model, capsys):
    argv = ["--prompt", "the m", "--max-new-tokens", "10", "--temperature", "1.2"]
    out, _ = _generate(run, capsys, *argv, "--top-k", "40", "--top-p", "0.9", "--seed", "3")
    ids = torch.tensor([list(b"the m")])
    g = torch.Generator().manual_seed(3)
    expected = model.generate(ids, 10, temperature=1.2, top_k=40, top_p=0.9, generator=g)
    assert out == _text(expected[0].tolist()) + "\n"
    again, _ = _generate(run, capsys, *argv, "--top-k", "40", "--top-p", "0.9", "--seed", "3")
    other, _ = _generate(run, capsys, *argv, "--seed", "4")
    assert again == out and other != out


def test_an_exported_folder_prints_the_same_as_its_run(run, exported, model, tmp_path, capsys):
    argv = ["--prompt", "the m", "--max-new-tokens", "9", "--temperature", "0"]
    out, err = _generate(exported, capsys, *argv)
    ids = torch.tensor([list(b"the m")])
    assert out == _text(model.generate(ids, 9, temperature=0)[0].tolist()) + "\n"
    _check_rates(err, 5, 9)
    # an export without tokenizer files (256 ids): the byte tokenizer
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    assert _generate(bare, capsys, *argv)[0] == out
    # --tokenizer names one explicitly
    tok = str(exported / "tokenizer.json")
    assert _generate(run, capsys, *argv, "--tokenizer", tok)[0] == out


def test_multi_byte_characters_print_once_complete():
    """Fed one byte at a time, the printer shows each character once complete, never cut."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")
    from aftlab.hf.tokenizer import byte_tokenizer

    data = "naïve 数据 🙂!".encode()
    out = io.StringIO()
    printer, ids, seen = _Printer(byte_tokenizer(), out), [], []
    for b in data:
        ids.append(b)
        printer.show(ids)
        seen.append(out.getvalue())
    # after each byte: the characters complete so far
    assert seen == [data[: i + 1].decode("utf-8", "ignore") for i in range(len(data))]
    assert printer.finish(ids + [0xF0]) == data.decode() + "\ufffd"  # a cut end: U+FFFD
    assert out.getvalue() == data.decode() + "\ufffd\n"


# --------------------------------------------------------------------------- bad input


def _one_line(capsys, argv: list[str], message: str) -> str:
    capsys.readouterr()
    try:
        code = main(["generate", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in printed.err, printed.err
    assert lines[0].startswith("aftlab: error: ") and re.search(message, lines[0]), lines[0]
    assert printed.out == ""
    return lines[0]


def test_bad_paths(tmp_path, capsys):
    prompt = ["--prompt", "x"]
    _one_line(capsys, [str(tmp_path / "nope"), *prompt], "PATH .*nope' does not exist")
    (tmp_path / "empty").mkdir()
    _one_line(capsys, [str(tmp_path / "empty"), *prompt], "neither config.json .* nor config.toml")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    _one_line(capsys, [str(tmp_path / "weights.bin"), *prompt], "not a .pth file")
    (tmp_path / "model.pth").write_bytes(b"\0")
    _one_line(capsys, [str(tmp_path / "model.pth"), *prompt], "give its tokenizer with --tokenizer")
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _one_line(capsys, [str(other), *prompt], "model_type 'gpt2'")
    (other / "config.json").write_text("{")
    _one_line(capsys, [str(other), *prompt], "cannot read .*config.json")
    rwkv = tmp_path / "rwkv"
    rwkv.mkdir()
    (rwkv / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    # without aftlab.models.rwkv4 the line says it is missing; with it, why the folder fails
    _one_line(capsys, [str(rwkv), *prompt], "RWKV-4")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
        (["--top-k", "0"], "--top-k must be >= 1"),
        (["--top-k", "257"], r"--top-k must be in \[1, 256\], got 257"),
        (["--temperature", "nan"], "--temperature must be >= 0 and finite"),
        (["--seed", "-1"], r"--seed must be in \[0, 2\*\*64\)"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
        (["--max-new-tokens", "20"], r"\+ --max-new-tokens 20 = 21 exceeds max_seq_len = 16"),
        (["--prompt", ""], "the prompt is empty"),
        (["--tokenizer", "{missing}"], "tokenizer file .* does not exist; check --tokenizer"),
        (["--tokenizer", "{bad}"], "cannot read the tokenizer"),
        (["--device", "meta"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--top-p", "x"], "invalid float value"),
    ],
)
def test_bad_options(run, tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text("{}")
    paths = {"missing": tmp_path / "nope.json", "bad": tmp_path / "bad.json"}
    argv = [a.format(**paths) for a in argv]
    _one_line(capsys, [str(run), "--prompt", "x", *argv], message)
