"""Shared pieces of the AFT mixers: the projections around an AFT op.

An AFT mixer computes ``Q = X W^Q, K = X W^K, V = X W^V`` (the paper's notation), applies a
sigma-gated AFT op ``Y = sigma(Q) * (...)`` and projects back with ``W^O`` (then dropout).

With ``token_shift`` (RWKV's time shift, Peng et al. 2023, section 4.1) each projection reads a
two-tap causal convolution of the input instead of ``X``: with ``X'_t = X_{t-1}`` (zeros before
the first token, or the last input of the state continued)::

    Q = (mu_q * X + (1 - mu_q) * X') W^Q,   K = (mu_k * X + ...) W^K,   V = (mu_v * X + ...) W^V

with learned per-channel mixes ``mu_q, mu_k, mu_v`` (``(d,)`` each; RWKV-4's ``time_mix_r``,
``time_mix_k``, ``time_mix_v``). The decoding state is then a :class:`ShiftedState`: the last
input and the op's state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...ops._scan_state import continue_running_sums
from ...ops.state import BandState, RunningSums, shifted_sums
from ..base import SequenceMixer, mark_residual_projection

__all__ = [
    "AFTMixer",
    "BandState",
    "RunningSums",
    "ScanMixer",
    "ShiftedState",
    "band_step",
    "shift_tokens",
    "shifted_sums",
    "token_mix",
    "token_shift_init",
]


def shift_tokens(
    x: torch.Tensor, last: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """RWKV's time shift: ``X'_t = X_{t-1}`` for ``x: (B, T, d)``, ``(B, T, d)``.

    ``X'_0`` is ``last`` (``(B, d)``: the input before this call, a state's) or zeros. A padded
    position (``padding_mask`` False) passes zeros on, so a left-padded row's first real token
    sees zeros, as it would unpadded.
    """
    if padding_mask is not None:
        x = x.masked_fill(~padding_mask[..., None], 0.0)
    first = x.new_zeros(x.shape[0], 1, x.shape[2]) if last is None else last[:, None].to(x.dtype)
    return torch.cat([first, x[:, :-1]], 1)


def token_mix(x: torch.Tensor, shifted: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """``mu * X + (1 - mu) * X'``: the two-tap causal convolution of RWKV's token shift, any
    shape broadcasting against ``mu: (d,)``; one fused ``lerp`` (``X' + mu (X - X')``), in the
    inputs' dtype."""
    return torch.lerp(shifted, x, mu.to(x.dtype))


