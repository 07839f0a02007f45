"""The ``aft-local`` mixer: AFT-local with the factorised position bias ``w = U V^T`` (or a
relative one, learned per offset ``t' - t``), band only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import check_positive_int
from ...ops.aft_local import _aft_local_band, band_geometry
from ..registry import register_mixer
from .common import AFTMixer, RunningSums
from .full import PositionBias, require_max_seq_len

__all__ = ["AFTLocal", "AFTLocalState"]


@dataclass
class AFTLocalState:
    """Decoding state of causal AFT-local.

    ``gone``: the running sums of the keys that left the window (``t' <= t - s``):
    ``p = max K_t'``, ``a = sum exp(K_t' - p) V_t'``, ``b = sum exp(K_t' - p)``, ``(B, d)`` each;
    ``k, v`` ``(B, s, d)``: ring buffer of the last ``s`` keys and values (slot ``t' mod s``).
    """

    gone: RunningSums
    k: torch.Tensor
    v: torch.Tensor
    t: int = 0


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
        **common: see :class:`~aftlab.mixers.SequenceMixer`; ``max_seq_len`` is required unless
            ``relative_bias``.

    Only the band ``(T, 2s - 1)`` of ``w`` is ever formed: ``O(T s d')`` (relative: the row of
    offsets repeated, no copy). Decoding (causal) keeps running sums of the keys outside the
    window plus a ring buffer of the last ``s``: ``O(s d)`` per token.
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
        **common,
    ) -> None:
        super().__init__(**common)
        where = type(self).__name__
        self.window = check_positive_int(where, "window", window, allow_zero=True)
        if not isinstance(relative_bias, bool):
            raise TypeError(
                f"{where}: 'relative_bias' must be a bool, got {type(relative_bias).__name__}"
            )
        self.relative_bias = relative_bias
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
        if self.relative_bias:
            self.rel_bias.zero_()
        else:
            self.pos_bias.reset_parameters()

    def band(self, T: int) -> torch.Tensor:
        """``w_band (T, W)``, ``w_band[t, j] = w[t, t + j - (s - 1)]`` (0 outside ``[0, T)``).

        Relative: ``w_band[t, j] = rel_bias[window - s + j]`` for every row (a view of the
        offsets, ``s = min(window, T)``; entries whose key falls outside ``[0, T)`` keep their
        offset's bias, which the ops never read).
        """
        geo = band_geometry(T, max(self.window, 1), causal=self.causal)
        if self.relative_bias:
            first = self.window - (geo.beta + 1)
            return self.rel_bias[first : first + geo.W].expand(T, geo.W)
        pb, dev = self.pos_bias, self.to_v.weight.device
        offsets = torch.arange(geo.W, device=dev)[None] - geo.beta
        cols = torch.arange(T, device=dev)[:, None] + offsets
        inside = (cols >= 0) & (cols < T)
        cols = cols.clamp(0, T - 1)
        if pb.rank is None:
            band = pb.w[:T, :T].gather(1, cols)  # backward: scatter_add_ by row, deterministic
        else:
            # w_band[t, j] = u_t . v_{t + j - beta}, with v padded by zeros: one shifted row-wise
            # dot product per band offset j, so neither direction forms a (T, rank, W) tensor,
            # and every gradient is a plain sum in a fixed order (deterministic; an advanced
            # index v[cols] would sum its backward in thread order).
            vp = torch.nn.functional.pad(pb.v[:T], (0, 0, geo.beta, geo.W - 1 - geo.beta))
            u = pb.u[:T]
            band = torch.stack([(u * vp[j : j + T]).sum(-1) for j in range(geo.W)], 1)
        return band.masked_fill(~inside, 0.0)

    def _mix(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: (B, T, d_model)`` with ``T <= T_max`` -> ``(B, T, d_model)``."""
        q, k, v = self.project(x)
        T = x.shape[1]
        w_band = self.band(T) if self.window > 0 and T > 0 else q.new_zeros(T, 1)
        q, k, v, w_band = self.match_dtypes(q, k, v, w_band)
        y = _aft_local_band(
            q, k, v, w_band, self.window, causal=self.causal, padding_mask=padding_mask
        )
        return self.output(y, padding_mask), k, v

    def _state_after(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AFTLocalState:
        """The decoding state after the keys and values ``k, v: (B, T, d)`` of a whole prompt.

        With ``s = min(window, T_max)``: the ring buffer holds keys and values
        ``max(0, T - s) .. T - 1`` (slot ``t' mod s``), and ``gone`` sums the keys ``t' < T - s``
        that left the window, reduced in one pass (:meth:`RunningSums.from_tokens`).
        """
        B, T, _ = k.shape
        state = self._init_state(B, k.device, k.dtype)
        cd, s = state.gone.a.dtype, state.k.shape[1]
        k, v = k.to(cd), v.to(cd)
        n_gone = max(0, T - s)
        state.gone = RunningSums.from_tokens(k[:, :n_gone], v[:, :n_gone])
        if s:
            kept = torch.arange(n_gone, T, device=k.device)
            state.k[:, kept % s], state.v[:, kept % s] = k[:, n_gone:], v[:, n_gone:]
        state.t = T
        return state

    def bias_entries(self, t: int, cols: torch.Tensor) -> torch.Tensor:
        """``w_{t, cols}``: ``(len(cols),)`` for keys ``cols`` inside the window of query ``t``
        (decoding): :meth:`PositionBias.entries`, or ``rel_bias[cols - t + s - 1]``."""
        if self.relative_bias:
            return self.rel_bias[cols - t + self.window - 1]
        return self.pos_bias.entries(t, cols)

    def extra_repr(self) -> str:
        rel = ", relative_bias=True" if self.relative_bias else ""
        return super().extra_repr() + f", window={self.window}{rel}"

    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> AFTLocalState:
        """Nothing outside the window (``p = -inf``), an empty ring buffer of ``min(s, T_max)``
        (``s`` with ``relative_bias``: no ``T_max``)."""
        s = self.window if self.relative_bias else min(self.window, self.max_seq_len)
        gone = RunningSums.empty(batch_size, self.d_model, device=device, dtype=dtype)
        buf = torch.zeros(batch_size, s, self.d_model, device=device, dtype=gone.a.dtype)
        return AFTLocalState(gone, buf, buf.clone())

    def _step(self, x: torch.Tensor, state: AFTLocalState) -> tuple[torch.Tensor, AFTLocalState]:
        """One token ``x: (B, d_model)`` at position ``t``; ``O(s d)``."""
        t = state.t
        self._check_position(t)
        q, k, v = self.project(x)
        gone = state.gone
        cd = gone.a.dtype
        k, v = k.to(cd), v.to(cd)
        s = state.k.shape[1]
        if s == 0:
            gone.fold(k, v)
            num, den = gone.a, gone.b
        else:
            slot = t % s
            if t >= s:  # key t - s leaves the window; its slot takes key t
                gone.fold(state.k[:, slot], state.v[:, slot])
            state.k[:, slot], state.v[:, slot] = k, v
            pos = torch.arange(t - s + 1, t + 1, device=k.device)  # band keys, oldest first
            seen = pos >= 0
            pos = pos.clamp(min=0)
            w = self.bias_entries(t, pos).to(cd).masked_fill(~seen, float("-inf"))
            sc = state.k[:, pos % s] + w[None, :, None]  # (B, s, d): K_t' + w_{t,t'}
            m = torch.maximum(sc.amax(1), gone.p)  # per-(t, c) max over every key t' <= t
            e = torch.exp(sc - m[:, None])
            old = torch.exp(gone.p - m)
            num = (e * state.v[:, pos % s]).sum(1) + gone.a * old
            den = e.sum(1) + gone.b * old
        state.t = t + 1
        return self.output((torch.sigmoid(q.to(cd)) * num / den).to(q.dtype)), state
