"""Decoding: the cache, the token-id check of every model entry, sampling, ``generate``.

A causal model built on :class:`~aftlab.models.transformer.TransformerBackbone` decodes one
token at a time from a :class:`DecodingCache` (one mixer state per block); :class:`CacheMixin`
gives it ``init_cache`` and :class:`GenerateMixin` ``generate`` / ``stream_generate``, which feed
the prompt in one parallel pass (``prefill``) and then draw each token with
:func:`sample_next_token` from ``softmax(logits / temperature)`` over the ``top_k`` largest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._checks import check_floating_dtype, check_positive_int
from ..mixers import MixerState

if TYPE_CHECKING:
    from .config import TransformerConfig
    from .transformer import TransformerBackbone

__all__ = [
    "DecodingCache",
    "CacheMixin",
    "GenerateMixin",
    "check_tokens",
    "sample_next_token",
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


def check_tokens(
    where: str, name: str, idx: object, *, ndim: int, vocab_size: int, in_forward: bool = False
) -> torch.Tensor:
    """``idx`` must be an integer tensor of rank ``ndim`` with ids in ``[0, vocab_size)``.

    The rank, dtype and length are checked always (free: no data is read). The id range reads
    the data: never inside ``torch.compile`` (it would break the graph), and in a forward pass
    (``in_forward``) only for CPU tensors, where it stalls nothing; on a GPU a read per step
    would stall the host, so there ``nn.Embedding`` rejects an out-of-range id itself (a
    device-side assert on CUDA; the tasks make ids in range by construction). Decoding entry
    points (prefill, step, generate), which wait for the host anyway, check on every device.
    """
    shape = ("B", "T") if ndim == 2 else ("B",)
    if not isinstance(idx, torch.Tensor):
        raise TypeError(
            f"{where}: '{name}' must be a torch.Tensor of token ids, got {type(idx).__name__}"
        )
    if idx.dim() != ndim:
        raise ValueError(
            f"{where}: '{name}' must have shape ({', '.join(shape)}{',' if ndim == 1 else ''}) "
            f"of token ids, got {tuple(idx.shape)}"
        )
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(
            f"{where}: '{name}' must be an integer (long) tensor of token ids, "
            f"got dtype {idx.dtype}"
        )
    if ndim == 2 and idx.shape[1] == 0:
        raise ValueError(
            f"{where}: '{name}' must hold at least one token, got shape {tuple(idx.shape)}"
        )
    read = not in_forward or idx.device.type == "cpu"
    if idx.numel() and read and not torch.compiler.is_compiling():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{where}: '{name}' ids must be in [0, vocab_size={vocab_size}), "
                f"got values in [{lo}, {hi}]"
            )
    return idx


class CacheMixin:
    """``init_cache``: of :class:`~aftlab.models.transformer.TransformerBackbone`, and of the
    models that hold one as ``self.backbone``."""

    def init_cache(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DecodingCache:
        """An empty :class:`DecodingCache`: each block's ``mixer.init_state(batch_size)``, on
        ``device`` and in ``dtype`` (by default the token embedding's).

        Raises:
            RuntimeError: the model is not causal.
            ValueError: ``batch_size`` is not a positive int.
            DTypeError: ``dtype`` is not a floating-point dtype (a ``ValueError``).
        """
        bb: TransformerBackbone = getattr(self, "backbone", self)
        check_positive_int(bb.where, "batch_size", batch_size)
        if not bb.config.causal:
            raise RuntimeError(f"{bb.where}: incremental decoding needs config.causal=True")
        w = bb.token_embedding.weight
        device = device or w.device
        dtype = w.dtype if dtype is None else check_floating_dtype(bb.where, "dtype", dtype)
        states = [b.mixer.init_state(batch_size, device=device, dtype=dtype) for b in bb.blocks]
        return DecodingCache(states=states, position=0, batch_size=batch_size)


class GenerateMixin(CacheMixin):
    """``generate`` and ``stream_generate`` of a language model.

    The model has ``config``, ``backbone``, ``head`` (hidden states to logits) and
    ``step(tokens (B,), cache) -> logits (B, V)``.
    """

    config: TransformerConfig
    backbone: TransformerBackbone
    head: torch.nn.Module

    def _check_generate(
        self, prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None
    ) -> None:
        where = f"{type(self).__name__}.generate"
        V = self.config.vocab_size
        check_tokens(where, "prompt", prompt, ndim=2, vocab_size=V)
        check_positive_int(where, "max_new_tokens", max_new_tokens, allow_zero=True)
        check_sampling_args(where, temperature=temperature, top_k=top_k, vocab_size=V)
        total = prompt.shape[1] + max_new_tokens
        limited = [b.mixer.name for b in self.backbone.blocks if b.mixer.length_limited]
        if self.config.positional == "learned":
            limited.insert(0, "the learned positional table")
        if limited and total > self.config.max_seq_len:
            raise ValueError(
                f"{where}: prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} "
                f"= {total} exceeds max_seq_len = {self.config.max_seq_len}, the limit of "
                f"{limited[0]!r}"
            )

    def stream_generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[torch.Tensor]:
        """Like :meth:`generate`, yielding each new token ``(B,)`` as soon as it is drawn.

        Arguments are checked when called (before the first token).
        """
        self._check_generate(prompt, max_new_tokens, temperature, top_k)
        return self._stream(prompt, max_new_tokens, temperature, top_k, generator)

    @torch.no_grad()
    def _stream(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        generator: torch.Generator | None,
    ) -> Iterator[torch.Tensor]:
        if max_new_tokens == 0:
            return
        # the prompt in one parallel pass; only its last position's logits are needed
        h, cache = self.backbone.prefill_embeddings(self.backbone.token_embedding(prompt))
        logits = self.head(h[:, -1])
        for i in range(max_new_tokens):
            token = sample_next_token(
                logits, temperature=temperature, top_k=top_k, generator=generator
            )
            yield token
            if i + 1 < max_new_tokens:
                logits = self.step(token, cache)

    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt`` by sampling ``max_new_tokens`` tokens autoregressively.

        The prompt is fed in one parallel pass (``prefill``), then each token is drawn
        from ``softmax(logits / temperature)`` over the ``top_k`` largest logits
        (:func:`sample_next_token`); ``temperature=0`` is greedy.
        Runs under ``torch.no_grad()``; call ``model.eval()`` first to disable dropout.

        Args:
            prompt: ``(B, T0)`` token ids, ``T0 >= 1``.
            max_new_tokens: ``N >= 0``.
            temperature: ``>= 0``.
            top_k: ``None`` or ``1 <= k <= vocab_size``.
            generator: a ``torch.Generator`` for reproducible sampling.

        Returns:
            ``(B, T0 + N)``: the prompt followed by the new tokens.

        Raises:
            ValueError: ``T0 + N > max_seq_len`` with learned positions or a length-limited
                mixer; bad arguments.
        """
        new = list(
            self.stream_generate(
                prompt, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator
            )
        )
        return torch.cat([prompt, *(t[:, None] for t in new)], dim=1)


def check_sampling_args(
    where: str, *, temperature: float, top_k: int | None, vocab_size: int
) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``temperature >= 0``, ``top_k`` in ``[1, V]``."""
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


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits / temperature)``, restricted to the top ``k``.

    Args:
        logits: ``(B, V)`` unnormalised log-probabilities.
        temperature: ``tau``; ``p_i ∝ exp(z_i / tau)``. ``0`` takes the argmax (greedy).
        top_k: keep only the ``k`` largest logits of each row (None keeps all).
        generator: random generator for reproducible sampling (on the logits' device).

    Returns:
        ``(B,)`` long tensor of token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.float() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
