"""The ``aft-local`` mixer: AFT-local with the factorised position bias ``w = U V^T`` (or a
relative one, learned per offset ``t' - t``), band only."""

from __future__ import annotations

import math

import torch
from torch import nn

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
        bias_rank: ``d'`` of ``w = U V^T``; ``None`` for a full ``T_max x T_max`` bias. Ignored
            with ``relative_bias``.
        relative_bias: if True, ``w_{t,t'} = r_{t' - t}`` depends on the offset only (a Toeplitz
            band): ``r`` is a parameter ``rel_bias`` of ``s`` entries (causal: offsets
            ``-(s - 1) .. 0``) or ``2s - 1`` (offsets ``-(s - 1) .. s - 1``), ``rel_bias[j]`` the
            bias of offset ``j - (s - 1)``, shared by the channels and initialised to 0. The
            mixer then has no ``T_max``: it is not length-limited and needs no ``max_seq_len``.
            False (default): the paper's absolute ``w`` (:class:`PositionBias`).
        relative_gain: the relative bias is ``r = relative_gain * rel_bias`` (a fixed
            reparametrisation). Adam moves a parameter by about its learning rate per step
            whatever the gradient's scale, so an unscaled ``rel_bias`` stayed within
            ``sum(lr) ~ 0.55`` of 0 over a whole run and trained far worse than the absolute
            ``U V^T`` (whose products move faster); with 10 it trained better (docs/results.md,
            "aft-local's window"). Ignored without ``relative_bias``.
        **common: see :class:`~aftlab.mixers.SequenceMixer`; ``max_seq_len`` is required unless
            ``relative_bias``.

    Only the band ``(T, 2s - 1)`` of ``w`` is ever formed: ``O(T s d')`` (relative: the row of
    offsets repeated, no copy). The decoding state (causal) is the op's
    :class:`~aftlab.ops.state.BandState` with the window :attr:`state_window` (``min(s, T_max)``:
    no two positions below ``T_max`` are farther apart; ``s`` with ``relative_bias``): the ring
    of the last ``state_window - 1`` keys and values and the running sums of the keys that left
    the window; ``O(s d)`` per token. A prefill continuing a state is one op call with its band
    rows at the absolute positions ``state.position ..`` (relative: the same rows anywhere).
    """

    #: the default (absolute bias); an instance with ``relative_bias`` sets False
    length_limited = True
    test_options = {"window": 3}

    def __init__(
        self,
        *,
        window: int = 32,
        bias_rank: int | None = 64,
        relative_bias: bool = False,
        relative_gain: float = 10.0,
        **common,
    ) -> None:
        super().__init__(**common)
        where = type(self).__name__
        self.window = check_positive_int(where, "window", window, allow_zero=True)
        if not isinstance(relative_bias, bool):
            raise TypeError(
                f"{where}: 'relative_bias' must be a bool, got {type(relative_bias).__name__}"
            )
        if isinstance(relative_gain, bool) or not isinstance(relative_gain, (int, float)) or not (
            math.isfinite(relative_gain) and relative_gain > 0
        ):
            raise ValueError(
                f"{where}: 'relative_gain' must be a finite number > 0, got {relative_gain!r}"
            )
        self.relative_bias = relative_bias
        self.relative_gain = float(relative_gain)
        self.length_limited = not relative_bias
        if relative_bias:
            n_offsets = self.window if self.causal else max(2 * self.window - 1, 0)
            self.rel_bias = nn.Parameter(torch.zeros(n_offsets))
            return
        T_max = require_max_seq_len(where, self.max_seq_len)
        if bias_rank is not None:
            check_positive_int(where, "bias_rank", bias_rank)
        self.pos_bias = PositionBias(T_max, rank=bias_rank)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init hook: the position bias starts at 0 (:class:`PositionBias`, or ``rel_bias``)."""
        super().reset_parameters()
        if self.relative_bias:
            self.rel_bias.zero_()
        else:
            self.pos_bias.reset_parameters()

    @property
    def state_window(self) -> int:
        """The window of the decoding state and of a continued prefill: ``min(s, T_max)``
        (``s`` with ``relative_bias``: no ``T_max``)."""
        return self.window if self.relative_bias else min(self.window, self.max_seq_len)

    def band(self, T: int) -> torch.Tensor:
        """``w_band (T, W)``, ``w_band[t, j] = w[t, t + j - (s - 1)]`` (0 outside ``[0, T)``).

        Relative: ``w_band[t, j] = rel_bias[window - s + j]`` for every row (a view of the
        offsets, ``s = min(window, T)``; entries whose key falls outside ``[0, T)`` keep their
        offset's bias, which the ops never read).
        """
        geo = band_geometry(T, max(self.window, 1), causal=self.causal)
        return self.band_rows(0, T, geo.W, geo.beta)

    def band_rows(self, start: int, T: int, W: int, beta: int) -> torch.Tensor:
        """``(T, W)``: ``out[t, j] = w[start + t, start + t + j - beta]``, the band of the absolute
        rows ``start .. start + T - 1``; 0 where the key falls outside ``[0, start + T)``.
        Relative: the offsets ``j - beta`` of ``rel_bias`` in every row, whatever ``start``."""
        if self.relative_bias:
            first = self.window - (beta + 1)
            return self.offsets()[first : first + W].expand(T, W)
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

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """``aft_local_band(Q, K, V, w_band, s)``: ``(B, T, d_model)`` each with ``T <= T_max``
        -> ``(B, T, d_model)``, the band ``w_band`` of :meth:`band`.

        With ``return_state``: one call of the causal op continuing ``state`` (None: the empty
        one) at position ``t0 = state.position``, the band :attr:`state_window` wide with rows
        ``t0 .. t0 + T - 1`` (:meth:`band_rows`: the ring's keys get their biases), and the
        state after ``x``.
        """
        T = q.shape[1]
        if state is None and not return_state:
            w_band = self.band(T) if self.window > 0 and T > 0 else q.new_zeros(T, 1)
            q, k, v, w_band = self.match_dtypes(q, k, v, w_band)
            return _aft_local_band(
                q, k, v, w_band, self.window, causal=self.causal, padding_mask=padding_mask
            )
        s, t0 = self.state_window, 0 if state is None else state.position
        self._check_position(t0 + T - 1)
        rows = self.band_rows(t0, T, s, s - 1) if s else q.new_zeros(T, 1)
        q, k, v, rows = self.match_dtypes(q, k, v, rows)
        y, state = _local_chunk(q, k, v, rows, s, 0, T, state, True, None)
        return (y, state) if return_state else y

    def bias_entries(self, t: int, cols: torch.Tensor) -> torch.Tensor:
        """``w_{t, cols}``: ``(len(cols),)`` for keys ``cols`` inside the window of query ``t``
        (decoding): :meth:`PositionBias.entries` (keys before position 0, empty ring slots, get
        ``w_{t,0}``: never read), or ``rel_bias[cols - t + s - 1]``."""
        if self.relative_bias:
            return self.offsets()[cols - t + self.window - 1]
        return self.pos_bias.entries(t, cols.clamp_min(0))

    def offsets(self) -> torch.Tensor:
        """The relative bias per offset, ``r = relative_gain * rel_bias`` (``relative_bias``)."""
        return self.rel_bias * self.relative_gain

    def extra_repr(self) -> str:
        rel = ""
        if self.relative_bias:
            rel = f", relative_bias=True, relative_gain={self.relative_gain:g}"
        return super().extra_repr() + f", window={self.window}{rel}"

    def _init_op_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> BandState:
        """The empty :class:`BandState` of window ``min(s, T_max)``: nothing gone
        (``p = -inf``), ``min(s, T_max) - 1`` empty ring slots."""
        return BandState.empty(
            batch_size, self.state_window, self.d_model, device=device, dtype=dtype
        )

    def _op_step(self, q, k, v, state: BandState) -> tuple[torch.Tensor, BandState]:
        """One token's projections ``(B, d)`` each at position ``t = state.position``; ``O(s d)``:
        :func:`~aftlab.mixers.aft.common.band_step` with the biases ``w_{t, t-r..t}`` of the
        ring's keys and ``t`` (``r`` ring slots; an empty slot's bias is never read)."""
        t = state.position
        self._check_position(t)
        cd = state.k.dtype
        r = state.k.shape[1]
        if self.state_window:
            cols = torch.arange(t - r, t + 1, device=k.device)
            bias = self.bias_entries(t, cols).to(cd)[:, None]  # (r + 1, 1)
        else:  # window 0: the current key too has bias 0
            bias = k.new_zeros(1, 1, dtype=cd)
        avg, state = band_step(state, k.to(cd), v.to(cd), bias)
        return torch.sigmoid(q.to(cd)) * avg, state
