"""The sequence-mixer interface every token mixer implements.

A mixer maps ``x: (B, T, d_model)`` to ``(B, T, d_model)``, mixing information across the
time axis (attention, or an AFT variant); the rest of a Transformer block (norms, residuals,
feed-forward) is shared. A model is built as ``mixer="<name>"`` through the registry in
:mod:`aftlab.mixers.registry`, everything else unchanged.

Conventions:
    * ``padding_mask`` is a bool tensor ``(B, T)``, **True for real tokens**, False for padding
      (the Hugging Face ``attention_mask`` convention). Padded keys contribute nothing; a query
      with no valid key yields zeros (after the output projection), never NaN.
    * A causal mixer decodes incrementally: ``state = init_state(B)`` then
      ``y_t, state = step(x_t, state)`` with ``x_t: (B, d_model)``; feeding tokens one by one
      must reproduce ``forward`` on the whole sequence. ``step`` checks ``state`` against the
      structure of an empty one (:meth:`SequenceMixer.check_state`): a state is a dataclass
      whose tensors hold the batch on dim 0.
    * A causal mixer carries its state across calls:
      ``y, state = forward(x, return_state=True)`` also returns the state after the ``T`` tokens
      of ``x: (B, T, d_model)``, and ``forward(x2, state=state)`` continues from it: chunk by
      chunk, the outputs and the final state equal one call on the whole sequence (and ``T``
      calls of ``step``), within float tolerance. ``prefill(x, state=None)`` is the shorthand
      for ``forward(x, state=state, return_state=True)``. The state passed in may be updated in
      place (as ``step`` does): use the one returned. A state carries no padding, so
      ``padding_mask`` with ``state`` or ``return_state`` is a ValueError. Every built-in mixer
      prefills in one parallel pass, from the empty state or a given one (its
      :meth:`SequenceMixer._prefill`; the AFT mixers: one call of their op with its
      ``initial_state``); a mixer without the hook continues by ``T`` calls of ``_step``.
    * Packed documents: ``cu_seqlens`` (int32 ``[0, n_1, ..., T]``, a batch of one row; the
      FlashAttention convention, :func:`aftlab.ops._packed.check_cu_seqlens`) restarts the mixer
      at every document start, positions from 0: the output equals one call per document. With
      ``state`` the first document continues it; with ``return_state`` the state returned is the
      last document's. ``cu_seqlens`` with ``padding_mask`` is a ValueError (one or the other).
      By default a mixer runs :meth:`SequenceMixer._forward` (or ``_prefill``) once per document
      (:meth:`SequenceMixer._documents`); attention does one pass with a block-diagonal mask.
    * A subclass implements hooks; the public methods validate, fill defaults and call them:
      ``forward`` -> :meth:`SequenceMixer._forward` (with ``state``/``return_state``:
      :meth:`SequenceMixer._prefill`; with ``cu_seqlens``: :meth:`SequenceMixer._documents`),
      ``init_state`` -> :meth:`SequenceMixer._init_state`, ``step`` ->
      :meth:`SequenceMixer._step`. A block of a model calls the hooks of ``prefill``
      and ``step`` itself: the model's entry points have validated their inputs. A mixer takes
      plain keyword arguments and knows nothing of models; a model builds its mixers from its
      config with :func:`aftlab.models.blocks.mixer_from_config`.
    * Initialisation: a model built on mixers (:mod:`aftlab.models`) first initialises every
      ``nn.Linear`` the GPT-2 way (weights ``N(0, 0.02^2)``, biases 0; the linear layers marked
      with :func:`mark_residual_projection` ``N(0, (0.02 / sqrt(2 N))^2)``), then calls each
      mixer's :meth:`SequenceMixer.reset_parameters`, the hook where a mixer (re)initialises the
      parameters that have a meaning of their own (decays, position biases, kernels).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from .._checks import check_floating_dtype, check_padding_mask, check_positive_int, check_tensor
from .._state import GROWS, clone_state
from ..ops._packed import check_cu_seqlens, run_documents

__all__ = [
    "SequenceMixer",
    "MixerState",
    "document_positions",
    "COMMON_ARGS",
    "GROWS",
    "mark_residual_projection",
    "is_residual_projection",
]

MixerState = Any  # each mixer defines its own state type (a small dataclass of tensors)

#: the attribute :func:`mark_residual_projection` sets on a layer
_RESIDUAL = "residual_projection"


#: the constructor arguments every mixer takes (a model fills them from its config fields of the
#: same names)
COMMON_ARGS = ("d_model", "n_heads", "causal", "max_seq_len", "dropout", "bias")

def document_positions(
    offsets: list[int], device: torch.device | str | None = None, *, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document and its position in it, for packed documents at ``offsets``.

    ``offsets`` are the ints of ``cu_seqlens`` (``[0, n_1, ..., T]``,
    :func:`~aftlab.ops._packed.check_cu_seqlens`). Returns ``(doc, pos)``, long ``(T,)`` each:
    token ``t`` of document ``i`` (``offsets[i] <= t < offsets[i+1]``) has ``doc[t] = i`` and
    ``pos[t] = t - offsets[i]``, plus ``start`` in the first non-empty document (the one that
    continues a state at position ``start``).
    """
    cu = torch.tensor(offsets, dtype=torch.long, device=device)
    T = offsets[-1]
    doc = torch.repeat_interleave(torch.arange(len(offsets) - 1, device=device), cu.diff(),
                                  output_size=T)
    pos = torch.arange(T, device=device) - cu[doc]
    if start and T:
        pos = pos + start * (doc == doc[0])
    return doc, pos


