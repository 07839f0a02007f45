"""The practical Transformer on the mixer interface: language, classification and pixel models.

All three share :class:`TransformerBackbone`: token embedding ``E``, positional encoding ``P``,
``N`` :class:`~aftlab.models.blocks.TransformerBlock` s around the mixer ``config.mixer``, and a
final LayerNorm. Batch-first: tokens ``(B, T)`` long, hidden states ``(B, T, d)``.

``h_0 = dropout(E[idx] + P[0:T])``, ``h_l = Block_l(h_{l-1})``, ``h = LN_f(h_N)``; the LM's
logits are ``h E^T`` with a tied head (``config.tie_embeddings``). Initialisation:
:func:`init_weights` (``config.init``). Decoding and ``generate``:
:mod:`aftlab.models.generation`; loading GPT-2 weights: :mod:`aftlab.models.gpt2`.

Validation: the models' entry points (``forward``, ``prefill``, ``step``, ``generate``) check their
token ids and padding mask (:func:`~aftlab._checks.check_tokens`: the id range only on CPU tensors
outside ``torch.compile``, so that no forward pass syncs the host), ``prefill`` the length and the
cache it continues, ``step`` the cache, ``forward`` its ``cu_seqlens`` (packed documents); below
them ``prefill`` and ``step`` run the blocks' and mixers' hooks, unchecked. ``forward`` calls each
block as a module (FSDP's hooks), and a block and its mixer (public modules too) check shapes and
dtypes; the mixer calls its op without the op's checks. Before anything is built, each model checks
that its parameters fit in memory (:func:`~aftlab.models.memory.check_model_fits`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool_mask,
    check_choice,
    check_floating_dtype,
    check_padding_mask,
    check_positive_int,
    check_tokens,
)
from ..mixers import SequenceMixer
from ..mixers.base import document_positions, is_residual_projection
from ..ops._packed import check_cu_seqlens
from . import generation
from .blocks import FeedForward, TransformerBlock
from .config import TransformerConfig
from .generation import DecodingCache, LengthLimit, check_sampling_args, sample_next_token
from .memory import check_model_fits
from .positional import sinusoidal_positions

__all__ = [
    "TransformerBackbone",
    "TransformerBlock",
    "init_weights",
    "FeedForward",
    "DecodingCache",
    "TransformerLM",
    "TransformerClassifier",
    "PixelTransformer",
    "sinusoidal_positions",
    "sample_next_token",
]


# --------------------------------------------------------------------------- validation
def _check_config(
    where: str, config: object, *, causal: bool | None = None, kind: str = "", hint: str = ""
) -> TransformerConfig:
    """``config`` must be a :class:`TransformerConfig` (with ``causal``, for ``kind``)."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(
            f"{where}: 'config' must be a TransformerConfig, got {type(config).__name__}"
        )
    if causal is not None and config.causal != causal:
        raise ValueError(
            f"{where}: {kind} needs config.causal={causal}, got {config.causal}{hint}"
        )
    return config


def _check_padding_mask(
    where: str, mask: torch.Tensor | None, idx: torch.Tensor
) -> torch.Tensor | None:
    if mask is None:
        return None
    return check_padding_mask(where, mask, tuple(idx.shape[:2]), "idx", idx)


