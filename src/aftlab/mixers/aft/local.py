"""The ``aft-local`` mixer: AFT-local with the factorised position bias ``w = U V^T``, band only."""

from __future__ import annotations

import torch

from ..._checks import check_positive_int
from ...ops.aft_local import _aft_local_band, _local_chunk, band_geometry
from ..registry import register_mixer
from .common import AFTMixer, BandState, band_step
from .full import PositionBias, require_max_seq_len

__all__ = ["AFTLocal"]


@register_mixer("aft-local")
class AFTLocal(AFTMixer):
    """AFT-local token mixer: AFT-full's formula with ``w_{t,t'}`` kept where ``|t - t'| < window``
    and 0 elsewhere (global connectivity kept). See :func:`aftlab.ops.aft_local`.

    Args:
        window: ``s >= 0`` (the paper's best on enwik8: 32). 0 is AFT-simple.
        bias_rank: ``d'`` of ``w = U V^T``; ``None`` for a full ``T_max x T_max`` bias.
        **common: see :class:`~aftlab.mixers.SequenceMixer`; ``max_seq_len`` is required.

    Only the band ``(T, 2s - 1)`` of ``w`` is ever formed: ``O(T s d')``. The decoding state
    (causal) is the op's :class:`~aftlab.ops.state.BandState` with the window
    ``s' = min(s, T_max)`` (no two positions below ``T_max`` are farther apart): the ring of the
    last ``s' - 1`` keys and values and the running sums of the keys that left the window;
    ``O(s d)`` per token. A prefill continuing a state is one op call with its band rows at
    the absolute positions ``state.position ..``.
    """

    length_limited = True
    test_options = {"window": 3}

    def __init__(self, *, window: int = 32, bias_rank: int | None = 64, **common) -> None:
        super().__init__(**common)
        where = type(self).__name__
        T_max = require_max_seq_len(where, self.max_seq_len)
        self.window = check_positive_int(where, "window", window, allow_zero=True)
        if bias_rank is not None:
            check_positive_int(where, "bias_rank", bias_rank)
        self.pos_bias = PositionBias(T_max, rank=bias_rank)

    def reset_parameters(self) -> None:
        """The init hook: the position bias starts at 0 (:class:`PositionBias`)."""
        self.pos_bias.reset_parameters()

    @property
    def state_window(self) -> int:
        """The window of the decoding state and of a continued prefill: ``min(s, T_max)``."""
        return min(self.window, self.max_seq_len)

    def band(self, T: int) -> torch.Tensor:
        """``w_band (T, W)``, ``w_band[t, j] = w[t, t + j - (s - 1)]`` (0 outside ``[0, T)``)."""
        geo = band_geometry(T, max(self.window, 1), causal=self.causal)
        return self.band_rows(0, T, geo.W, geo.beta)

    def band_rows(self, start: int, T: int, W: int, beta: int) -> torch.Tensor:
        """``(T, W)``: ``out[t, j] = w[start + t, start + t + j - beta]``, the band of the absolute
        rows ``start .. start + T - 1``; 0 where the key falls outside ``[0, start + T)``."""
        pb, dev = self.pos_bias, self.to_v.weight.device
        n = start + T
        cols = torch.arange(start, n, device=dev)[:, None] + torch.arange(W, device=dev) - beta
        inside = (cols >= 0) & (cols < n)
        if pb.rank is None:
            band = pb.w[start:n, :n].gather(1, cols.clamp(0, n - 1))  # backward: scatter_add_
        else:
            # w_band[t, j] = u_t . v_{t + j - beta}, with v padded by zeros: one shifted row-wise
            # dot product per band offset j, so neither direction forms a (T, rank, W) tensor,
            # and every gradient is a plain sum in a fixed order (deterministic; an advanced
            # index v[cols] would sum its backward in thread order).
            lo, hi = start - beta, n + W - 1 - beta  # the keys of the band, [lo, hi)
            vp = pb.v[max(lo, 0) : min(hi, n)]
            vp = torch.nn.functional.pad(vp, (0, 0, max(-lo, 0), max(hi - n, 0)))
            u = pb.u[start:n]
            band = torch.stack([(u * vp[j : j + T]).sum(-1) for j in range(W)], 1)
        return band.masked_fill(~inside, 0.0)

    def _mix(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        state: BandState | None = None,
        *,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, BandState]:
        """``x: (B, T, d_model)`` with ``T <= T_max`` -> ``(B, T, d_model)``.

        With ``return_state``: one call of the causal op continuing ``state`` (None: the empty
        one) at position ``t0 = state.position``, the band ``s' = min(s, T_max)`` wide with rows
        ``t0 .. t0 + T - 1`` (:meth:`band_rows`: the ring's keys get their biases), and the
        state after ``x``.
        """
        q, k, v = self.project(x)
        T = x.shape[1]
        if state is None and not return_state:
            w_band = self.band(T) if self.window > 0 and T > 0 else q.new_zeros(T, 1)
            q, k, v, w_band = self.match_dtypes(q, k, v, w_band)
            y = _aft_local_band(
                q, k, v, w_band, self.window, causal=self.causal, padding_mask=padding_mask
            )
            return self.output(y, padding_mask)
        s, t0 = self.state_window, 0 if state is None else state.position
        self._check_position(t0 + T - 1)
        rows = self.band_rows(t0, T, s, s - 1) if s else q.new_zeros(T, 1)
        q, k, v, rows = self.match_dtypes(q, k, v, rows)
        y, state = _local_chunk(q, k, v, rows, s, 0, T, state, True, None)
        return (self.output(y), state) if return_state else self.output(y)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}"

    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> BandState:
        """The empty :class:`BandState` of window ``min(s, T_max)``: nothing gone
        (``p = -inf``), ``min(s, T_max) - 1`` empty ring slots."""
        return BandState.empty(
            batch_size, self.state_window, self.d_model, device=device, dtype=dtype
        )

    def _step(self, x: torch.Tensor, state: BandState) -> tuple[torch.Tensor, BandState]:
        """One token ``x: (B, d_model)`` at position ``t = state.position``; ``O(s d)``:
        :func:`~aftlab.mixers.aft.common.band_step` with the biases ``w_{t, t-r..t}`` of the
        ring's keys and ``t`` (``r`` ring slots; an empty slot's bias is never read)."""
        t = state.position
        self._check_position(t)
        q, k, v = self.project(x)
        cd = state.k.dtype
        r = state.k.shape[1]
        if self.state_window:
            cols = torch.arange(t - r, t + 1, device=x.device).clamp_min(0)
            bias = self.pos_bias.entries(t, cols).to(cd)[:, None]  # (r + 1, 1)
        else:  # window 0: the current key too has bias 0
            bias = k.new_zeros(1, 1, dtype=cd)
        avg, state = band_step(state, k.to(cd), v.to(cd), bias)
        return self.output((torch.sigmoid(q.to(cd)) * avg).to(q.dtype)), state
