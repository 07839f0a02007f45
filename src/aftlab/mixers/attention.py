"""Multi-head attention mixers: ``"attention"`` (fused SDPA) and ``"attention-naive"`` (einsum).

Both compute, for each head ``h`` with per-head width ``m`` (batch-first, ``x: (B, T, d)``)::

    Q_h = x W_h^Q,  K_h = x W_h^K,  V_h = x W_h^V                  (B, T, m)
    A_h = softmax_s( s * Q_h K_h^T + M )                           (B, T, T), rows sum to 1
    y   = concat_h(A_h V_h) W^O                                    (B, T, d)

with ``s = 1/sqrt(m)`` when ``scaled`` (else ``s = 1``, the definition's form) and ``M`` the
additive mask: ``-inf`` where key ``t'`` is padding or (causal) ``t' > t``. A query with no
allowed key outputs 0. A NaN or inf reaches exactly the outputs that see it, never an earlier
one (:func:`_nan_outputs`). With ``rotary``, ``Q_h`` and ``K_h`` are rotated by their
positions before the product (RoPE, :func:`apply_rotary`), so ``A_h`` depends only on ``t - t'``.

Continuing a :class:`KVCache` of ``L`` tokens (``prefill(x, cache)``), the ``T`` new queries
attend to the ``L`` cached keys and their own (``M`` causal among the new ones), rotated at
positions ``L .. L + T - 1``. Packed documents (``cu_seqlens``) are one call with a
block-diagonal ``M`` (``t'`` in ``t``'s document, ``t' <= t`` when causal) and rotary positions
from 0 in each document; a non-finite entry reaches only the outputs of its own document.

``"attention"`` calls :func:`torch.nn.functional.scaled_dot_product_attention` (flash /
memory-efficient kernels where available); ``"attention-naive"`` is the same module computing
``A_h`` explicitly with einsum + softmax: the reference the fast path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_positive_int
from .base import GROWS, SequenceMixer, document_positions, mark_residual_projection
from .registry import register_mixer

__all__ = [
    "MultiHeadAttention",
    "NaiveMultiHeadAttention",
    "KVCache",
    "apply_rotary",
    "rotary_angles",
]


def rotary_angles(
    positions: torch.Tensor,
    head_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles ``theta_{p,i} = p * base^(-2i/m)``.

    Args:
        positions: integer positions ``p``, shape ``(T,)``.
        head_dim: per-head width ``m`` (even).
        base: the RoPE base (10000 in Su et al. 2021).
        dtype: floating dtype of the result (default float32).

    Returns:
        ``(cos, sin)``, each ``(T, m)``: the ``m/2`` angles repeated twice (half-split layout).
    """
    dtype = dtype or torch.float32
    work = torch.float64 if dtype == torch.float64 else torch.float32
    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=work)
    inv_freq = base ** (-i / head_dim)  # (m/2,)
    theta = positions.to(work)[:, None] * inv_freq[None, :]  # (T, m/2)
    theta = torch.cat((theta, theta), dim=-1)  # (T, m)
    return theta.cos().to(dtype), theta.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: (..., T, m)`` pairwise: ``x' = x * cos(theta) + rotate_half(x) * sin(theta)``.

    The pairs are ``(x_i, x_{i+m/2})`` (the half-split layout of GPT-NeoX / Llama), with
    ``rotate_half(x) = concat(-x[..., m/2:], x[..., :m/2])``. ``cos``, ``sin``: ``(T, m)``.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _nonfinite_rows(qkv: torch.Tensor) -> torch.Tensor:
    """Which rows of the fused projection ``qkv: (B, T, 3 H m)`` hold a NaN or inf: ``(B, T, 3)``.

    Column 0 is the query ``q_t`` (all heads), 1 the key ``k_t``, 2 the value ``v_t``.
    ``(qkv * 0).sum`` is 0 for a finite row and NaN otherwise (``0 * inf = NaN``): exact, one
    product and one sum.
    """
    B, T, three_inner = qkv.shape
    return (qkv.detach() * 0).view(B, T, 3, three_inner // 3).sum(dim=-1).isnan()


def _nan_outputs(
    bad: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """The outputs the attention formula makes NaN, from :func:`_nonfinite_rows`: ``(B, T, 1)``.

    The rule: no value, NaN included, flows from a position into an output that cannot see it.
    The formula gives output ``i`` NaN exactly when its query, or a key or value it attends to,
    is not finite::

        nan_i = qbad_i  or  any_{t in keys(i)} (kbad_t or vbad_t)

    with ``keys(i)`` the keys query ``i`` may see: real (``padding_mask`` True) and, when causal,
    ``t <= i`` (a cumulative any). A dense product does worse: a masked score ``-inf + NaN`` and
    a zero weight ``0 * NaN`` are NaN, so a non-finite ``k_j`` or ``v_j`` would reach every
    query, earlier ones included. So the mixer attends over ``nan_to_num(qkv)`` (non-finite
    entries 0; the gradient there is 0) and sets the outputs ``nan_i`` to NaN afterwards: every
    other output, and the gradient it sends back, is exactly what it would be without the bad
    rows (a parameter's gradient, a sum over all positions, still sees them). A non-finite key or
    value at a padded position changes no output, as any other padded value. Per position, not
    per head: the output projection mixes the heads, so one NaN head makes the whole output row
    NaN anyway. O(B T d) elementwise work, no host sync.
    """
    qbad, kvbad = bad[..., 0], bad[..., 1] | bad[..., 2]
    seen = kvbad if padding_mask is None else kvbad & padding_mask
    seen = seen.cumsum(dim=-1) > 0 if causal else seen.any(dim=-1, keepdim=True)
    return (qbad | seen)[..., None]


@dataclass
class KVCache:
    """Decoding state of :class:`MultiHeadAttention`: the keys and values seen so far.

    The buffers grow by doubling when full (amortised O(1) copies per token), so memory is
    proportional to the decoded length, not to ``max_seq_len``.

    Attributes:
        k: keys ``(B, H, capacity, m)`` (rotated when the mixer is rotary); slots
            ``[0, length)`` are filled.
        v: values ``(B, H, capacity, m)``.
        length: tokens seen so far, which is also the position of the next token.
    """

    k: torch.Tensor = field(metadata={GROWS: (2,)})
    v: torch.Tensor = field(metadata={GROWS: (2,)})
    length: int = 0

    @classmethod
    def from_prefix(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """The cache after the ``T`` tokens ``k, v: (B, H, T, m)``, ``T >= 1``.

        The capacity is the one ``T`` calls of :meth:`append` reach from 16 (16 doubled until it
        holds ``T``), so a prefilled cache and a stepped one grow alike.
        """
        B, H, T, m = k.shape
        cap = 16
        while cap < T:
            cap *= 2
        kk, vv = k.new_zeros(B, H, cap, m), v.new_zeros(B, H, cap, m)
        kk[:, :, :T], vv[:, :, :T] = k, v
        return cls(k=kk, v=vv, length=T)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token's ``k, v: (B, H, 1, m)`` at slot ``length``, growing if needed."""
        cap = self.k.shape[2]
        if self.length == cap:
            new_cap = max(2 * cap, 16)
            grow = (*self.k.shape[:2], new_cap - cap, self.k.shape[3])
            self.k = torch.cat((self.k, self.k.new_zeros(grow)), dim=2)
            self.v = torch.cat((self.v, self.v.new_zeros(grow)), dim=2)
        self.k[:, :, self.length] = k[:, :, 0]
        self.v[:, :, self.length] = v[:, :, 0]
        self.length += 1


@register_mixer("attention")
class MultiHeadAttention(SequenceMixer):
    """Multi-head (self-)attention as a sequence mixer, on the SDPA fast path.

    Formula in the module docstring. The projections are one fused ``qkv: d -> 3 H m`` (the
    layout of GPT-2's ``c_attn``: all query heads, then keys, then values) and
    ``out_proj: H m -> d`` (marked a residual projection); dropout (``dropout``) is applied to
    the output. No parameters beyond these linear layers (the init hook does nothing).

    Args:
        head_dim: per-head width ``m``; default ``d_model // n_heads``. ``n_heads * head_dim``
            may differ from ``d_model``.
        scaled: multiply logits by ``1/sqrt(m)`` (True, the paper's scaled dot product) or not.
        rotary: rotate queries and keys by their positions (RoPE); needs an even ``head_dim``.
        rotary_base: the RoPE base.
        **common: ``d_model``, ``n_heads``, ``causal``, ``max_seq_len``, ``dropout``, ``bias``
            (see :class:`~aftlab.mixers.SequenceMixer`). Attention has no maximum length of its
            own: ``max_seq_len`` is accepted and not enforced.

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``.
        ``prefill``: ``x (B, T, d)`` and the :class:`KVCache` of ``L`` tokens (or None) ->
        ``(B, T, d)`` and the :class:`KVCache` after the ``L + T`` tokens (one pass).
        ``cu_seqlens``: ``x (1, T, d)`` -> ``(1, T, d)``, one pass with a block-diagonal mask.
        ``step``: ``x (B, d)`` and a :class:`KVCache` -> ``(B, d)`` and the cache.

    Example:
        >>> import torch
        >>> from aftlab.mixers import build_mixer
        >>> attn = build_mixer("attention", d_model=32, n_heads=4, causal=True)
        >>> attn(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    config_options = ("head_dim", "scaled", "rotary")

    def __init__(
        self,
        *,
        head_dim: int | None = None,
        scaled: bool = True,
        rotary: bool = False,
        rotary_base: float = 10000.0,
        **common,
    ) -> None:
        super().__init__(**common)
        where = type(self).__name__
        if head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"{where}: 'n_heads' = {self.n_heads} must divide d_model = {self.d_model} "
                    "when 'head_dim' is not given (or pass head_dim explicitly)"
                )
            head_dim = self.d_model // self.n_heads
        self.head_dim = check_positive_int(where, "head_dim", head_dim)
        if rotary and head_dim % 2:
            raise ValueError(f"{where}: 'head_dim' must be even for rotary=True, got {head_dim}")
        if not float(rotary_base) > 0:
            raise ValueError(f"{where}: 'rotary_base' must be > 0, got {rotary_base}")
        self.scaled = bool(scaled)
        self.rotary = bool(rotary)
        self.rotary_base = float(rotary_base)
        inner = self.n_heads * self.head_dim
        self.qkv = nn.Linear(self.d_model, 3 * inner, bias=self.bias)
        self.out_proj = mark_residual_projection(nn.Linear(inner, self.d_model, bias=self.bias))
        self.drop = nn.Dropout(self.dropout_p)

    @property
    def scale(self) -> float:
        """The logit scale ``s``: ``1/sqrt(m)`` when ``scaled``, else 1."""
        return self.head_dim**-0.5 if self.scaled else 1.0

    # ------------------------------------------------------------------ pieces
    def _split(
        self, qkv: torch.Tensor, pos: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv: (B, T, 3 H m)`` -> ``Q, K, V: (B, H, T, m)``; rotary at positions ``pos (T,)``
        (unused without rotary)."""
        B, T, _ = qkv.shape
        q, k, v = (
            t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
        )
        if self.rotary:
            cos, sin = rotary_angles(pos, self.head_dim, base=self.rotary_base, dtype=q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, m)`` -> ``dropout(concat_h(y_h) W^O)``: ``(B, T, d)``."""
        B, _, T, _ = y.shape
        return self.drop(
            self.out_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        )

    def _masks(
        self, T: int, padding_mask: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Allowed (query, key) pairs and which queries have any allowed key.

        Returns:
            ``(allowed, has_key)``: ``allowed`` is bool ``(B|1, 1, T, T)`` (None when every pair
            is allowed, or when only the causal mask applies and the fast path handles it),
            made safe: a row with no allowed key allows every key, and ``has_key (B, 1, T, 1)``
            zeroes that query's output afterwards (0 rather than the NaN of an empty softmax;
            the gradient through that row is 0 too).
        """
        if padding_mask is None:
            return None, None
        allowed = padding_mask[:, None, None, :]  # (B, 1, 1, T)
        if self.causal:
            allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=device).tril()
        else:
            allowed = allowed.expand(-1, -1, T, -1)
        has_key = allowed.any(dim=-1, keepdim=True)
        return allowed | ~has_key, has_key

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """``softmax(s Q K^T + M) V`` per head: ``q (B, H, T, m)``, ``k, v (B, H, S, m)``.

        ``causal`` (only with ``T == S``) masks ``t' > t``; ``allowed`` masks the rest.
        """
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=causal and allowed is None, scale=self.scale
        )

    # ------------------------------------------------------------------ interface

    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Attend over ``x: (B, T, d)``; padded keys (``padding_mask`` False) are ignored.

        Args:
            x: ``(B, T, d)``.
            padding_mask: bool ``(B, T)``, True for real tokens.

        Returns:
            ``(B, T, d)``. A query whose allowed keys are all padding outputs zeros; one that
            sees a non-finite query, key or value outputs NaN, and only those
            (:func:`_nan_outputs`).
        """
        return self._mix(x, padding_mask)[0]

    def _prefill(
        self, x: torch.Tensor, state: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        """``x: (B, T, d)`` after the ``L`` tokens of ``state`` (None: none), in one pass.

        The chunk's queries attend to the cached keys and their own (causal among themselves),
        rotary at positions ``L .. L + T - 1``: ``y`` is rows ``L ..`` of the forward on the
        whole sequence (from an empty cache, :meth:`_forward`'s bit for bit). Returns ``y`` and
        the :class:`KVCache` of all ``L + T`` tokens (their rotated keys and values from the same
        pass), as ``T`` more calls of :meth:`step` leave it; ``state`` is not modified.
        """
        out, qkv, pos = self._mix(x, None, state)
        return out, self._cache_after(state, qkv, pos)

    def _documents(
        self, x: torch.Tensor, offsets: list[int], state: KVCache | None, return_state: bool
    ) -> torch.Tensor | tuple[torch.Tensor, KVCache]:
        """Packed documents in one pass: a block-diagonal (causal) mask, rotary positions from
        0 in each document (from ``L`` in the first, which continues ``state``); the cache
        returned holds the last document's keys (after ``state``'s when it is the first)."""
        out, qkv, pos = self._mix(x, None, state, offsets)
        if not return_state:
            return out
        docs = [(a, b) for a, b in zip(offsets, offsets[1:], strict=False) if b > a]
        a = docs[-1][0]
        first = state if a == docs[0][0] else None
        return out, self._cache_after(first, qkv[:, a:], None if pos is None else pos[a:])

    def _cache_after(
        self, state: KVCache | None, qkv: torch.Tensor, pos: torch.Tensor | None
    ) -> KVCache:
        """The :class:`KVCache` of ``state``'s tokens, then those of ``qkv: (B, T, 3 H m)``
        (rotated at ``pos``); non-finite keys are kept, as stepping keeps them."""
        _, k, v = self._split(qkv, pos)
        if state is not None and state.length:
            L = state.length
            k = torch.cat((state.k[:, :, :L], k), dim=2)
            v = torch.cat((state.v[:, :, :L], v), dim=2)
        return KVCache.from_prefix(k, v)

    def _mix(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cache: KVCache | None = None,
        offsets: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_forward`'s output, after ``cache`` and for the documents at ``offsets``.

        Returns ``(out, qkv, pos)``: the output ``(B, T, d)``, the projections
        ``qkv: (B, T, 3 H m)`` it came from and the tokens' positions ``pos: (T,)`` (rotary;
        None for a mixer without rotary and without documents). Without a cache or documents
        the mask is the padding's (or ``is_causal``); otherwise ``padding_mask`` is None (the
        public ``forward`` refuses it) and the mask is explicit: :meth:`_chunk_mask`.
        """
        T, L = x.shape[1], 0 if cache is None else cache.length
        qkv = self.qkv(x)
        # a NaN or inf reaches only the outputs that see it (_nan_outputs)
        bad = _nonfinite_rows(qkv)
        if offsets is None or not T:
            doc, pos = None, torch.arange(L, L + T, device=x.device) if self.rotary else None
        else:
            doc, pos = document_positions(offsets, x.device, start=L)
        q, k, v = self._split(torch.nan_to_num(qkv, nan=0.0, posinf=0.0, neginf=0.0), pos)
        if doc is None and not L:
            allowed, has_key = self._masks(T, padding_mask, x.device)
            out = self._output(self._attend(q, k, v, allowed, self.causal))
            nan = _nan_outputs(bad, padding_mask, self.causal)
        else:
            has_key = None
            allowed = self._chunk_mask(T, L, doc, x.device)  # (T, L + T)
            kvbad = bad[..., 1] | bad[..., 2]
            if L:
                ck, cv = cache.k[:, :, :L], cache.v[:, :, :L]
                cbad = ~(ck.isfinite().all(-1) & cv.isfinite().all(-1)).all(1)  # (B, L)
                k = torch.cat((torch.nan_to_num(ck, nan=0.0, posinf=0.0, neginf=0.0), k), 2)
                v = torch.cat((torch.nan_to_num(cv, nan=0.0, posinf=0.0, neginf=0.0), v), 2)
                kvbad = torch.cat((cbad, kvbad), 1)
            out = self._output(self._attend(q, k, v, allowed, False))
            nan = (bad[..., 0] | (allowed & kvbad[:, None, :]).any(-1))[..., None]
        out = torch.where(nan, float("nan"), out)
        if has_key is not None:
            out = out.masked_fill(~has_key[:, 0], 0.0)
        return out, qkv, pos

    def _chunk_mask(
        self, T: int, L: int, doc: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """Allowed (query, key) pairs of ``T`` queries over ``L`` cached keys and their own:
        bool ``(T, L + T)``.

        Query ``t`` sees key ``t'`` of the chunk when both are in the same document (``doc``,
        ``(T,)``; None: one document) and, when causal, ``t' <= t``; it sees the cached keys
        when it is in the first document (which continues the cache). Every query sees itself.
        """
        if doc is None:
            same = torch.ones(T, T, dtype=torch.bool, device=device)
            first = same[:, :1]
        else:
            same, first = doc[:, None] == doc[None, :], (doc == doc[0])[:, None]
        if self.causal:
            same = same & torch.ones(T, T, dtype=torch.bool, device=device).tril()
        return torch.cat((first.expand(T, L), same), 1) if L else same

    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences."""
        k = torch.zeros(batch_size, self.n_heads, 16, self.head_dim, device=device, dtype=dtype)
        return KVCache(k=k, v=torch.zeros_like(k), length=0)

    def _step(self, x: torch.Tensor, state: KVCache) -> tuple[torch.Tensor, KVCache]:
        """Attend from one token ``x: (B, d)`` at position ``state.length`` to all tokens so far.

        The token's key and value are appended to ``state`` (in place).

        Returns:
            ``(y, state)`` with ``y: (B, d)``.
        """
        pos = torch.full((1,), state.length, device=x.device) if self.rotary else None
        q, k, v = self._split(self.qkv(x[:, None, :]), pos)
        state.append(k, v)
        L = state.length
        y = self._attend(q, state.k[:, :, :L], state.v[:, :, :L], None, False)
        return self._output(y)[:, 0], state

    def extra_repr(self) -> str:
        opts = f"head_dim={self.head_dim}, scaled={self.scaled}, rotary={self.rotary}"
        return f"{super().extra_repr()}, {opts}"


@register_mixer("attention-naive")
class NaiveMultiHeadAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` computed explicitly: the reference of the SDPA fast path.

    ``A_h = softmax(s Q_h K_h^T + M)`` is materialised with einsum (``(B, H, T, T)``) and
    ``y_h = A_h V_h``; same parameters, options and state as ``"attention"``.
    """

    reference = True

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """``softmax(s Q K^T + M) V`` materialised; shapes as in ``MultiHeadAttention._attend``."""
        scores = torch.einsum("bhtm,bhsm->bhts", q, k) * self.scale  # s Q K^T: (B, H, T, S)
        if causal:
            T, S = scores.shape[-2:]
            tril = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
            allowed = tril if allowed is None else allowed & tril
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        # each row sums to 1 over allowed keys; fp16/bf16 reduce in fp32
        probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        probs = probs.to(v.dtype)
        return torch.einsum("bhts,bhsm->bhtm", probs, v)