def _last(h: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """The last ``logits_to_keep`` positions of ``h: (B, T, d)`` (0: all)."""
    return h[:, -logits_to_keep:] if logits_to_keep else h


def check_logits_selection(
    where: str, idx: torch.Tensor, logits_to_keep: int, logits_mask: torch.Tensor | None
) -> None:
    """Check a language model's ``logits_to_keep`` and ``logits_mask`` for ``idx: (B, T)``.

    Raises:
        ValueError: ``logits_to_keep`` negative, ``logits_mask`` of another shape or device
            than ``idx``, or both given.
        TypeError: ``logits_mask`` not a bool tensor.
    """
    check_positive_int(where, "logits_to_keep", logits_to_keep, allow_zero=True)
    if logits_mask is None:
        return
    shape = tuple(idx.shape[:2])
    check_bool_mask(where, "logits_mask", logits_mask, shape, "idx", idx, true_means="a logit")
    if logits_to_keep:
        raise ValueError(
            f"{where}: give 'logits_to_keep' or 'logits_mask', not both "
            f"(got logits_to_keep={logits_to_keep})"
        )


def keep_positions(
    h: torch.Tensor, logits_to_keep: int = 0, logits_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The hidden states ``h: (B, T, d)`` a language model's head scores.

    ``logits_to_keep = n``: the last ``n`` positions, ``(B, n, d)`` (0: all, ``(B, T, d)``).
    ``logits_mask``: bool ``(B, T)``, the True positions only, ``(n, d)`` in row-major order:
    the positions a loss scores (a recall task's queries), so that the head and its softmax,
    ``V`` values per position, are not computed where nothing is scored. Checked by
    :func:`check_logits_selection`.
    """
    return _last(h, logits_to_keep) if logits_mask is None else h[logits_mask]


# --------------------------------------------------------------------------- initialisation
#: GPT-2's standard deviation of linear weights and embeddings
INIT_STD = 0.02


@torch.no_grad()
def init_weights(module: nn.Module, config: TransformerConfig) -> None:
    """Initialise ``module`` and its submodules by ``config.init`` (docs/transformer.md).

    ``"gpt2"`` (GPT-2, Radford et al. 2019), with ``N = config.n_layers``:

    * every ``nn.Linear`` weight ``~ N(0, 0.02^2)``; a residual projection (a mixer's ``W^O``,
      the feed-forward's ``W_2``: :func:`~aftlab.mixers.base.mark_residual_projection`)
      ``~ N(0, (0.02 / sqrt(2 N))^2)``; every linear bias 0;
    * every ``nn.Embedding`` (tokens, learned positions) ``~ N(0, 0.02^2)``;
    * every LayerNorm ``gamma = 1``, ``beta = 0``;
    * then each mixer's :meth:`~aftlab.mixers.SequenceMixer.reset_parameters` (its own
      parameters: decays, position biases, kernels), so that they keep their meaning.

    ``"torch"``: only the embeddings are drawn ``N(0, 0.02^2)``; the linear layers, LayerNorms
    and mixers keep what their constructors gave them (PyTorch's ``nn.Linear`` default:
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weights and biases).
    """
    gpt2 = config.init == "gpt2"
    residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=INIT_STD)
        elif gpt2 and isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=residual_std if is_residual_projection(m) else INIT_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif gpt2 and isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    if gpt2:
        for m in module.modules():
            if isinstance(m, SequenceMixer):
                m.reset_parameters()


# --------------------------------------------------------------------------- backbone
class TransformerBackbone(nn.Module):
    """Embeddings, blocks and final norm shared by every model here.

    Positional encodings (``config.positional``): ``"learned"`` adds a trained table
    ``P in R^{T_max x d}``; ``"sinusoidal"`` adds :func:`sinusoidal_positions`; ``"rotary"``
    rotates queries and keys inside the mixer (needs a mixer accepting ``rotary``); ``"none"``
    adds nothing. Initialised by :func:`init_weights` (``config.init``; GPT-2's by default).

    Args:
        config: the model config.
        where: the owning model's name, used in error messages.
    """

    def __init__(self, config: TransformerConfig, *, where: str = "TransformerBackbone") -> None:
        super().__init__()
        self.config = _check_config(where, config)
        self.where = where
        d = config.d_model
        self.token_embedding = nn.Embedding(config.vocab_size, d)
        self.position_embedding = (
            nn.Embedding(config.max_seq_len, d) if config.positional == "learned" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, layer_idx=i) for i in range(config.n_layers)
        )
        self.final_norm = (
            nn.LayerNorm(d, eps=config.layer_norm_eps) if config.final_norm else nn.Identity()
        )
        init_weights(self, config)

    def positions(self, length: int, offset: int, like: torch.Tensor) -> torch.Tensor | None:
        """Additive encodings ``(T, d)`` of positions ``offset .. offset+length-1`` (or None)."""
        kind, t_max = self.config.positional, self.config.max_seq_len
        if kind == "learned":
            if offset + length > t_max:
                raise ValueError(
                    f"{self.where}: position {offset + length - 1} "
                    f"(sequence length {offset + length}) "
                    f"exceeds the learned positional table: max_seq_len = {t_max} positions "
                    "(use a longer max_seq_len, or positional='sinusoidal'/'rotary')"
                )
            return self.position_embedding.weight[offset : offset + length]
        if kind == "sinusoidal":
            return sinusoidal_positions(
                length, self.config.d_model, offset=offset, device=like.device, dtype=like.dtype
            )
        return None

    def _inputs(
        self, h: torch.Tensor, start: int = 0, offsets: list[int] | None = None
    ) -> torch.Tensor:
        """``dropout(h + P)`` for embeddings ``h: (B, T, d)``: the first block's input.

        ``P`` encodes positions ``start .. start + T - 1``, or, for packed documents at
        ``offsets`` (the ints of ``cu_seqlens``), each token's position in its document.
        """
        if offsets is None:
            pos = self.positions(h.shape[1], start, h)
        else:
            _, ids = document_positions(offsets, h.device)
            longest = max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
            table = self.positions(longest, 0, h)
            pos = None if table is None else F.embedding(ids, table)
        return self.drop(h if pos is None else h + pos)

    def forward_embeddings(
        self,
        h: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run token embeddings ``h: (B, T, d)`` (no positions yet) through the stack.

        ``cu_seqlens`` (int32 ``[0, n_1, ..., T]``, ``B = 1``) packs documents: positions
        restart at 0 in each and every block's mixer restarts there, so each document's hidden
        states equal those of a forward on it alone. Not with ``padding_mask``.
        """
        offsets = None
        if cu_seqlens is not None:
            if padding_mask is not None:
                raise ValueError(
                    f"{self.where}: pass 'cu_seqlens' or 'padding_mask', not both (packed "
                    "documents hold no padding)"
                )
            offsets = check_cu_seqlens(self.where, cu_seqlens, h.shape[1], h.shape[0])
        h = self._inputs(h, offsets=offsets)
        for block in self.blocks:
            h = block(h, padding_mask=padding_mask, cu_seqlens=cu_seqlens)
        return self.final_norm(h)

    # ------------------------------------------------------------------ decoding
    def _check_causal(self) -> None:
        if not self.config.causal:
            raise RuntimeError(f"{self.where}: incremental decoding needs config.causal=True")

    @property
    def length_limit(self) -> LengthLimit | None:
        """``max_seq_len`` and what sets it, when positions past it cannot run: the learned
        positional table, or a length-limited mixer (``aft-full``, ``aft-local``); else None."""
        if self.config.positional == "learned":
            return LengthLimit(self.config.max_seq_len, "the learned positional table")
        limited = [b.mixer.name for b in self.blocks if b.mixer.length_limited]
        return LengthLimit(self.config.max_seq_len, limited[0]) if limited else None

    def check_length(self, where: str, name: str, length: int, *, start: int = 0) -> None:
        """Raise unless a sequence ``name`` of ``length`` positions from position ``start`` (a
        cache's) is within :attr:`length_limit`."""
        limit = self.length_limit
        if limit is None or start + length <= limit.max_seq_len:
            return
        what = f"sequence length {length} of {name!r}"
        if start:
            what = (
                f"position {start + length - 1} of {name!r} (continuing 'cache' at position "
                f"{start})"
            )
        raise ValueError(
            f"{where}: {what} exceeds max_seq_len = {limit.max_seq_len}, the limit of "
            f"{limit.source!r}"
        )

    def check_cache(self, cache: object, h: torch.Tensor, *, input_name: str = "tokens") -> None:
        """Raise unless ``cache`` is a :class:`DecodingCache` of this model for the inputs
        ``h: (B, ...)`` (named ``input_name``): its batch size, one state per block, each
        fitting its mixer (:meth:`~aftlab.mixers.SequenceMixer.check_state`, named
        ``cache.states[i]``)."""
        name = "cache"
        if not isinstance(cache, DecodingCache):
            raise TypeError(
                f"{self.where}: {name!r} must be a DecodingCache, got {type(cache).__name__}"
            )
        if h.shape[0] != cache.batch_size:
            raise ValueError(
                f"{self.where}: {input_name!r} has batch size {h.shape[0]} but {name!r} was made "
                f"for batch_size={cache.batch_size}"
            )
        if len(cache.states) != len(self.blocks):
            raise ValueError(
                f"{self.where}: {name!r} holds {len(cache.states)} layer states but the model "
                f"has n_layers={len(self.blocks)}"
            )
        for i, block in enumerate(self.blocks):  # a cache of another model: named as such
            block.mixer.check_state(cache.states[i], h, name=f"{name}.states[{i}]")

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
        check_positive_int(self.where, "batch_size", batch_size)
        self._check_causal()
        w = self.token_embedding.weight
        device = device or w.device
        dtype = w.dtype if dtype is None else check_floating_dtype(self.where, "dtype", dtype)
        states = [b.mixer.init_state(batch_size, device=device, dtype=dtype) for b in self.blocks]
        return DecodingCache(states=states, position=0, batch_size=batch_size)

    def prefill_embeddings(
        self, h: torch.Tensor, cache: DecodingCache | None = None
    ) -> tuple[torch.Tensor, DecodingCache]:
        """Run a prompt's embeddings ``h: (B, T, d)`` (no positions yet) through the stack at
        once, from ``cache`` (None: from position 0).

        The model's ``prefill`` has checked the prompt (its ids and :meth:`check_length`) and
        ``cache`` (:meth:`check_cache`); the blocks run their mixers' prefill unchecked
        (:meth:`TransformerBlock._prefill`): one pass from the empty state or from the cache's
        (every built-in mixer; a plugin without a ``_prefill`` hook continues by steps).

        Returns:
            ``(hidden, cache)``: the hidden states ``(B, T, d)`` (of :meth:`forward_embeddings`
            from an empty cache; with positions ``p .. p + T - 1`` after ``cache`` at ``p``) and
            the :class:`DecodingCache` at ``position = p + T``, each block's mixer state taken
            from the same pass. A given ``cache`` is that object, advanced in place (as
            :meth:`step_embeddings` does).
        """
        self._check_causal()
        B, T = h.shape[:2]
        start = 0 if cache is None else cache.position
        h = self._inputs(h, start)
        states = []
        for i, block in enumerate(self.blocks):
            h, state = block._prefill(h, None if cache is None else cache.states[i])
            states.append(state)
        if cache is None:
            return self.final_norm(h), DecodingCache(states=states, position=T, batch_size=B)
        cache.states, cache.position = states, start + T
        return self.final_norm(h), cache

    def forward(
        self,
        idx: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``(B, T, d)`` of token ids ``idx: (B, T)`` (:meth:`forward_embeddings`).
        """
        return self.forward_embeddings(
            self.token_embedding(idx), padding_mask=padding_mask, cu_seqlens=cu_seqlens
        )

    def step_embeddings(self, h: torch.Tensor, cache: DecodingCache) -> torch.Tensor:
        """One decoding step from the input embedding ``h: (B, d)``; advances ``cache``.

        Checks ``cache`` (:meth:`check_cache`), then runs the blocks' unchecked steps
        (:meth:`TransformerBlock._step`).
        """
        self._check_causal()
        self.check_cache(cache, h)
        pos = self.positions(1, cache.position, h)
        if pos is not None:
            h = h + pos[0]
        h = self.drop(h)
        for i, block in enumerate(self.blocks):
            h, cache.states[i] = block._step(h, cache.states[i])
        cache.position += 1
        return self.final_norm(h)


def _count(module: nn.Module, exclude: Sequence[nn.Module | None]) -> int:
    skip = {id(p) for m in exclude if m is not None for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


# --------------------------------------------------------------------------- language model
class TransformerLM(nn.Module):
    """Causal language model: ``logits = LN_f(Blocks(E[idx] + P)) W_head^T``.

    The head ``W_head: (V, d)`` is the token embedding itself when ``config.tie_embeddings``.
    Decoding works with any causal mixer through its ``init_state``/``step``; :meth:`generate`
    first feeds the prompt in one parallel pass (:meth:`prefill`). A
    :class:`~aftlab.models.generation.CausalLM`: :func:`~aftlab.models.generation.generate`
    decodes it.

    Args:
        config: a :class:`TransformerConfig` with ``causal=True``.

    Example:
        >>> import torch
        >>> from aftlab.models import TransformerConfig, TransformerLM
        >>> lm = TransformerLM(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4,
        ...                                      max_seq_len=16)).eval()
        >>> lm(torch.randint(0, 50, (2, 7))).shape
        torch.Size([2, 7, 50])
        >>> lm.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0).shape
        torch.Size([2, 8])
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        where = type(self).__name__
        hint = " (TransformerClassifier is the bidirectional encoder)"
        _check_config(where, config, causal=True, kind="a language model", hint=hint)
        check_model_fits(where, config)
        self.config = config
        self.backbone = TransformerBackbone(config, where=where)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.backbone.token_embedding.weight
        else:
            init_weights(self.head, config)

    @staticmethod
    def batch_input(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The arguments of :meth:`forward` for a task batch: ``model(**model.batch_input(b))``.

        ``idx = batch["input"]`` and ``padding_mask = batch.get("padding_mask")``; a packed
        batch's ``cu_seqlens`` too (``pack_documents``: :func:`aftlab.data.base.pack_rows`).
        """
        packed = {"cu_seqlens": batch["cu_seqlens"]} if "cu_seqlens" in batch else {}
        return {"idx": batch["input"], "padding_mask": batch.get("padding_mask"), **packed}

    def forward(
        self,
        idx: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        logits_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits.

        Args:
            idx: token ids ``(B, T)``, ``T <= max_seq_len`` with learned positions (with
                ``cu_seqlens``: each document).
            padding_mask: bool ``(B, T)``, True for real tokens; padded keys are ignored.
            cu_seqlens: int32 ``[0, n_1, ..., T]`` for ``B = 1``: packed documents. Positions
                restart at 0 in each and every mixer restarts there: the logits (and their
                gradients) equal separate forwards per document. Not with ``padding_mask``.
            logits_to_keep: the logits of the last ``logits_to_keep`` positions only (0: all).
            logits_mask: bool ``(B, T)``: the logits of the True positions only (the scored
                ones: :func:`keep_positions`), as the trainer asks where a task scores few
                positions. Not with ``logits_to_keep``.

        Returns:
            ``(B, T, vocab_size)``: ``logits[:, t]`` scores token ``t + 1``; ``(B, n,
            vocab_size)`` for the last ``n = logits_to_keep`` positions; ``(n, vocab_size)``
            for the ``n`` True positions of ``logits_mask``, row by row.
        """
        where = type(self).__name__
        check_tokens(where, "idx", idx, ndim=2, vocab_size=self.config.vocab_size, in_forward=True)
        _check_padding_mask(where, padding_mask, idx)
        check_logits_selection(where, idx, logits_to_keep, logits_mask)
        h = self.backbone(idx, padding_mask=padding_mask, cu_seqlens=cu_seqlens)
        return self.head(keep_positions(h, logits_to_keep, logits_mask))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied head counted once).

        Args:
            exclude_embeddings: leave out the token embedding and the learned positional table
                (the HF convention; an untied head is still counted).
        """
        bb = self.backbone
        return _count(
            self, [bb.token_embedding, bb.position_embedding] if exclude_embeddings else []
        )

    # ------------------------------------------------------------------ decoding
    @property
    def vocab_size(self) -> int:
        """``config.vocab_size``: token ids lie in ``[0, vocab_size)``."""
        return self.config.vocab_size

    @property
    def length_limit(self) -> LengthLimit | None:
        """The longest sequence this model runs (:attr:`TransformerBackbone.length_limit`)."""
        return self.backbone.length_limit

    def init_cache(self, batch_size: int, **device_dtype) -> DecodingCache:
        """The empty cache to decode from: :meth:`TransformerBackbone.init_cache` (keywords
        ``device``, ``dtype``)."""
        return self.backbone.init_cache(batch_size, **device_dtype)

    def prefill(
        self,
        idx: torch.Tensor,
        *,
        cache: DecodingCache | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, DecodingCache]:
        """Feed a whole prompt (or the next chunk after ``cache``) in one call; return the cache
        to decode (or prefill) on from.

        Every block's mixer returns its decoding state from the same pass that computes the
        hidden states (:meth:`~aftlab.mixers.SequenceMixer.prefill`), instead of ``T`` calls of
        :meth:`step`; the cache equals theirs (within float rounding), and so do the logits that
        follow. With ``cache`` at position ``p``, positions (learned, sinusoidal, rotary) run
        ``p .. p + T - 1``: ``prefill(a)`` then ``prefill(b, cache=c)`` equals ``prefill(a + b)``
        (logits, cache, the next :meth:`step`), within float rounding. Gradients flow through
        the cache (``cache.detach()`` cuts them). The checks of the call: ``idx`` (its ids on
        every device), ``cache`` (:meth:`TransformerBackbone.check_cache`) and the length; the
        blocks and mixers below do not check again.

        Args:
            idx: token ids ``(B, T)``, ``T >= 1``; ``p + T <= max_seq_len`` with learned
                positions or a length-limited mixer (``aft-full``, ``aft-local``); any length
                otherwise.
            cache: a :class:`DecodingCache` of this model (``init_cache``, ``prefill``,
                ``step``) to continue, advanced in place and returned (as :meth:`step` does);
                None starts at position 0.
            logits_to_keep: the logits of the last ``logits_to_keep`` positions only (0: all);
                ``generate`` takes 1, the next token's.

        Returns:
            ``(logits, cache)``: the logits ``(B, T, vocab_size)`` of the ``T`` tokens (from an
            empty cache ``forward(idx)``'s, bit for bit; their last ``logits_to_keep``
            positions) and the :class:`DecodingCache` at ``position = p + T``.
        """
        where = type(self).__name__
        check_tokens(where, "idx", idx, ndim=2, vocab_size=self.config.vocab_size)
        check_positive_int(where, "logits_to_keep", logits_to_keep, allow_zero=True)
        if cache is not None:
            self.backbone.check_cache(cache, idx, input_name="idx")
        start = 0 if cache is None else cache.position
        self.backbone.check_length(where, "idx", idx.shape[1], start=start)
        h, cache = self.backbone.prefill_embeddings(self.backbone.token_embedding(idx), cache)
        return self.head(_last(h, logits_to_keep)), cache

    def step(self, tokens: torch.Tensor, cache: DecodingCache) -> torch.Tensor:
        """Feed one token per sequence at position ``cache.position``; updates ``cache`` in place.

        Args:
            tokens: ``(B,)`` token ids.
            cache: from :meth:`init_cache`.

        Returns:
            ``(B, vocab_size)`` logits of the next token; equal to ``forward`` on the whole
            prefix at its last position.
        """
        where = type(self).__name__
        check_tokens(where, "tokens", tokens, ndim=1, vocab_size=self.config.vocab_size)
        h = self.backbone.step_embeddings(self.backbone.token_embedding(tokens), cache)
        return self.head(h)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """Continue ``prompt`` by ``max_new_tokens`` sampled tokens: ``(B, T0 + N)``.

        :func:`aftlab.models.generation.generate` of this model; ``sampling``: its keywords
        ``temperature``, ``top_k``, ``top_p``, ``generator``.
        """
        return generation.generate(self, prompt, max_new_tokens, **sampling)

    def stream_generate(
        self, prompt: torch.Tensor, max_new_tokens: int, **sampling
    ) -> Iterator[torch.Tensor]:
        """Like :meth:`generate`, yielding each new token ``(B,)`` as soon as it is drawn
        (:func:`aftlab.models.generation.stream_generate`)."""
        return generation.stream_generate(self, prompt, max_new_tokens, **sampling)

    # ------------------------------------------------------------------ GPT-2
    @staticmethod
    def from_gpt2_state_dict(state_dict: Mapping[str, torch.Tensor], **kwargs) -> TransformerLM:
        """Build a model from a Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict.

        :func:`~aftlab.models.gpt2.load_gpt2_state_dict`, with its keyword arguments
        (``config``, ``n_heads``, ``layer_norm_eps``); it builds a :class:`TransformerLM`, called
        on a subclass too. The config is inferred from the shapes unless given; the number of
        heads is not in the shapes, so pass ``n_heads`` (``GPT2Config.n_head``) or a ``config``.

        Example:
            >>> from transformers import GPT2Config, GPT2LMHeadModel  # doctest: +SKIP
            >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32))  # doctest: +SKIP
            >>> sd = hf.state_dict()  # doctest: +SKIP
            >>> lm = TransformerLM.from_gpt2_state_dict(sd, n_heads=2)  # doctest: +SKIP

        Raises:
            ValueError: ``n_heads`` missing or not dividing ``n_embd``; a missing, unexpected or
                wrongly shaped tensor (named with expected and received shape).
        """
        from .gpt2 import load_gpt2_state_dict  # gpt2 imports this module

        return load_gpt2_state_dict(state_dict, **kwargs)


# --------------------------------------------------------------------------- classifier
class TransformerClassifier(nn.Module):
    """Bidirectional encoder with a classification head.

    ``logits = W_c pool(h) + b_c`` with ``h = Backbone(idx)``; ``pool`` is the mean over real
    tokens (``sum_t m_t h_t / sum_t m_t`` with the padding mask ``m``) or the first token.

    Args:
        config: a :class:`TransformerConfig` with ``causal=False``.
        num_classes: ``C``.
        pooling: ``"mean"`` or ``"first"``.
    """

    def __init__(
        self, config: TransformerConfig, *, num_classes: int, pooling: str = "mean"
    ) -> None:
        super().__init__()
        where = type(self).__name__
        _check_config(where, config, causal=False, kind="an encoder")
        self.num_classes = check_positive_int(where, "num_classes", num_classes)
        self.pooling = check_choice(where, "pooling", pooling, ("mean", "first"))
        check_model_fits(where, config, num_classes=num_classes)
        self.config = config
        self.backbone = TransformerBackbone(config, where=where)
        self.head = nn.Linear(config.d_model, num_classes)
        init_weights(self.head, config)

    batch_input = staticmethod(TransformerLM.batch_input)  # idx and padding_mask, as the LM

    def forward(
        self, idx: torch.Tensor, *, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits ``(B, num_classes)`` of token ids ``idx: (B, T)``.

        Padding tokens (``padding_mask`` False) change neither attention nor the mean.
        """
        where = type(self).__name__
        check_tokens(where, "idx", idx, ndim=2, vocab_size=self.config.vocab_size, in_forward=True)
        _check_padding_mask(where, padding_mask, idx)
        h = self.backbone(idx, padding_mask=padding_mask)
        if self.pooling == "first":
            pooled = h[:, 0]
        elif padding_mask is None:
            pooled = h.mean(dim=1)
        else:
            m = padding_mask[..., None].to(h.dtype)
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


# --------------------------------------------------------------------------- pixels
class PixelTransformer(nn.Module):
    """Autoregressive model of flattened images: ``p(x) = prod_t p(x_t | x_<t)``.

    The input sequence is ``[s, x_0, ..., x_{N-2}]`` with ``s`` a learned start embedding, so
    ``logits[:, t]`` predicts pixel (sub-pixel) ``x_t`` for every ``t``, the first included.
    ``vocab_size`` is the number of intensity levels (17 for 8x8 digits, 256 for CIFAR-10).
    The flattening order is the caller's (e.g. raster order, channels last).

    Args:
        config: a causal :class:`TransformerConfig` with ``max_seq_len >= prod(image_shape)``.
        image_shape: e.g. ``(8, 8)`` or ``(3, 32, 32)``; ``N = prod(image_shape)``.

    Example:
        >>> from aftlab.models import PixelTransformer, TransformerConfig
        >>> cfg = TransformerConfig(vocab_size=17, d_model=32, n_layers=2, n_heads=4,
        ...                         max_seq_len=64)
        >>> model = PixelTransformer(cfg, image_shape=(8, 8))
        >>> model.sample(2, temperature=1.0).shape
        torch.Size([2, 64])
    """

    def __init__(self, config: TransformerConfig, *, image_shape: Sequence[int]) -> None:
        super().__init__()
        where = type(self).__name__
        _check_config(where, config, causal=True, kind="an autoregressive model")
        if not isinstance(image_shape, Sequence) or not image_shape:
            raise TypeError(
                f"{where}: 'image_shape' must be a non-empty sequence of ints, got {image_shape!r}"
            )
        for i, s in enumerate(image_shape):
            check_positive_int(where, f"image_shape[{i}]", s)
        self.image_shape = tuple(image_shape)
        self.num_pixels = math.prod(self.image_shape)
        if self.num_pixels > config.max_seq_len:
            raise ValueError(
                f"{where}: image_shape {self.image_shape} has {self.num_pixels} (sub-)pixels, more "
                f"than config.max_seq_len = {config.max_seq_len}"
            )
        check_model_fits(where, config)
        self.config = config
        self.backbone = TransformerBackbone(config, where=where)
        self.start = nn.Parameter(torch.randn(config.d_model) * 0.02)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.backbone.token_embedding.weight
        else:
            init_weights(self.head, config)

    def _flatten(self, pixels: torch.Tensor, *, in_forward: bool = True) -> torch.Tensor:
        """``pixels`` checked (ids read on every device unless ``in_forward``: ``check_tokens``)
        and flattened to ``(B, T)``."""
        where = type(self).__name__
        is_image = len(self.image_shape) > 1 and isinstance(pixels, torch.Tensor)
        if is_image and pixels.dim() == 1 + len(self.image_shape):
            if tuple(pixels.shape[1:]) != self.image_shape:
                raise ValueError(
                    f"{where}: 'pixels' must have shape (B, N) or (B, *{self.image_shape}), "
                    f"got {tuple(pixels.shape)}"
                )
            pixels = pixels.flatten(1)
        V = self.config.vocab_size
        check_tokens(where, "pixels", pixels, ndim=2, vocab_size=V, in_forward=in_forward)
        if pixels.shape[1] > self.num_pixels:
            raise ValueError(
                f"{where}: 'pixels' must have at most N = {self.num_pixels} positions, "
                f"got shape {tuple(pixels.shape)}"
            )
        return pixels

    @staticmethod
    def batch_input(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The arguments of :meth:`forward` for a task batch: the pixels, ``batch["target"]``.

        A pixel task's ``input`` is the pixels shifted right after a constant 0; this model
        feeds its learned start token instead, so it reads the pixels themselves.
        """
        return {"pixels": batch["target"]}

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` for ``pixels: (B, T)`` (``T <= N``) or ``(B, *image_shape)``.

        ``logits[:, t]`` is the distribution of ``pixels[:, t]`` given ``pixels[:, :t]``.
        """
        pixels = self._flatten(pixels)
        return self.head(self.backbone.forward_embeddings(self._inputs(pixels)))

    def _inputs(self, pixels: torch.Tensor) -> torch.Tensor:
        """Embeddings fed for ``pixels (B, T)``: the start token, then ``pixels[:, :-1]``."""
        emb = self.backbone.token_embedding(pixels[:, :-1])
        return torch.cat([self.start.to(emb.dtype).expand(len(pixels), 1, -1), emb], dim=1)

    def bits_per_dim(self, pixels: torch.Tensor) -> torch.Tensor:
        """Bits per (sub-)pixel ``-(1/N) sum_t log2 p(x_t | x_<t)``: ``(B,)``."""
        pixels = self._flatten(pixels)
        logits = self(pixels)
        nll = F.cross_entropy(logits.transpose(1, 2).float(), pixels, reduction="none")
        return nll.mean(dim=1) / math.log(2.0)

    init_cache = TransformerLM.init_cache  # the backbone's, as the LM's

    def prefill(
        self, pixels: torch.Tensor, *, logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, DecodingCache]:
        """Feed known pixels ``(B, T)`` in one parallel pass: ``forward(pixels)``'s logits (the
        last ``logits_to_keep`` positions; 0: all) and the cache at position ``T``.

        The pass reads the start token and ``pixels[:, :-1]``; the next :meth:`step` feeds
        ``pixels[:, -1]`` and returns the logits of pixel ``T``.
        """
        check_positive_int(type(self).__name__, "logits_to_keep", logits_to_keep, allow_zero=True)
        return self._prefill(self._flatten(pixels, in_forward=False), logits_to_keep)

    def _prefill(
        self, pixels: torch.Tensor, logits_to_keep: int
    ) -> tuple[torch.Tensor, DecodingCache]:
        """:meth:`prefill` of checked ``pixels: (B, T)``."""
        h, cache = self.backbone.prefill_embeddings(self._inputs(pixels))
        return self.head(_last(h, logits_to_keep)), cache

    def step(self, pixels: torch.Tensor | None, cache: DecodingCache) -> torch.Tensor:
        """Feed the previous pixel ``(B,)`` (``None`` at position 0: the start token).

        Returns:
            ``(B, vocab_size)`` logits of pixel ``cache.position`` (before the call).
        """
        where = type(self).__name__
        if cache.position >= self.num_pixels:
            raise ValueError(f"{where}: all N = {self.num_pixels} pixels have been decoded")
        if cache.position == 0:
            if pixels is not None:
                raise ValueError(f"{where}: the first step takes pixels=None (the start token)")
            h = self.start.expand(cache.batch_size, -1)
        else:
            check_tokens(where, "pixels", pixels, ndim=1, vocab_size=self.config.vocab_size)
            h = self.backbone.token_embedding(pixels)
        return self.head(self.backbone.step_embeddings(h, cache))

    @torch.no_grad()
    def sample(
        self,
        batch_size: int,
        *,
        prefix: torch.Tensor | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``batch_size`` images pixel by pixel, optionally completing a known ``prefix``.

        Args:
            batch_size: ``B``.
            prefix: ``(B, T0)`` known first pixels (``T0 <= N``), or None.
            temperature, top_k, top_p, generator: as in :meth:`TransformerLM.generate`.

        Returns:
            ``(B, N)`` long; ``.view(B, *image_shape)`` restores the images.
        """
        where = f"{type(self).__name__}.sample"
        check_positive_int(where, "batch_size", batch_size)
        check_sampling_args(
            where,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            vocab_size=self.config.vocab_size,
        )
        known = 0
        if prefix is not None:
            prefix = self._flatten(prefix)
            if prefix.shape[0] != batch_size:
                raise ValueError(
                    f"{where}: 'prefix' must have shape ({batch_size}, T0), "
                    f"got {tuple(prefix.shape)}"
                )
            known = prefix.shape[1]
        if known == self.num_pixels:
            return prefix.clone()
        out: list[torch.Tensor] = []
        prev = None
        if known:  # the start token and the prefix but its last pixel, in one parallel pass
            _, cache = self._prefill(prefix, 1)
            out, prev = list(prefix.unbind(1)), prefix[:, -1]
        else:
            cache = self.init_cache(batch_size)
        out += generation.draw_tokens(
            self, self.step(prev, cache), cache, self.num_pixels - known,
            temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
        )
        return torch.stack(out, dim=1)