def mark_residual_projection(layer: nn.Linear) -> nn.Linear:
    """Mark ``layer`` as the last linear layer of a residual branch; returns ``layer``.

    A residual branch's output projection (a mixer's ``W^O``, the feed-forward's ``W_2``) adds
    straight into the residual stream; GPT-2 initialises it ``N(0, (0.02 / sqrt(2 N))^2)`` for
    ``N`` blocks (``2 N`` branches), so that the ``2 N`` branches together add a depth-independent
    amount to the stream's variance. The mark is the attribute
    ``layer.residual_projection = True``.
    """
    setattr(layer, _RESIDUAL, True)
    return layer


def is_residual_projection(module: nn.Module) -> bool:
    """True for a layer marked by :func:`mark_residual_projection`."""
    return bool(getattr(module, _RESIDUAL, False))


class _StatePart(NamedTuple):
    """One part of a decoding state that :meth:`SequenceMixer.check_state` checks."""

    get: Callable[[Any], Any] | None  # the part from the state (None: the state itself)
    path: str  # shown after the state's name: "", ".k", ".gone.a"
    kind: type
    shape: tuple[int | None, ...] | None  # a tensor's shape after the batch dim, else None
    dtype: torch.dtype | None  # a non-floating tensor's dtype (None: any floating dtype)
    grows: tuple[int, ...] = ()  # a tensor's dims of any size (:data:`GROWS`); None in shape

    def fits(self, value: torch.Tensor, batch_size: int, device: torch.device) -> bool:
        """Whether the tensor ``value`` has this part's shape, dtype kind and ``device``."""
        shape = value.shape
        if self.grows:
            shape = tuple(None if i in self.grows else n for i, n in enumerate(shape))
        return (
            shape == (batch_size, *self.shape)
            and value.device == device
            and (value.is_floating_point() if self.dtype is None else value.dtype == self.dtype)
        )


def _state_parts(value: object, path: str = "", grows: tuple[int, ...] = ()) -> list[_StatePart]:
    """The parts of the empty state ``value``, parents first: itself, and a dataclass's fields.

    A field that is None in the empty state (filled on a later step) may hold anything.
    """
    if value is None and path:
        return []
    get = operator.attrgetter(path[1:]) if path else None
    if isinstance(value, torch.Tensor):
        shape = tuple(None if i in grows else n for i, n in enumerate(value.shape))[1:]
        dtype = None if value.is_floating_point() else value.dtype
        return [_StatePart(get, path, torch.Tensor, shape, dtype, grows)]
    parts = [_StatePart(get, path, type(value), None, None)]
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            sub = getattr(value, f.name)
            parts += _state_parts(sub, f"{path}.{f.name}", f.metadata.get(GROWS, ()))
    return parts


