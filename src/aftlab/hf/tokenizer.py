"""The byte tokenizer of aftlab's text tasks as a Hugging Face ``tokenizers`` tokenizer.

aftlab's text tasks (``text``, ``enwik8``, ``text8``) read UTF-8 bytes: token id = byte value,
``0 .. 255``, no special tokens. :func:`byte_tokenizer` is that vocabulary as a
``tokenizers.Tokenizer``: GPT-2's byte-level alphabet (each byte one printable character) with
no merges, so ``encode(text).ids == list(text.encode("utf-8"))`` and ``decode(ids) ==
bytes(ids).decode("utf-8", "replace")``, the text ``aftlab sample`` prints (an incomplete or
invalid UTF-8 sequence becomes U+FFFD). :func:`write_byte_tokenizer` writes it into a
transformers folder, so ``AutoTokenizer.from_pretrained(folder)`` and
``pipeline("text-generation", model=folder)`` work offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

__all__ = ["byte_tokenizer", "write_byte_tokenizer", "TOKENIZER_FILES"]

#: the files :func:`write_byte_tokenizer` writes, as ``PreTrainedTokenizerFast.save_pretrained``
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _byte_alphabet() -> list[str]:
    """GPT-2's ``bytes_to_unicode``: ``alphabet[b]`` is the character standing for byte ``b``.

    The printable bytes ``!``..``~``, ``¡``..``¬``, ``®``..``ÿ`` stand for themselves; the other
    68 get ``chr(256 + n)`` in byte order (``tokenizers``' ``ByteLevel`` maps bytes the same way).
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    alphabet, n = [], 0
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + n))
            n += 1
    return alphabet


def byte_tokenizer() -> Tokenizer:
    """aftlab's byte vocabulary: id = byte value of the UTF-8 text, ``0 .. 255``.

    A byte-level BPE with no merges: the ``ByteLevel`` pre-tokenizer (no prefix space, no
    splitting regex) turns the text's bytes into one character each, each character is its own
    token, and the ``ByteLevel`` decoder turns the characters back into bytes and decodes them
    as UTF-8, replacing what is not UTF-8 with U+FFFD as ``bytes.decode(errors="replace")``.

    Example:
        >>> tok = byte_tokenizer()
        >>> tok.encode("hé").ids
        [104, 195, 169]
        >>> tok.decode([104, 195, 169]), tok.decode([104, 195])
        ('hé', 'h�')
    """
    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_byte_tokenizer(folder: str | os.PathLike) -> list[Path]:
    """Write :func:`byte_tokenizer` into the existing ``folder`` as transformers reads it.

    ``tokenizer.json`` (the tokenizer), ``tokenizer_config.json`` (``PreTrainedTokenizerFast``,
    which transformers 4 and 5 both load; ``clean_up_tokenization_spaces`` off, so decoded text
    is the bytes' text exactly) and ``special_tokens_map.json`` (empty: no special tokens),
    the files of ``PreTrainedTokenizerFast.save_pretrained``.

    Returns:
        The paths written, in :data:`TOKENIZER_FILES` order.
    """
    folder = Path(folder)
    paths = [folder / name for name in TOKENIZER_FILES]
    byte_tokenizer().save(str(paths[0]))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    paths[1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    paths[2].write_text("{}\n", encoding="utf-8")
    return paths
