"""Stream text from a trained language model, token by token, with the mixer's decoding state."""

from __future__ import annotations

import codecs
import math
from typing import Any, TextIO

import torch
from torch import nn

from ..errors import UsageError
from ..models.generation import sample_next_token

__all__ = ["sample_text", "default_prompt", "check_sampling_options"]


def check_sampling_options(
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    vocab_size: int | None,
) -> None:
    """The command line's sampling options (``aftlab sample``, ``aftlab generate``), named as
    typed: a :class:`UsageError` unless ``--temperature`` is finite and ``>= 0``, ``--top-k``
    in ``[1, vocab_size]`` (``vocab_size=None``: not yet known, ``>= 1``), ``--top-p`` in
    ``(0, 1]`` and ``--seed`` in ``[0, 2**64)``."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UsageError(f"--temperature must be >= 0 and finite (0 = greedy), got {temperature}")
    if top_k is not None and vocab_size is not None and not 1 <= top_k <= vocab_size:
        raise UsageError(f"--top-k must be in [1, {vocab_size}], got {top_k}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1 keeps every token), got {top_p}")
    if not 0 <= seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {seed}")


def default_prompt(task: Any, *, length: int = 16) -> list[int]:
    """The first ``length`` tokens of the task's test split (an in-distribution prompt)."""
    for batch in task.eval_batches("test", batch_size=1, max_batches=1):
        return batch["input"][0, :length].tolist()
    return [0]


@torch.no_grad()
def sample_text(
    model: nn.Module,
    task: Any,
    *,
    prompt: str | None,
    tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    out: TextIO,
) -> str:
    """Write the prompt, then each generated token as soon as it is decoded, to ``out``.

    Uses ``model.stream_generate`` (the mixer's incremental state: KV cache or AFT recurrence)
    while the sequence fits the context ``T = max_seq_len``; past it, each further token is
    predicted from a full forward pass over the last ``T`` tokens (a sliding window).
    Byte-level tasks (256 ids) go through an incremental UTF-8 decoder, so a multi-byte
    character appears once complete; invalid bytes become U+FFFD.

    Args:
        model: a causal language model with ``stream_generate``.
        task: the task (``encode``/``decode``).
        prompt: text to continue; ``None``: the start of the test split.
        tokens: number of tokens to generate.
        temperature: softmax temperature, finite and ``>= 0`` (``0``: greedy).
        top_k: sample among the ``k`` most likely tokens; ``None``: all.
        top_p: sample among the nucleus of probability ``top_p`` in ``(0, 1]``; ``None``: all.
        seed: seed of the sampling generator, in ``[0, 2**64)``.
        out: where the text goes.

    Returns:
        The generated continuation (without the prompt).
    """
    check_sampling_options(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, vocab_size=task.vocab_size
    )
    if tokens <= 0:
        raise UsageError(f"--tokens must be > 0, got {tokens}")
    ids = default_prompt(task) if prompt is None else [int(t) for t in task.encode(prompt)]
    if not ids:
        raise UsageError("the prompt is empty; give some text with --prompt")
    device = next(model.parameters()).device
    context = model.config.max_seq_len
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    byte_level = task.vocab_size == 256
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace") if byte_level else None

    def emit(toks: list[int]) -> str:
        piece = dec.decode(bytes(toks)) if dec is not None else task.decode(toks)
        out.write(piece)
        out.flush()
        return piece

    emit(ids)
    pieces = []
    seq = list(ids)
    in_context = max(0, min(tokens, context - len(ids)))
    if in_context:  # incremental decoding with the mixer's state (KV cache / AFT running sums)
        prompt_t = torch.tensor([ids], dtype=torch.long, device=device)
        for tok in model.stream_generate(
            prompt_t, in_context, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen
        ):
            seq.append(int(tok[0]))
            pieces.append(emit([seq[-1]]))
    for _ in range(tokens - in_context):  # past the context: re-read the last T tokens
        window = torch.tensor([seq[-context:]], dtype=torch.long, device=device)
        logits = model(window)[:, -1]
        token = sample_next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen
        )
        seq.append(int(token[0]))
        pieces.append(emit([seq[-1]]))
    if dec is not None:
        tail = dec.decode(b"", final=True)
        pieces.append(tail)
        out.write(tail)
    out.write("\n")
    out.flush()
    return "".join(pieces)