def token_shift_init(
    d: int, layer_idx: int = 0, n_layers: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RWKV-4's time-mix ramps for layer ``l`` of ``N``: ``(mu_k, mu_v, mu_r)``, ``(d,)`` each.

    With ``x_i = i / d``, ``rho = 1 - l / N`` and ``l / (N - 1)`` (0 for ``N = 1``):
    ``mu_k = x^rho``, ``mu_v = x^rho + 0.3 l / (N - 1)``, ``mu_r = x^(rho / 2)``
    (BlinkDL/RWKV-LM, ``RWKV-v4neo/src/model.py``, ``RWKV_TimeMix.__init__``; the
    channel mix takes ``mu_k`` for both of its mixes).
    """
    rho = 1.0 - layer_idx / n_layers
    ramp = layer_idx / (n_layers - 1) if n_layers > 1 else 0.0
    x = torch.arange(d, dtype=torch.float64) / d
    mu_k = x**rho
    return mu_k.float(), (mu_k + 0.3 * ramp).float(), (x ** (0.5 * rho)).float()


@dataclass
class ShiftedState:
    """The decoding state of an AFT mixer with ``token_shift``.

    Attributes:
        last: ``(B, d)`` the mixer's input at the last position (``X'`` of the next token;
            zeros before any), in the inputs' dtype.
        inner: the op's state after the same tokens (:class:`RunningSums`, :class:`BandState`,
            aft-full's).
    """

    last: torch.Tensor
    inner: Any


class AFTMixer(SequenceMixer):
    """Base class of the AFT mixers: owns ``W^Q``, ``W^K``, ``W^V`` and the output projection.

    The output projection ``proj`` (``W^O``) is marked a residual projection
    (:func:`~aftlab.mixers.base.mark_residual_projection`).

    Args:
        key_dim: width of ``K``; ``d_model`` for AFT-full/local/simple/decay, ``n_heads`` for
            AFT-conv (one key channel per head).
        token_shift: mix each projection's input with the previous token's (module docstring);
            the mixes ``mix_q, mix_k, mix_v`` start at RWKV-4's ramps
            (:func:`token_shift_init`, with the mixer's ``layer_idx``/``n_layers`` if it has them).
        **common: the common mixer arguments of :class:`~aftlab.mixers.SequenceMixer`.

    Every pass is "project, op, output" (:meth:`project`, :meth:`_op` or :meth:`_op_step`,
    :meth:`output`): a subclass implements :meth:`_op`, one call of its op on ``Q, K, V``,
    :meth:`_op_step`, one token's, and :meth:`_init_op_state`; ``forward`` runs it
    without a state, ``prefill`` (from the empty state or a given one) with the state and
    ``return_state=True``, the op continuing the state (its ``initial_state``) and returning
    the one after (its ``return_state``). The decoding states are the ops' own types
    (:mod:`aftlab.ops.state`): a :class:`RunningSums` (aft-simple, aft-decay), a
    :class:`BandState` (aft-local, aft-conv; one step: :func:`band_step`).

    Shapes:
        :meth:`project` maps ``x: (B, T, d)`` (or ``(B, d)`` for one decoding step) to
        ``q: (..., d)``, ``k: (..., key_dim)``, ``v: (..., d)``; :meth:`output` maps the AFT
        result ``(..., d)`` back to ``(..., d)``.
    """

    def __init__(
        self, *, key_dim: int | None = None, token_shift: bool = False, **common
    ) -> None:
        super().__init__(**common)
        if not isinstance(token_shift, bool):
            raise TypeError(
                f"{type(self).__name__}: 'token_shift' must be a bool, got "
                f"{type(token_shift).__name__}"
            )
        d = self.d_model
        self.key_dim = d if key_dim is None else int(key_dim)
        self.to_q = nn.Linear(d, d, bias=self.bias)
        self.to_k = nn.Linear(d, self.key_dim, bias=self.bias)
        self.to_v = nn.Linear(d, d, bias=self.bias)
        self.proj = mark_residual_projection(nn.Linear(d, d, bias=self.bias))
        self.drop = nn.Dropout(self.dropout_p)
        self.token_shift = token_shift
        if token_shift:
            self.mix_q, self.mix_k, self.mix_v = (nn.Parameter(torch.empty(d)) for _ in "qkv")
            AFTMixer.reset_parameters(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init hook: the token-shift mixes (if any) at RWKV-4's ramps
        (:func:`token_shift_init`); a subclass's hook calls this one first."""
        if self.token_shift:
            mu_k, mu_v, mu_r = token_shift_init(
                self.d_model, getattr(self, "layer_idx", 0), getattr(self, "n_layers", 1)
            )
            self.mix_q.copy_(mu_r)
            self.mix_k.copy_(mu_k)
            self.mix_v.copy_(mu_v)

    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """``dropout(Y W^O)`` of the op's ``Y`` on the projections of ``x: (B, T, d)``
        (:meth:`_op` without a state), queries without a valid key 0 (:meth:`output`)."""
        qkv = self.project(x, padding_mask=padding_mask)
        return self.output(self._op(*qkv, padding_mask, None, False), padding_mask)

    def _prefill(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One pass of the op from ``state`` (None: the empty state): :meth:`_op` with
        ``return_state=True``, then :meth:`output` of its ``y``."""
        last, inner = self._split(state)
        y, inner = self._op(*self.project(x, last), None, inner, True)
        # a copy: a view would keep the whole chunk's input alive in the state
        return self.output(y), self._join(x[:, -1].clone(), inner)

    def _step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One token ``x: (B, d)``: :meth:`project`, :meth:`_op_step`, :meth:`output`."""
        last, inner = self._split(state)
        y, inner = self._op_step(*self.project(x, last), inner)
        return self.output(y.to(x.dtype)), self._join(x, inner)

    def _op_step(self, q, k, v, state):
        """One token's op on the projections ``q: (B, d)``, ``k: (B, key_dim)``, ``v: (B, d)``
        after the op's ``state``: ``(Y (B, d), state after)`` (it may update ``state`` in
        place)."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def _init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> Any:
        """The op's empty state (:meth:`_init_op_state`), in a :class:`ShiftedState` with a
        zero ``last`` input when the mixer shifts tokens."""
        inner = self._init_op_state(batch_size, device, dtype)
        if not self.token_shift:
            return inner
        last = torch.zeros(batch_size, self.d_model, device=device, dtype=dtype)
        return ShiftedState(last, inner)

    def _init_op_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype):
        """The op's empty state for ``batch_size`` sequences, for inputs of ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def _state_position(self, state: Any) -> int | None:
        return self._op_state_position(self._split(state)[1])

    def _op_state_position(self, state: Any) -> int | None:
        """The position of the op's state (its ``position``)."""
        return super()._state_position(state)

    def _split(self, state: Any) -> tuple[torch.Tensor | None, Any]:
        """``(last input, op state)`` of a mixer state (None: the empty one)."""
        if not self.token_shift:
            return None, state
        return (None, None) if state is None else (state.last, state.inner)

    def _join(self, last: torch.Tensor, inner: Any) -> Any:
        return ShiftedState(last, inner) if self.token_shift else inner

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """The mixer's op on the projections ``q: (B, T, d)``, ``k: (B, T, key_dim)``,
        ``v: (B, T, d)`` of a validated ``x`` (:meth:`project`): ``Y (B, T, d)`` for
        :meth:`output`, or with ``return_state`` ``(Y, state after)``; continuing ``state``
        (None: the empty one; never with ``padding_mask``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _op")

    def project(
        self,
        x: torch.Tensor,
        last: torch.Tensor | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Q = X W^Q, K = X W^K, V = X W^V``, with ``token_shift`` of the mixed inputs
        (module docstring): ``x: (B, T, d)`` after ``last: (B, d)`` (None: zeros), or one
        token ``x: (B, d)`` after ``last``."""
        if not self.token_shift:
            return self.to_q(x), self.to_k(x), self.to_v(x)
        if x.dim() == 2:
            shifted = torch.zeros_like(x) if last is None else last.to(x.dtype)
        else:
            shifted = shift_tokens(x, last, padding_mask)
        pairs = ((self.to_q, self.mix_q), (self.to_k, self.mix_k), (self.to_v, self.mix_v))
        return tuple(lin(token_mix(x, shifted, mu)) for lin, mu in pairs)

    @staticmethod
    def match_dtypes(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cast ``tensors`` to their widest dtype.

        Under autocast ``Q, K, V`` come out of the projections in bf16/fp16 while the learned
        position biases stay float32; the op then runs with the biases' precision, as
        :meth:`step` does, so decoding and the forward agree.
        """
        dt = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        return tuple(t.to(dt) for t in tensors)

    def output(self, y: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``dropout(Y W^O)``; rows of queries with no valid key are 0 (as in ``attention``).

        Args:
            y: the AFT op's result ``(B, T, d)`` (or ``(B, d)`` for a decoding step).
            padding_mask: bool ``(B, T)``, True for real tokens; a query sees no valid key when
                every key it may see (all of them, or ``t' <= t`` if causal) is padding.
        """
        out = self.drop(self.proj(y))
        if padding_mask is None:
            return out
        if self.causal:
            has_key = padding_mask.cumsum(1) > 0
        else:
            has_key = padding_mask.any(1, keepdim=True).expand_as(padding_mask)
        return out.masked_fill(~has_key[..., None], 0.0)


class ScanMixer(AFTMixer):
    """An AFT mixer on a scan op (aft-simple, aft-decay): its decoding state is the op's
    :class:`RunningSums` ``(B, d)``."""

    def _init_op_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> RunningSums:
        """Empty state for ``batch_size`` sequences (float16/bfloat16 states stay in float32)."""
        return RunningSums.empty(batch_size, self.d_model, device=device, dtype=dtype)


def band_step(
    state: BandState, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, BandState]:
    """One token ``K_t (B, *Fk)``, ``V_t (B, *F)`` after a :class:`BandState` of ``r`` ring
    slots: the average it sees, ``(B, *F)``, and the state after it; ``O(r d)`` work.

    ``bias (r + 1, *Fk')`` holds ``w_{t,t'}`` of the band keys ``t' = t - r .. t`` (the ring,
    oldest first, then ``t``; ``Fk'`` broadcasts against ``Fk``). With the scores
    ``z_t' = K_t' + w_{t,t'}`` (``-inf`` on an empty slot) and ``gone``'s ``(p, a, b)``::

        m = max(max_t' z_t', p),   A_t = (sum_t' e^{z_t' - m} V_t' + e^{p - m} a)
                                         / (sum_t' e^{z_t' - m}     + e^{p - m} b)

    (``m`` is finite: key ``t`` is present; every exponent is ``<= 0``). The scores are formed
    in the dtype of ``state.k`` promoted with ``bias``'s (aft-conv's float64 log domain); the
    sums in the values' dtype. The state after is the op's
    (:func:`~aftlab.ops._band_state.state_after` on the one token, field for field): the oldest
    band key leaves the ring and ``gone`` takes it (:func:`continue_running_sums`: ``p`` stays
    the running maximum).
    """
    B, r = state.k.shape[:2]
    gone = state.gone
    z = (state.k + bias[:r]).masked_fill(~_slots(state.valid, state.k), float("-inf"))
    z_t = k + bias[r]  # (B, *Fk): key t, always present
    m = torch.maximum(z_t, gone.p)
    if r:
        m = torch.maximum(m, z.amax(1))
    m = m.detach()  # any shift is exact: keep it out of the graph
    e = torch.exp(z - m[:, None]).to(v.dtype)
    e_t, old = (torch.exp(u - m).to(v.dtype) for u in (z_t, gone.p))
    avg = ((e * state.v).sum(1) + e_t * v + old * gone.a) / (e.sum(1) + e_t + old * gone.b)
    # the key leaving the window (the ring's oldest; t itself without a ring), as one token's
    # shifted sums: p = K, a = V, b = 1 (nothing where its slot is empty)
    if r:
        k0, v0, ok = state.k[:, 0], state.v[:, 0], _slots(state.valid[:, :1], state.k)[:, 0]
        ring = [torch.cat([x[:, 1:], y[:, None]], 1) for x, y in
                ((state.k, k), (state.v, v), (state.valid, state.valid.new_ones(B)))]
    else:
        k0, v0, ok = k, v, torch.ones((), dtype=torch.bool, device=k.device)
        ring = [state.k, state.v, state.valid]
    left = RunningSums(
        a=torch.where(ok, v0, 0.0), b=torch.where(ok, torch.ones_like(k0), 0.0),
        p=torch.where(ok, k0, float("-inf")),
    )
    position = state.position + 1
    gone = continue_running_sums(gone, left, None, 1)
    gone.position = max(position - r, 0)
    return avg, BandState(gone, *ring, position=position)


def _slots(valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``valid (B, n)`` viewed to broadcast against ``like (B, n, ...)``."""
    return valid.view(*valid.shape, *(1,) * (like.dim() - 2))