class SequenceMixer(nn.Module):
    """Base class of token mixers.

    Subclasses implement :meth:`_forward`, and causal ones :meth:`_init_state` and :meth:`_step`
    (and :meth:`_prefill` for a one-pass prefill, :meth:`_documents` for one pass over packed
    documents); the public :meth:`forward`, :meth:`prefill`,
    :meth:`init_state` and :meth:`step` validate their arguments and call them, so every mixer
    has the same guards. Every subclass accepts the common keyword-only constructor arguments
    below (and may ignore those it has no use for) plus its own, typed keyword-only options; it
    passes the common ones on as ``**common``: ``def __init__(self, *, window: int = 32,
    **common)``.

    Args:
        d_model: model width ``d``.
        n_heads: number of heads (attention, AFT-conv); ignored by mixers without heads.
        causal: if True, output ``t`` depends only on inputs ``<= t``.
        max_seq_len: longest sequence (``T_max``); required by mixers with a ``T_max x T_max``
            position bias, ignored by the others.
        dropout: dropout probability on the mixer output.
        bias: whether the projections have biases.
    """

    #: registry name, set by :func:`aftlab.mixers.register_mixer`
    name: ClassVar[str] = ""
    #: True for mixers that cannot see past ``max_seq_len`` positions, forward or decoding
    #: (a ``T_max x T_max`` position bias); callers such as ``generate`` check it up front. The
    #: class's value is its default build's; an instance whose options lift the limit sets its
    #: own (``aft-local`` with ``relative_bias``), so callers read it from the instance.
    length_limited: bool = False
    #: options a model fills from its config besides :data:`COMMON_ARGS`, by name (attention:
    #: ``("head_dim", "scaled", "rotary")``; ``aft-decay``: ``("layer_idx", "n_layers")``); what
    #: each name means: :data:`aftlab.models.blocks.CONFIG_OPTIONS`
    config_options: ClassVar[tuple[str, ...]] = ()
    #: options a task may fill when the config does not set them (``aft-conv``: ``("grid",)``,
    #: the image shape of a pixel task)
    options_from_task: ClassVar[tuple[str, ...]] = ()
    #: True for mixers that exist causal only (``aft-decay``): ``causal=False`` is a ValueError
    causal_only: ClassVar[bool] = False
    #: True for a slow, obvious implementation kept to check a fast one (``attention-naive``):
    #: left out of ``aftlab compare``'s default mixers
    reference: ClassVar[bool] = False
    #: small options under which a test's short sequence reaches every path of the mixer (ring
    #: buffers that wrap within a few tokens); the test suites build each mixer with them
    test_options: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int = 1,
        causal: bool = False,
        max_seq_len: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        self.d_model = check_positive_int(where, "d_model", d_model)
        self.n_heads = check_positive_int(where, "n_heads", n_heads)
        if max_seq_len is not None:
            check_positive_int(where, "max_seq_len", max_seq_len)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"{where}: 'dropout' must be in [0, 1), got {dropout}")
        self.causal = bool(causal)
        self.max_seq_len = max_seq_len
        self.dropout_p = float(dropout)
        self.bias = bool(bias)

    # ----------------------------------------------------------------- initialisation
    def reset_parameters(self) -> None:
        """(Re)initialise the parameters this mixer owns beyond its ``nn.Linear`` layers.

        The initialisation hook. A mixer calls it at the end of its constructor; a model calls
        it again after its generic scheme has (re)drawn every ``nn.Linear``, so the parameters
        with a meaning of their own keep it: ``aft-decay``'s decays and bonus, the position
        factors ``U, V`` of ``aft-full``/``aft-local``, ``aft-conv``'s kernel ``w``, ``gamma``
        and ``beta``. A subclass whose ``nn.Linear`` layers need a special initialisation
        redoes it here too. The base mixer has nothing of its own: it does nothing.
        """

    # ----------------------------------------------------------------- validation
    def _check_input(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate ``x: (B, T, d_model)`` and ``padding_mask: (B, T)`` bool; return them."""
        where = type(self).__name__
        check_tensor(where, "x", x, shape=(None, None, self.d_model), floating=True)
        if padding_mask is not None:
            check_padding_mask(where, padding_mask, tuple(x.shape[:2]), "x", x)
        return x, padding_mask

    def _check_carry(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        state: MixerState | None,
        return_state: bool,
    ) -> None:
        """Validate a call that continues ``state`` or returns one (a causal mixer, no padding,
        ``state`` fitting ``x``: :meth:`check_state`)."""
        where = type(self).__name__
        if not isinstance(return_state, bool):
            raise TypeError(
                f"{where}: 'return_state' must be a bool, got {type(return_state).__name__}"
            )
        if state is None and not return_state:
            return
        if not self.causal:
            raise RuntimeError(
                f"{where}: prefill() ('state', return_state=True) needs a causal mixer; this one "
                "has causal=False"
            )
        if padding_mask is not None:
            raise ValueError(
                f"{where}: 'padding_mask' cannot be combined with 'state' or return_state=True: "
                "a decoding state holds no padding (a padded token would be seen by every later "
                "one); pass rows of equal length without padding_mask"
            )
        if state is not None:
            self.check_state(state, x)

    def _check_length(
        self, x: torch.Tensor, state: MixerState | None = None, offsets: list[int] | None = None
    ) -> None:
        """A length-limited mixer runs positions ``< max_seq_len`` only: ``x: (B, T, d)`` from
        the position of ``state`` (:meth:`_state_position`), or each document of ``offsets``."""
        T_max = self.max_seq_len
        if not self.length_limited or T_max is None:
            return
        where, T = type(self).__name__, x.shape[1]
        start = (self._state_position(state) or 0) if state is not None else 0
        docs = [(0, T)] if offsets is None else [
            (a, b) for a, b in zip(offsets, offsets[1:], strict=False) if b > a
        ]
        for i, (a, b) in enumerate(docs):
            first = start if i == 0 else 0
            if first + b - a <= T_max:
                continue
            if first:
                what = (
                    f"position {first + b - a - 1} of 'x' (continuing 'state' at position "
                    f"{first})"
                )
            elif offsets is not None:
                what = f"document length {b - a} (tokens {a}..{b - 1} of 'cu_seqlens')"
            else:
                what = f"sequence length {T} of 'x'"
            raise ValueError(f"{where}: {what} exceeds max_seq_len (T_max) = {T_max}")

    def _check_step_input(self, x: torch.Tensor) -> torch.Tensor:
        where = type(self).__name__
        if not self.causal:
            raise RuntimeError(f"{where}: step() needs a causal mixer; this one has causal=False")
        return check_tensor(where, "x", x, shape=(None, self.d_model), floating=True)

    def _check_position(self, t: int) -> None:
        """A length-limited mixer decodes positions ``t < max_seq_len`` only."""
        if self.length_limited and t >= self.max_seq_len:
            raise ValueError(
                f"{type(self).__name__}: position {t} exceeds max_seq_len (T_max) = "
                f"{self.max_seq_len}"
            )

    # ----------------------------------------------------------------- interface
    def forward(
        self,
        x: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        state: MixerState | None = None,
        return_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, MixerState]:
        """Mix ``x: (B, T, d_model)`` over time; returns ``y: (B, T, d_model)``, or ``(y, state)``.

        Args:
            x: ``(B, T, d_model)``, ``T = 0`` allowed.
            padding_mask: bool ``(B, T)``, True for real tokens (not with ``state``,
                ``return_state`` or ``cu_seqlens``).
            state: a causal mixer continues from this state (of ``init_state``, ``step`` or an
                earlier call): ``y`` is then rows ``t0 .. t0 + T - 1`` of the forward on the
                whole sequence, ``t0`` the state's position. Checked by :meth:`check_state`.
            return_state: also return the state after the ``T`` tokens (causal mixers).
            cu_seqlens: int32 ``[0, n_1, ..., T]`` for ``B = 1``: packed documents, each
                restarting from the empty state (the first continues ``state``; the state
                returned is the last document's).

        Validates the arguments, then calls :meth:`_forward`, :meth:`_prefill` (with
        ``state``/``return_state``) or :meth:`_documents` (with ``cu_seqlens``).

        Raises:
            RuntimeError: ``state``/``return_state`` on a non-causal mixer.
            TypeError: a state of another type; ``cu_seqlens`` not int32.
            ValueError: bad shapes; ``padding_mask`` with a state or ``cu_seqlens``; bad
                ``cu_seqlens`` (:func:`~aftlab.ops._packed.check_cu_seqlens`); positions past
                ``max_seq_len`` of a length-limited mixer.
        """
        x, padding_mask = self._check_input(x, padding_mask)
        self._check_carry(x, padding_mask, state, return_state)
        offsets = None
        if cu_seqlens is not None:
            offsets = check_cu_seqlens(type(self).__name__, cu_seqlens, x.shape[1], x.shape[0])
            if padding_mask is not None:
                raise ValueError(
                    f"{type(self).__name__}: pass 'cu_seqlens' or 'padding_mask', not both "
                    "(packed documents hold no padding)"
                )
        self._check_length(x, state, offsets)
        if not x.shape[1] and (state is not None or return_state):  # the state as it was
            if state is None:
                state = self.init_state(x.shape[0], device=x.device, dtype=x.dtype)
            return (x.new_zeros(x.shape), state) if return_state else x.new_zeros(x.shape)
        if offsets is not None:
            return self._documents(x, offsets, state, return_state)
        if state is None and not return_state:
            return self._forward(x, padding_mask)
        y, state = self._prefill(x, state)
        return (y, state) if return_state else y

    def prefill(
        self, x: torch.Tensor, state: MixerState | None = None
    ) -> tuple[torch.Tensor, MixerState]:
        """Run ``x: (B, T, d_model)`` from ``state`` (None: the empty one); ``(y, state after)``.

        The shorthand for ``forward(x, state=state, return_state=True)``: ``y`` is the forward's
        output on the tokens so far (rows of the new ones), and the state equals the one of
        ``T`` calls of :meth:`step`; decoding continues from it. An empty ``x`` (``T = 0``)
        returns the state unchanged (the empty one by default).
        """
        return self.forward(x, state=state, return_state=True)

    def init_state(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MixerState:
        """Return the empty decoding state for ``batch_size`` sequences (causal mixers only).

        ``device`` and ``dtype`` default to those of the module's parameters (CPU and the
        default dtype for a mixer without any); then :meth:`_init_state` builds the state.

        Raises:
            RuntimeError: the mixer is not causal.
            ValueError: ``batch_size`` is not a positive int.
            DTypeError: ``dtype`` is not a floating-point dtype (a ``ValueError``).
        """
        where = type(self).__name__
        if not self.causal:
            raise RuntimeError(
                f"{where}: init_state() needs a causal mixer; this one has causal=False"
            )
        check_positive_int(where, "batch_size", batch_size)
        p = next(self.parameters(), None)
        if device is None:
            device = torch.device("cpu") if p is None else p.device
        if dtype is None:
            dtype = torch.get_default_dtype() if p is None else p.dtype
        check_floating_dtype(where, "dtype", dtype)
        return self._init_state(batch_size, device, dtype)

    def check_state(self, state: MixerState, x: torch.Tensor, *, name: str = "state") -> None:
        """Raise unless ``state`` fits this mixer and ``x: (B, d_model)``.

        The structure is that of ``init_state`` (taken once, on the meta device): the same
        dataclass type, nested ones too; each tensor of the same shape (the batch ``B`` of ``x``
        on dim 0; any size on the dims marked :data:`GROWS`), floating-point where the empty
        state's is (else of its dtype), on ``x``'s device. Attribute checks only, no data read.

        Raises:
            TypeError: ``state``, or a field of it (named ``state.field``), of another type.
            ValueError: a state of another batch size, mixer size or device.
        """
        parts = self.__dict__.get("_state_parts")
        if parts is None:
            try:
                empty = self._init_state(1, torch.device("meta"), torch.float32)
            except Exception:  # noqa: BLE001 - no empty state on the meta device (none, or a
                empty = object()  # plugin's that reads data): any state passes this check
            parts = self.__dict__["_state_parts"] = _state_parts(empty)
        B, device = x.shape[0], x.device
        for part in parts:
            value = state if part.get is None else part.get(state)
            if not isinstance(value, part.kind):
                raise TypeError(
                    f"{type(self).__name__}: '{name}{part.path}' must be a {part.kind.__name__}, "
                    f"got {type(value).__name__}"
                )
            if part.shape is not None and not part.fits(value, B, device):
                self._check_state_tensor(f"{name}{part.path}", name, value, part, x)

    def _check_state_tensor(
        self, name: str, state_name: str, value: torch.Tensor, part: _StatePart, x: torch.Tensor
    ) -> None:
        """Raise :meth:`check_state`'s error for the tensor ``name``, which does not fit."""
        where, B = type(self).__name__, x.shape[0]
        if value.dim() and value.shape[0] != B:
            raise ValueError(
                f"{where}: 'x' has batch size {B} but '{state_name}' was made for {value.shape[0]}"
            )
        shape = (B, *part.shape)
        check_tensor(where, name, value, shape=shape, floating=part.dtype is None, dtype=part.dtype)
        if value.device != x.device:
            raise ValueError(f"{where}: '{name}' is on {value.device} but 'x' is on {x.device}")

    def step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """Process one token ``x: (B, d_model)`` at the state's position; return ``(y, state)``.

        ``y`` has shape ``(B, d_model)`` and equals row ``t`` of :meth:`forward` on the
        sequence so far. The returned state may be the same object, updated in place.
        Validates ``x`` (and that the mixer is causal) and ``state`` (:meth:`check_state`),
        then calls :meth:`_step`.
        """
        x = self._check_step_input(x)
        self.check_state(state, x)
        return self._step(x, state)

    # ----------------------------------------------------------------- hooks
    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The mixer itself, on validated arguments (see :meth:`forward`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _forward")

    def _prefill(
        self, x: torch.Tensor, state: MixerState | None
    ) -> tuple[torch.Tensor, MixerState]:
        """``(y, state after)`` of a validated ``x: (B, T, d_model)``, ``T >= 1``, from
        ``state`` (None: the empty state): :meth:`forward` with ``return_state=True``.

        This default makes ``T`` calls of :meth:`_step` from ``state`` (or :meth:`_init_state`),
        updating it in place where ``_step`` does. Under autograd each step gets a copy of the
        state (:func:`~aftlab._state.clone_state`): a ``_step`` that writes its buffers in place
        would otherwise overwrite what the earlier steps saved for backward, and the gradient
        flows through the chain of states. A mixer with a one-pass prefill overrides it: from
        the empty state ``y`` is then :meth:`_forward`'s, bit for bit, and the state is reduced
        from the same pass.
        """
        if state is None:
            state = self._init_state(x.shape[0], x.device, x.dtype)
        ys, tracked = [], torch.is_grad_enabled()
        for t in range(x.shape[1]):
            if tracked:
                state = clone_state(state)
            y, state = self._step(x[:, t], state)
            ys.append(y)
        return torch.stack(ys, 1), state

    def _documents(
        self, x: torch.Tensor, offsets: list[int], state: MixerState | None, return_state: bool
    ) -> torch.Tensor | tuple[torch.Tensor, MixerState]:
        """Packed documents of a validated ``x: (1, T, d_model)`` at ``offsets`` (the ints of
        ``cu_seqlens``): ``y`` (and the last document's state when ``return_state``).

        This default runs each document alone, :meth:`_forward` (or :meth:`_prefill` for the
        first, continuing ``state``, and the last when its state is wanted): exact for any
        mixer, causal or not, one call per document (:func:`~aftlab.ops._packed.run_documents`).
        """

        def run(a: int, b: int, st: MixerState | None, want: bool):
            if st is None and not want:
                return self._forward(x[:, a:b], None)
            y, new = self._prefill(x[:, a:b], st)
            return (y, new) if want else y

        return run_documents(offsets, run, initial_state=state, return_state=return_state)

    def _state_position(self, state: MixerState) -> int | None:
        """The position a state continues at (tokens consumed), for the length check of a
        length-limited mixer; this default reads ``state.position`` (None: unknown, left to
        the steps' own checks)."""
        position = getattr(state, "position", None)
        return position if isinstance(position, int) else None

    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> MixerState:
        """The empty state for ``batch_size`` sequences, on ``device``, for inputs of ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def _step(self, x: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One validated token ``x: (B, d_model)`` (see :meth:`step`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, causal={self.causal}"
