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

import torch
from torch import nn

from ..._checks import check_positive_int
from ...ops.aft_conv import _aft_conv, _aft_conv2d, _conv_chunk
from ..registry import register_mixer
from .common import AFTMixer, BandState, band_step

__all__ = ["AFTConvMixer"]


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

    The decoding state (causal) is the op's :class:`~aftlab.ops.state.BandState`: the ring of
    the last ``s - 1`` keys ``(B, s - 1, h, 1)`` and values ``(B, s - 1, h, c)`` and the running
    sums of the tokens that left the footprint; a prefill continuing it is one op call.

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
        super().reset_parameters()
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

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """``aft_conv`` (or ``aft_conv2d`` on the grid) of ``Q, V: (B, T, d_model)``,
        ``K: (B, T, h)`` split into heads with the kernel :meth:`kernel` -> ``(B, T, d_model)``;
        ``padding_mask: (B, T)``, True = real.

        With ``return_state`` (causal, 1-D): one call of the op continuing ``state`` (None: the
        empty one), and the state after ``x``.
        """
        B, T, d = q.shape
        dtype = q.dtype  # the projections' (under autocast bf16/fp16, as W^O computes)
        q, k, v, w = self._heads(q, k, v)
        if state is not None or return_state:
            y, state = _conv_chunk(q, k, v, w, state, True, None)
            y = y.reshape(B, T, d).to(dtype)
            return (y, state) if return_state else y
        if self.grid is None:
            y = _aft_conv(q, k, v, w, causal=self.causal, padding_mask=padding_mask)
        else:
            H, W = self.grid
            if T != H * W:
                raise ValueError(
                    f"{type(self).__name__}: sequence length {T} of 'x' {(B, T, d)} must "
                    "equal "
                    f"H * W = {H * W} for grid {self.grid}"
                )
            grid_mask = None if padding_mask is None else padding_mask.reshape(B, H, W)
            y = _aft_conv2d(
                *(t.reshape(B, H, W, *t.shape[2:]) for t in (q, k, v)), w, padding_mask=grid_mask
            )
        return y.reshape(B, T, d).to(dtype)

    # ----------------------------------------------------------------- decoding
    def _init_op_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> BandState:
        """The empty :class:`BandState` of window ``s``: nothing gone (``p = -inf``), ``s - 1``
        empty ring slots of one key per head."""
        h = self.n_heads
        return BandState.empty(
            batch_size, self.kernel_size, (h, self.d_model // h), key_shape=(h, 1),
            device=device, dtype=dtype,
        )

    def _op_step(self, q, k, v, state: BandState) -> tuple[torch.Tensor, BandState]:
        r"""One token at position ``t = state.position``; equals row ``t`` of the causal
        :meth:`forward`: :func:`~aftlab.mixers.aft.common.band_step` with the kernel as the band
        biases (ring slot ``i``, key ``t - s + 1 + i``, gets ``w_i``; token ``t`` gets
        ``w_{s-1}``), the scores in float64 (the op's log domain); ``O(s d)`` work.
        """
        B = q.shape[0]
        q, k, v, w = self._heads(q, k, v)  # (B, h, c), (B, h, 1), (B, h, c), (h, s)
        cd = state.v.dtype
        bias = w.to(torch.float64).T[..., None]  # (s, h, 1)
        avg, state = band_step(state, k.to(cd), v.to(cd), bias)
        y = torch.sigmoid(q.to(cd)) * avg
        return y.reshape(B, self.d_model), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}, grid={self.grid}"
