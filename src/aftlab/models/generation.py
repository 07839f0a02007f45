"""Decoding: ``generate`` for any causal language model, sampling, the Transformer's cache.

:func:`generate` and :func:`stream_generate` decode any model that follows the small protocol
:class:`CausalLM` (``init_cache``, ``prefill``, ``step`` and two facts: ``vocab_size`` and
``length_limit``): :class:`~aftlab.models.TransformerLM` today. They feed the prompt in one
parallel pass (``prefill``, the last position's logits only), then draw each new token with
:func:`sample_next_token` from ``softmax(logits / temperature)`` over the ``top_k`` largest
and the ``top_p`` nucleus, and feed it back (``step``). A model built on
:class:`~aftlab.models.transformer.TransformerBackbone` decodes from a :class:`DecodingCache`
(one mixer state per block). A prompt longer than ``max_seq_len`` of a model without a length
limit is prefilled in chunks of ``max_seq_len``, each continuing the cache
(:func:`prefill_prompt`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from .._checks import check_positive_int, check_tokens
from .._state import detach_state
from ..mixers import MixerState

__all__ = [
    "CausalLM",
    "LengthLimit",
    "DecodingCache",
    "generate",
    "stream_generate",
    "draw_tokens",
    "prefill_prompt",
    "sample_next_token",
    "sampling_logits",
    "check_sampling_args",
]


@dataclass
class DecodingCache:
    """State of incremental decoding: one mixer state per block and the next position.

    Attributes:
        states: ``states[l]`` is block ``l``'s mixer state (e.g. a
            :class:`~aftlab.mixers.attention.KVCache`).
        position: tokens consumed so far = position of the next token.
        batch_size: ``B``.
    """

    states: list[MixerState]
    position: int
    batch_size: int

    def detach(self) -> DecodingCache:
        """The same cache cut from its graph (truncated backpropagation between two chunks of
        ``prefill(..., cache=)``: the caller's choice); the tensors share storage."""
        return detach_state(self)


class LengthLimit(NamedTuple):
    """The longest sequence a model runs, and what sets it."""

    #: positions ``0 .. max_seq_len - 1`` only
    max_seq_len: int
    #: what sets the limit: ``"the learned positional table"``, or a mixer's name
    source: str


@runtime_checkable
class CausalLM(Protocol):
    """A model that :func:`generate` decodes.

    * ``vocab_size``: token ids lie in ``[0, vocab_size)``.
    * ``length_limit``: a :class:`LengthLimit` when the model cannot run past a length, else
      None.
    * ``init_cache(batch_size, *, device=None, dtype=None)``: the empty decoding cache.
    * ``prefill(idx, *, cache=None, logits_to_keep=0)``: ``(logits, cache)`` after the prompt
      ``idx: (B, T)`` in one call, continuing ``cache`` (``None``: the empty one); ``logits``
      ``(B, T, V)``, or of the last ``logits_to_keep`` positions only; the cache is ``T``
      positions further. It checks ``idx``.
    * ``step(tokens, cache)``: the logits ``(B, V)`` after one more token ``tokens: (B,)`` per
      sequence; advances ``cache`` in place.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def length_limit(self) -> LengthLimit | None: ...

    def init_cache(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Any: ...

    def prefill(
        self, idx: torch.Tensor, *, cache: Any = None, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, Any]: ...

    def step(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor: ...


def _check_generate(
    model: CausalLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    where = f"{type(model).__name__}.generate"
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"generate: 'model' must be a causal language model (CausalLM: vocab_size, "
            f"length_limit, init_cache, prefill, step), got {type(model).__name__}"
        )
    V = model.vocab_size
    check_tokens(where, "prompt", prompt, ndim=2, vocab_size=V)
    check_positive_int(where, "max_new_tokens", max_new_tokens, allow_zero=True)
    check_sampling_args(where, temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=V)
    total = prompt.shape[1] + max_new_tokens
    limit = model.length_limit
    if limit is not None and total > limit.max_seq_len:
        raise ValueError(
            f"{where}: prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} "
            f"= {total} exceeds max_seq_len = {limit.max_seq_len}, the limit of "
            f"{limit.source!r}"
        )


def stream_generate(
    model: CausalLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, yielding each new token ``(B,)`` as soon as it is drawn.

    Arguments are checked when called (before the first token).
    """
    _check_generate(model, prompt, max_new_tokens, temperature, top_k, top_p)
    return _stream(model, prompt, max_new_tokens, temperature, top_k, top_p, generator)


@torch.no_grad()
def _stream(
    model: CausalLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Iterator[torch.Tensor]:
    if max_new_tokens == 0:
        return
    logits, cache = prefill_prompt(model, prompt)
    yield from draw_tokens(
        model, logits[:, -1], cache, max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
    )


def prefill_prompt(model: CausalLM, prompt: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The last position's logits ``(B, 1, V)`` and the cache after ``prompt: (B, T0)``.

    One parallel pass (``model.prefill``), or, for a prompt longer than ``max_seq_len`` (the
    model's ``config.max_seq_len``) of a model without a ``length_limit``, one pass per chunk of
    ``max_seq_len`` tokens, each continuing the cache the last left (``prefill(chunk,
    cache=cache)``): the same logits and cache (within float rounding), and no pass longer
    than the model was built for (attention's ``O(T^2)`` scores). A length-limited model never
    gets here with a longer prompt (:func:`generate` refuses it).
    """
    chunk = getattr(getattr(model, "config", None), "max_seq_len", None)
    T0 = prompt.shape[1]
    if model.length_limit is not None or chunk is None or T0 <= chunk:
        return model.prefill(prompt, logits_to_keep=1)
    cache = None
    for start in range(0, T0, chunk):
        part = prompt[:, start : start + chunk]
        logits, cache = model.prefill(part, cache=cache, logits_to_keep=1)
    return logits, cache


def generate(
    model: CausalLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``prompt`` by sampling ``max_new_tokens`` tokens from ``model`` autoregressively.

    The prompt is fed in one parallel pass (``model.prefill``; in chunks of ``max_seq_len``
    for a longer prompt of a model without a length limit: :func:`prefill_prompt`), then each
    token is drawn
    from ``softmax(logits / temperature)`` over the ``top_k`` largest logits and the ``top_p``
    nucleus (:func:`sample_next_token`) and fed back (``model.step``); ``temperature=0`` is
    greedy.
    Runs under ``torch.no_grad()``; call ``model.eval()`` first to disable dropout.

    Args:
        model: a :class:`CausalLM`, e.g. a :class:`~aftlab.models.TransformerLM`.
        prompt: ``(B, T0)`` token ids, ``T0 >= 1``; any length for a model without a
            ``length_limit`` (aft-simple, aft-decay, aft-conv; attention with positions
            ``"none"``, ``"sinusoidal"`` or ``"rotary"``).
        max_new_tokens: ``N >= 0``.
        temperature: ``>= 0``.
        top_k: ``None`` or ``1 <= k <= vocab_size``.
        top_p: ``None`` or ``0 < p <= 1``: the nucleus (:func:`sample_next_token`).
        generator: a ``torch.Generator`` for reproducible sampling.

    Returns:
        ``(B, T0 + N)``: the prompt followed by the new tokens.

    Raises:
        ValueError: ``T0 + N`` beyond the model's ``length_limit`` (learned positions or a
            length-limited mixer); bad arguments.
    """
    new = list(
        stream_generate(
            model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator,
        )
    )
    return torch.cat([prompt, *(t[:, None] for t in new)], dim=1)


@torch.no_grad()
def draw_tokens(
    model: CausalLM,
    logits: torch.Tensor,
    cache: Any,
    n: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield ``n`` tokens ``(B,)``: the first drawn from ``logits: (B, V)``, each next from
    ``model.step(token, cache)`` (:func:`sample_next_token`); no step follows the last."""
    for i in range(n):
        token = sample_next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        yield token
        if i + 1 < n:
            logits = model.step(token, cache)


def check_sampling_args(
    where: str,
    *,
    temperature: float,
    top_k: int | None,
    vocab_size: int,
    top_p: float | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``temperature >= 0``, ``top_k`` in ``[1, V]``
    and ``top_p`` in ``(0, 1]`` (``None``: no limit)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"{where}: 'temperature' must be a float >= 0, got {type(temperature).__name__}"
        )
    if not temperature >= 0:
        raise ValueError(f"{where}: 'temperature' must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"{where}: 'top_k' must be an int or None, got {type(top_k).__name__}")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(
                f"{where}: 'top_k' must be in [1, vocab_size={vocab_size}], got {top_k}"
            )
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(
                f"{where}: 'top_p' must be a float in (0, 1] or None, got {type(top_p).__name__}"
            )
        if not 0 < top_p <= 1:
            raise ValueError(f"{where}: 'top_p' must be in (0, 1], got {top_p}")


def _top_p_mask(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """True where ``z: (B, V)`` falls outside the nucleus ``top_p`` (:func:`sampling_logits`)."""
    sorted_z, order = torch.sort(z, descending=False)
    drop = sorted_z.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[..., -1:] = False  # the most likely token stays
    return drop.scatter(-1, order, drop)


def sampling_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The logits :func:`sample_next_token` draws from: ``z = logits / tau`` (float32), ``-inf``
    outside the top ``k`` and then outside the nucleus ``top_p``.

    ``top_k`` keeps the ``k`` largest ``z`` of each row. ``top_p`` then keeps the smallest set
    of most likely tokens whose probabilities sum to at least ``top_p``: with ``p = softmax(z)``
    sorted ascending, ``p_(1) <= ... <= p_(V)``, token ``(j)`` is dropped when
    ``sum_{i <= j} p_(i) <= 1 - top_p``, and the most likely token is always kept. The order
    (temperature, top-k, top-p) and the arithmetic are transformers' ``generate``'s
    (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``), so ties at the
    boundary fall the same way.

    Args:
        logits: ``(B, V)`` unnormalised log-probabilities.
        temperature: ``tau > 0``.
        top_k: ``None`` (all) or ``1 <= k <= V``.
        top_p: ``None`` or ``1`` (all), or ``0 < p < 1``.

    Returns:
        ``(B, V)`` float32.
    """
    z = logits.float() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        z = z.masked_fill(_top_p_mask(z, top_p), float("-inf"))
    return z


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits / temperature)``, restricted to the top
    ``k`` and then to the nucleus ``top_p`` (:func:`sampling_logits`).

    Args:
        logits: ``(B, V)`` unnormalised log-probabilities.
        temperature: ``tau``; ``p_i ∝ exp(z_i / tau)``. ``0`` takes the argmax (greedy).
        top_k: keep only the ``k`` largest logits of each row (None keeps all).
        top_p: keep only the fewest most likely tokens whose probabilities sum to at least
            ``top_p`` in ``(0, 1]`` (None or 1 keeps all).
        generator: random generator for reproducible sampling (on the logits' device).

    Returns:
        ``(B,)`` long tensor of token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = sampling_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(z.softmax(dim=-1), 1, generator=generator)[:, 0]
