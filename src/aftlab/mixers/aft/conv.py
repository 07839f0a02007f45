r"""The ``aft-conv`` mixer: AFT-conv-h-s (Zhai et al. 2021), 1-D (causal or not) or on a grid.

``Q = X W^Q`` and ``V = X W^V`` are split into ``h`` heads of ``c = d / h`` channels; the key
``K = X W^K`` has one channel per head (``key_dim = h``), broadcast over the head's channels.
Per head, the op is :func:`aftlab.functional.aft_conv` (or :func:`~aftlab.functional.aft_conv2d`
when ``grid`` is set) with the paper's reparameterised kernel

.. math::

    w^i = \gamma^i \frac{\hat w^i - \mathrm{mean}(\hat w^i)}{\mathrm{std}(\hat w^i)}
          + \beta^i,

``gamma`` and ``beta`` initialised to 0 (so the mixer starts as AFT-simple and learns its kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import check_positive_int
from ...ops.aft_conv import _aft_conv, _aft_conv2d
from ..registry import register_mixer
from .common import AFTMixer

__all__ = ["AFTConvMixer", "AFTConvState"]


@dataclass
class AFTConvState:
    """Decoding state of a causal :class:`AFTConvMixer` at position ``pos``.

    Attributes:
        log_sum: ``(B, h)`` float64, ``L = log sum_{t' <= pos - s} e^{K_t'}`` over the tokens
            that have left the kernel footprint (``-inf`` while there are none).
        avg: ``(B, h, c)``, ``A = sum_{t' <= pos - s} e^{K_t' - L} V_t'`` (a convex combination).
        k_buf: ``(B, s, h)`` float64 ring buffer of the last ``s`` keys (slot ``t' % s``).
        v_buf: ``(B, s, h, c)`` ring buffer of the last ``s`` values.
        pos: number of tokens consumed so far.
    """

    log_sum: torch.Tensor
    avg: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    pos: int = 0


@register_mixer("aft-conv")
class AFTConvMixer(AFTMixer):
    """AFT-conv token mixer (``h = n_heads`` heads, kernel size ``s``).

    Args:
        kernel_size: ``s``; must be odd unless ``causal`` (the kernel is centred).
        grid: ``(H, W)``: treat a sequence of length ``H * W`` as an image in raster order and use
            the 2-D op with an ``s x s`` kernel (non-causal only). ``None``: 1-D.
        **common: ``d_model``, ``n_heads`` (must divide ``d_model``), ``causal``, ``dropout``,
            ``bias``, ``max_seq_len`` (unused: any length works).

    Shapes:
        ``forward``: ``x (B, T, d_model)``, ``padding_mask (B, T)`` -> ``(B, T, d_model)``;
        ``step``: ``x (B, d_model)`` -> ``(B, d_model)``, ``O(s d)`` per token.

    Example:
        >>> from aftlab.mixers import build_mixer
        >>> m = build_mixer("aft-conv", d_model=32, n_heads=4, causal=True, kernel_size=7)
        >>> m(torch.randn(2, 10, 32)).shape
        torch.Size([2, 10, 32])
    """

    options_from_task = ("grid",)
    test_options = {"kernel_size": 3}

    def __init__(
        self, *, kernel_size: int = 31, grid: tuple[int, int] | None = None, **common
    ) -> None:
        super().__init__(key_dim=common.get("n_heads", 1), **common)
        where = type(self).__name__
        h, d = self.n_heads, self.d_model
        if d % h:
            raise ValueError(f"{where}: n_heads={h} must divide d_model={d}")
        s = check_positive_int(where, "kernel_size", kernel_size)
        if not self.causal and s % 2 == 0:
            raise ValueError(
                f"{where}: a non-causal kernel is centred, so 'kernel_size' must be odd, got {s}"
            )
        if grid is not None:
            if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
                raise ValueError(f"{where}: 'grid' must be a pair (H, W), got {grid!r}")
            grid = (
                check_positive_int(where, "grid[0]", grid[0]),
                check_positive_int(where, "grid[1]", grid[1]),
            )
            if self.causal:
                raise ValueError(
                    f"{where}: 'grid' {grid} (2-D AFT-conv) is non-causal only; got causal=True"
                )
        self.kernel_size, self.grid = s, grid
        shape = (h, s) if grid is None else (h, s, s)
        stat_shape = (h,) + (1,) * (len(shape) - 1)
        self.weight = nn.Parameter(torch.empty(shape))  # the paper's raw w^i
        self.gamma = nn.Parameter(torch.empty(stat_shape))
        self.beta = nn.Parameter(torch.empty(stat_shape))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The kernel's init hook: raw ``w ~ N(0, 1)``, ``gamma = beta = 0`` (kernel 0: the mixer
        starts as AFT-simple)."""
        nn.init.normal_(self.weight)
        nn.init.zeros_(self.gamma)
        nn.init.zeros_(self.beta)

    def kernel(self) -> torch.Tensor:
        """The reparameterised kernel ``w^i = gamma^i (w^i - mean(w^i)) / std(w^i) + beta^i``.

        Mean and (biased) standard deviation are over each head's ``s`` (or ``s x s``) entries;
        ``std`` is ``sqrt(var + 1e-5)`` so that ``s = 1`` is well defined. Returns ``(h, s)`` or
        ``(h, s, s)``.
        """
        dims = tuple(range(1, self.weight.dim()))
        mean = self.weight.mean(dims, keepdim=True)
        var = self.weight.var(dims, keepdim=True, correction=0)
        return self.gamma * (self.weight - mean) * torch.rsqrt(var + 1e-5) + self.beta

    def _heads(self, q, k, v):
        h = self.n_heads
        c = self.d_model // h
        w = self.kernel()
        dt = torch.promote_types(q.dtype, w.dtype)  # under autocast q is bf16/fp16, w float32
        lead = q.shape[:-1]
        return (
            q.reshape(*lead, h, c).to(dt),
            k.reshape(*lead, h, 1).to(dt),
            v.reshape(*lead, h, c).to(dt),
            w.to(dt),
        )

    def _mix(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: (B, T, d_model)`` -> ``(B, T, d_model)``; ``padding_mask: (B, T)``, True = real.

        Also returns the keys ``(B, T, h)`` and values ``(B, T, h, c)`` by head.
        """
        B, T, d = x.shape
        q, k, v, w = self._heads(*self.project(x))
        if self.grid is None:
            y = _aft_conv(q, k, v, w, causal=self.causal, padding_mask=padding_mask)
        else:
            H, W = self.grid
            if T != H * W:
                raise ValueError(
                    f"{type(self).__name__}: sequence length {T} of 'x' {tuple(x.shape)} must "
                    "equal "
                    f"H * W = {H * W} for grid {self.grid}"
                )
            grid_mask = None if padding_mask is None else padding_mask.reshape(B, H, W)
            y = _aft_conv2d(
                *(t.reshape(B, H, W, *t.shape[2:]) for t in (q, k, v)), w, padding_mask=grid_mask
            )
        return self.output(y.reshape(B, T, d).to(x.dtype), padding_mask), k[..., 0], v

    def _state_after(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AFTConvState:
        """The decoding state after a prompt's keys ``k (B, T, h)`` and values ``v (B, T, h, c)``.

        The state is in ``x``'s dtype (as in :meth:`init_state`). The ring buffers hold tokens
        ``max(0, T - s) .. T - 1`` (slot ``t' mod s``); over the tokens ``t' < T - s`` that left
        the footprint, ``L = logsumexp_t' K_t'`` and ``A = sum_t' e^{K_t' - L} V_t'``, reduced
        in one pass.
        """
        B, T, _ = k.shape
        s = self.kernel_size
        state = self._init_state(B, k.device, x.dtype)
        cdt = state.v_buf.dtype
        k, v = k.to(torch.float64), v.to(cdt)
        gone = max(0, T - s)
        if gone:
            state.log_sum = torch.logsumexp(k[:, :gone], dim=1)
            weight = torch.exp(k[:, :gone] - state.log_sum[:, None]).to(cdt)
            state.avg = (weight[..., None] * v[:, :gone]).sum(1)
        kept = torch.arange(gone, T, device=k.device)
        state.k_buf[:, kept % s], state.v_buf[:, kept % s] = k[:, gone:], v[:, gone:]
        state.pos = T
        return state

    # ----------------------------------------------------------------- decoding
    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> AFTConvState:
        """Empty state: no tokens outside the footprint (``L = -inf``), an empty ring buffer."""
        B = batch_size
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        h, s = self.n_heads, self.kernel_size
        c = self.d_model // h
        f64 = dict(device=device, dtype=torch.float64)
        return AFTConvState(
            log_sum=torch.full((B, h), float("-inf"), **f64),
            avg=torch.zeros(B, h, c, device=device, dtype=cdt),
            k_buf=torch.zeros(B, s, h, **f64),
            v_buf=torch.zeros(B, s, h, c, device=device, dtype=cdt),
        )

    def _step(self, x: torch.Tensor, state: AFTConvState) -> tuple[torch.Tensor, AFTConvState]:
        r"""One token at position ``t = state.pos``; equals row ``t`` of the causal :meth:`forward`.

        Evicts token ``t - s`` from the ring buffer into the running sums
        (``L <- logaddexp(L, K_{t-s})``, ``A <- e^{L_old - L} A + e^{K_{t-s} - L} V_{t-s}``),
        stores token ``t``, then
        ``Y_t = sigma(Q_t) [e^{L-m} A + sum_j e^{K_{t-s+1+j} + w_{j+1} - m} V] /
        [e^{L-m} + sum_j e^{K + w - m}]`` with ``m`` the maximum exponent: ``O(s d)`` work.
        """
        B = x.shape[0]
        s, t = self.kernel_size, state.pos
        q, k, v, w = self._heads(*self.project(x))  # (B, h, c), (B, h, 1), (B, h, c), (h, s)
        cdt = state.v_buf.dtype
        k = k[..., 0].to(torch.float64)
        slot = t % s
        if t >= s:  # token t - s leaves the footprint: merge it into the running sums
            k_old, v_old = state.k_buf[:, slot], state.v_buf[:, slot]
            L = torch.logaddexp(state.log_sum, k_old)
            a_old = torch.exp(state.log_sum - L).to(cdt)[..., None]
            state.avg = a_old * state.avg + torch.exp(k_old - L).to(cdt)[..., None] * v_old
            state.log_sum = L
        state.k_buf[:, slot] = k
        state.v_buf[:, slot] = v.to(cdt)
        # slot r holds position t - age, age = (t - r) mod s, acted on by kernel entry s - 1 - age
        age = (t - torch.arange(s, device=x.device)) % s
        j = s - 1 - age
        logits = state.k_buf + w.to(torch.float64).T[j]  # (B, s, h)
        logits = logits.masked_fill((age > t)[None, :, None], float("-inf"))  # slots not yet filled
        m = torch.maximum(logits.amax(1), state.log_sum)  # finite: the current token is present
        p = torch.exp(logits - m[:, None])
        e_out = torch.exp(state.log_sum - m)
        den = (e_out + p.sum(1)).to(cdt)[..., None]
        num = e_out.to(cdt)[..., None] * state.avg + (p.to(cdt)[..., None] * state.v_buf).sum(1)
        y = torch.sigmoid(q.to(cdt)) * (num / den)
        state.pos = t + 1
        return self.output(y.reshape(B, self.d_model).to(x.dtype)), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}, grid={self.grid}"
