"""``aftlab generate``: stream text from a run, an exported transformers folder or an RWKV-4 model.

``PATH`` is one of:

* a run folder (``aftlab train --out``) of a byte-level text task: the byte tokenizer;
* a transformers folder written by ``aftlab export`` (``config.json`` with ``model_type
  "aftlab"``): its ``tokenizer.json``, else the byte tokenizer when the vocabulary has 256 ids;
* an RWKV-4 model: a transformers folder (``model_type "rwkv"``; its ``tokenizer.json``) or a
  BlinkDL ``.pth`` file (``--tokenizer FILE`` required), loaded by
  ``aftlab.models.rwkv4.RWKV4LM.from_pretrained``.

The prompt is prefilled in one pass (:func:`~aftlab.models.generation.prefill_prompt`), then
each token is drawn (:func:`~aftlab.models.generation.draw_tokens`: temperature, top-k, top-p)
and fed back one ``step`` at a time, as ``model.generate`` does; the text is printed as it
comes, and one line on stderr gives the prefill and decode rates, each timed on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import READ_ERRORS, UsageError, reason
from .commands import add_command, check_device, check_finite_weights, check_text

__all__ = ["add_generate", "cmd_generate", "stream_text"]

_PATH_HELP = (
    "a run folder (aftlab train --out), a transformers folder written by aftlab export, an "
    "RWKV-4 transformers folder (config.json with model_type rwkv) or a BlinkDL RWKV-4 .pth file"
)


def add_generate(sub) -> None:
    p = add_command(
        sub,
        "generate",
        cmd_generate,
        help="stream text from a run, an exported transformers folder or an RWKV-4 model",
        description="Continue --prompt token by token: one parallel prefill of the prompt, "
        "then one decoding step per new token (the mixer's state: KV cache, AFT running sums, "
        "RWKV's recurrence). The text is printed as it comes; stderr gets one line with the "
        "prefill and decode rates (tokens/s), timed apart. The tokenizer: a run's bytes, a "
        "folder's tokenizer.json, or --tokenizer.",
        epilog='example: aftlab generate hf/local --prompt "def main(" --max-new-tokens 100 '
        "--top-p 0.9",
    )
    p.add_argument("path", metavar="PATH", help=_PATH_HELP)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=200,
        metavar="N",
        help="tokens to generate (default 200)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="X",
        help="softmax temperature; 0 is greedy (default 0.8)",
    )
    p.add_argument(
        "--top-k", type=int, metavar="K", help="sample among the K most likely tokens (default all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="sample among the most likely tokens whose probabilities sum to at least P, in "
        "(0, 1] (nucleus sampling, after --top-k; default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a tokenizer.json to use instead of PATH's (required for a .pth file)",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from ..train.sampling import check_sampling_options

    check_text(args.prompt, "--prompt")
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    check_sampling_options(**sampling, seed=args.seed, vocab_size=None)  # before any loading
    device = check_device(args.device)
    model, tokenizer = load_generator(args.path, device=device, tokenizer=args.tokenizer)
    check_sampling_options(**sampling, seed=args.seed, vocab_size=model.vocab_size)
    stream_text(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        **sampling,
        seed=args.seed,
        out=sys.stdout,
        log=sys.stderr,
    )
    return 0


# --------------------------------------------------------------------------- loading


def load_generator(path: str, *, device, tokenizer: str | None = None) -> tuple[Any, Any]:
    """The model (eval mode, on ``device``) and ``tokenizers.Tokenizer`` of ``PATH``.

    Raises:
        UsageError: a missing path, a folder that is neither a run nor a transformers folder,
            a ``model_type`` other than ``aftlab`` and ``rwkv``, a ``.pth`` file without
            ``--tokenizer``, no tokenizer for the model, a model that cannot be loaded.
    """
    from ..models.generation import CausalLM

    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"PATH {path!r} does not exist; give {_PATH_HELP}")
    tok = _tokenizer_file(tokenizer) if tokenizer is not None else None
    if p.is_file():
        if p.suffix != ".pth":
            raise UsageError(
                f"PATH {path!r} is a file but not a .pth file (a BlinkDL RWKV-4 checkpoint); "
                f"give {_PATH_HELP}"
            )
        if tok is None:
            raise UsageError(
                f"PATH {path!r} is a .pth file, which holds no tokenizer; give its tokenizer "
                "with --tokenizer FILE (a tokenizer.json)"
            )
        model = _load_rwkv(p)
    elif (p / "config.json").is_file():
        model_type = _model_type(p / "config.json")
        if model_type == "aftlab":
            model = _load_aftlab_folder(p)
        elif model_type == "rwkv":
            model = _load_rwkv(p)
        else:
            raise UsageError(
                f"{str(p / 'config.json')!r} has model_type {model_type!r}; generate reads "
                "aftlab's (aftlab export) and RWKV-4's (rwkv)"
            )
        if tok is None:
            tok = _folder_tokenizer(p, model)
    elif (p / "config.toml").is_file() or (p / "checkpoints").is_dir():
        model, tok = _load_run(p, tok)
    else:
        raise UsageError(
            f"PATH {path!r} is a folder with neither config.json (a transformers folder) nor "
            f"config.toml (a run folder); give {_PATH_HELP}"
        )
    if not isinstance(model, CausalLM):
        raise UsageError(
            f"the model of {path!r} ({type(model).__name__}) is not a causal language model "
            "with prefill and step (aftlab.models.generation.CausalLM)"
        )
    return model.to(device).eval(), tok


def _tokenizer_file(path: str | Path):
    """``tokenizers.Tokenizer.from_file(path)``, a one-line error if it cannot be read."""
    from ..data.base import check_input_path

    p = check_input_path(path, what="tokenizer file", arg="--tokenizer", error=UsageError)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            "reading a tokenizer.json needs tokenizers: pip install 'aftlab[hf]'"
        ) from None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise UsageError(f"cannot read the tokenizer {str(p)!r} ({reason(e)})") from None


def _byte_tokenizer():
    try:
        from ..hf.tokenizer import byte_tokenizer
    except ImportError as e:
        raise UsageError(f"{e} (needed by aftlab generate for the byte tokenizer)") from None
    return byte_tokenizer()


def _model_type(config: Path) -> object:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except READ_ERRORS as e:
        raise UsageError(f"cannot read {str(config)!r} ({reason(e)})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{str(config)!r} is not a JSON object (a transformers config)")
    return data.get("model_type")


def _load_run(p: Path, tok):
    from ..data import byte_level
    from ..models.rwkv4 import RWKV4LM
    from ..models.transformer import TransformerLM
    from ..train.run import load_run

    run = load_run(p, load_task=False)
    check_finite_weights(run)
    if not isinstance(run.model, (TransformerLM, RWKV4LM)):
        raise UsageError(
            f"run {str(p)!r} holds a {type(run.model).__name__} (task {run.config.task!r}); "
            "generate needs a language model (e.g. --task text)"
        )
    if tok is None:
        if not byte_level(run.task_info):
            raise UsageError(
                f"run {str(p)!r} was trained on {run.config.task!r}, whose ids are not text; "
                "generate needs a byte-level text run (text, enwik8, text8) or --tokenizer FILE"
            )
        tok = _byte_tokenizer()
    return run.model, tok


def _load_aftlab_folder(p: Path):
    try:
        from ..hf import AftlabForCausalLM
    except ImportError as e:  # says how to install the hf extra
        raise UsageError(f"{e} (needed by aftlab generate for a transformers folder)") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return AftlabForCausalLM.from_pretrained(p).model
    except READ_ERRORS as e:
        raise UsageError(f"cannot load the transformers folder {str(p)!r} ({reason(e)})") from None


def _load_rwkv(p: Path):
    try:
        from ..models.rwkv4 import RWKV4LM
    except ImportError as e:
        raise UsageError(
            f"{str(p)!r} is an RWKV-4 model, which needs aftlab.models.rwkv4, missing from this "
            f"installation ({reason(e)})"
        ) from None
    try:
        return RWKV4LM.from_pretrained(p)
    except READ_ERRORS as e:
        raise UsageError(f"cannot load the RWKV-4 model {str(p)!r} ({reason(e)})") from None


def _folder_tokenizer(p: Path, model):
    if (p / "tokenizer.json").is_file():
        return _tokenizer_file(p / "tokenizer.json")
    if model.vocab_size == 256:  # an aftlab export written before it wrote a tokenizer
        return _byte_tokenizer()
    raise UsageError(
        f"{str(p)!r} has no tokenizer.json and its vocabulary ({model.vocab_size} ids) is not "
        "aftlab's bytes (256); give one with --tokenizer FILE"
    )


# --------------------------------------------------------------------------- streaming


class _Printer:
    """Prints the decoded text of a growing id list as it grows.

    Each call decodes the whole list and prints what is new; text ending in U+FFFD waits for
    the next token (a multi-byte character cut so far), until :meth:`finish`.
    """

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer, self.out, self.shown = tokenizer, out, ""

    def show(self, ids: list[int], *, final: bool = False) -> None:
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd") and not final:
            return
        # a decoder that rewrote text already shown: print from the first change
        same = len(os.path.commonprefix([text, self.shown]))
        self.out.write(text[same:])
        self.out.flush()
        self.shown = text

    def finish(self, ids: list[int]) -> str:
        self.show(ids, final=True)
        self.out.write("\n")
        self.out.flush()
        return self.shown


def stream_text(
    model,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    out: TextIO,
    log: TextIO,
) -> list[int]:
    """Write the decoded prompt and continuation to ``out`` as it comes; the rates to ``log``.

    The prefill (``prefill_prompt``, the prompt's ``T0`` tokens) and the decoding steps (the
    ``N - 1`` tokens fed back by ``model.step``: the first new token comes from the prefill's
    logits) are timed apart, the tokenizer and the printing outside both; on CUDA the device
    is synchronised before each clock reading.

    Args:
        model: a :class:`~aftlab.models.generation.CausalLM` in eval mode.
        tokenizer: a ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``).
        prompt: the text to continue.
        max_new_tokens: ``N >= 1``.
        temperature, top_k, top_p: as in :func:`~aftlab.models.generation.sample_next_token`.
        seed: seed of the sampling generator.
        out: where the text goes.
        log: where the one line of rates goes.

    Returns:
        The ids: prompt, then the ``N`` new tokens.

    Raises:
        UsageError: an empty prompt, an id beyond the model's vocabulary, a prompt and
            ``max_new_tokens`` longer than the model's length limit.
    """
    import torch

    from ..models.generation import draw_tokens, prefill_prompt

    ids = list(tokenizer.encode(prompt).ids)
    if not ids:
        raise UsageError("the prompt is empty; give some text with --prompt")
    V = model.vocab_size
    if max(ids) >= V:
        raise UsageError(
            f"the tokenizer gives the prompt id {max(ids)}, beyond the model's vocab_size {V}; "
            "give the model's own tokenizer (--tokenizer FILE)"
        )
    limit = getattr(model, "length_limit", None)
    if limit is not None and len(ids) + max_new_tokens > limit.max_seq_len:
        raise UsageError(
            f"the prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} = "
            f"{len(ids) + max_new_tokens} exceeds max_seq_len = {limit.max_seq_len}, the limit "
            f"of {limit.source!r}; ask for fewer tokens"
        )
    device = next(model.parameters()).device

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    printer = _Printer(tokenizer, out)
    printer.show(ids)
    generator = torch.Generator(device=device).manual_seed(seed)
    prompt_t = torch.tensor([ids], device=device)
    with torch.no_grad():
        start = clock()
        logits, cache = prefill_prompt(model, prompt_t)
        prefill_s = clock() - start
        tokens = draw_tokens(
            model, logits[:, -1], cache, max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
        )  # fmt: skip
        seq, decode_s = list(ids), 0.0
        for i in range(max_new_tokens):
            start = clock()
            token = int(next(tokens)[0])
            if i:  # the first token needs no step
                decode_s += clock() - start
            seq.append(token)
            printer.show(seq)
    printer.finish(seq)
    steps = max_new_tokens - 1
    rate = f"{steps / decode_s:,.1f} tokens/s" if decode_s > 0 else "no step"
    print(
        f"prefill: {len(ids)} tokens in {prefill_s:.4f} s ({len(ids) / max(prefill_s, 1e-9):,.1f} "
        f"tokens/s); decode: {steps} tokens in {decode_s:.4f} s ({rate})",
        file=log,
        flush=True,
    )
    return seq
