"""RWKV-4 (Peng et al. 2023), the released model of the AFT line: :class:`RWKV4LM`.

Hugging Face's ``RwkvForCausalLM`` and BlinkDL's RWKV-4, block for block (docs/rwkv.md)::

    h_0 = LN_0(E[idx])
    h   = h + TimeMix_l(LN_1,l(h))          the ``rwkv4`` mixer: aft-decay with token shift
    h   = h + ChannelMix_l(LN_2,l(h))       l = 0 .. N-1
    logits = LN_out(h) W_head^T

    ChannelMix(x)_t = sigma(W_r (mu_r x_t + (1 - mu_r) x_{t-1}))
                      * W_v relu(W_k (mu_k x_t + (1 - mu_k) x_{t-1}))^2

``x_{t-1}`` is zeros at ``t = 0`` (or the state's last input). The time mix is
:class:`~aftlab.mixers.aft.rwkv4.RWKV4TimeMix` (the aft-decay op and its C++ kernel for the
WKV). No positions: the model runs any length, and continues a :class:`DecodingCache` whose
state per block (:class:`RWKV4State`) is Hugging Face's five vectors (:func:`to_hf_state`).
Loading and saving checkpoints: :mod:`aftlab.models.rwkv4_io`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch
from torch import nn

from .. import kernels
from .._checks import (
    check_floating_dtype,
    check_padding_mask,
    check_positive_int,
    check_tensor,
    check_tokens,
)
from ..mixers.aft.common import ShiftedState, shift_tokens, token_mix, token_shift_init
from ..mixers.aft.rwkv4 import RWKV4TimeMix
from ..ops.state import RunningSums
from . import generation
from .config import RWKV4Config
from .generation import DecodingCache, LengthLimit
from .transformer import check_logits_selection, keep_positions

__all__ = [
    "RWKV4LM",
    "RWKV4Block",
    "RWKV4State",
    "ChannelMix",
    "init_rwkv4",
    "to_hf_state",
    "from_hf_state",
]

#: Hugging Face's ``pp`` of an empty state (its kernels' ``-1e38``); read back as ``-inf``
HF_EMPTY = -1e38


class ChannelMix(nn.Module):
    """RWKV-4's channel mix (module docstring): a squared-ReLU feed-forward on token-shifted
    inputs, gated by ``sigma(W_r x_r)``.

    Args:
        d_model: width ``d``.
        d_ff: hidden width (``4 d`` in RWKV-4).
        layer_idx, n_layers: for the mixes' initial ramps (:func:`token_shift_init`'s ``mu_k``
            for both ``mix_k`` and ``mix_r``, as RWKV-4's ``RWKV_ChannelMix``).

    Shapes:
        ``x (B, T, d)`` after ``last (B, d)`` (None: zeros) -> ``(B, T, d)``; a token
        ``x (B, d)`` after ``last`` -> ``(B, d)``.
    """

    def __init__(self, d_model: int, d_ff: int, *, layer_idx: int = 0, n_layers: int = 1) -> None:
        super().__init__()
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.key = nn.Linear(d_model, d_ff, bias=False)
        self.receptance = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(d_ff, d_model, bias=False)
        self.mix_k = nn.Parameter(torch.empty(d_model))
        self.mix_r = nn.Parameter(torch.empty(d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The mixes at RWKV-4's ramp ``(i / d)^(1 - l / N)``."""
        mu_k = token_shift_init(self.mix_k.numel(), self.layer_idx, self.n_layers)[0]
        self.mix_k.copy_(mu_k)
        self.mix_r.copy_(mu_k)

    def forward(
        self,
        x: torch.Tensor,
        last: torch.Tensor | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.dim() == 2:
            shifted = torch.zeros_like(x) if last is None else last.to(x.dtype)
        else:
            shifted = shift_tokens(x, last, padding_mask)
        k = self.key(token_mix(x, shifted, self.mix_k))
        r = self.receptance(token_mix(x, shifted, self.mix_r))
        grad = torch.is_grad_enabled() and (k.requires_grad or r.requires_grad)
        if grad or self.key._forward_hooks or self.receptance._forward_hooks or _global_hooks():
            k = torch.relu(k)
            return torch.sigmoid(r) * self.value(k * k)  # k * k: pow(k, 2) is slower on CPU
        # without autograd or a hook that may hold k or r: in place, the same roundings, no
        # (B, T, I) buffer to allocate
        return r.sigmoid_().mul_(self.value(k.relu_().mul_(k)))


@dataclass
class RWKV4State:
    """One block's decoding state.

    Attributes:
        att: the time mix's :class:`~aftlab.mixers.aft.common.ShiftedState`: its last input
            ``LN_1(h)`` (HF's ``state[1]``) and the WKV sums ``a, b, p`` (``state[2..4]``).
        ffn: ``(B, d)`` the channel mix's last input ``LN_2(h)`` (HF's ``state[0]``).
    """

    att: ShiftedState
    ffn: torch.Tensor


class RWKV4Block(nn.Module):
    """One RWKV-4 block: ``h = x + s TimeMix(LN_1(x))``, ``out = h + s ChannelMix(LN_2(h))``.

    ``s`` is 1, or ``2^-(l // rescale_every)`` in eval mode (:class:`RWKV4LM`).
    """

    def __init__(self, config: RWKV4Config, *, layer_idx: int = 0) -> None:
        super().__init__()
        d, N, eps = config.d_model, config.n_layers, config.layer_norm_eps
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.att = RWKV4TimeMix(
            d_model=d, causal=True, bias=False, layer_idx=layer_idx, n_layers=N
        )
        self.ffn = ChannelMix(d, config.resolved_d_ff, layer_idx=layer_idx, n_layers=N)

    def forward(
        self, x: torch.Tensor, *, padding_mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> torch.Tensor:
        h = x + _scaled(self.att(self.ln1(x), padding_mask=padding_mask), scale)
        return h + _scaled(self.ffn(self.ln2(h), padding_mask=padding_mask), scale)

    def _prefill(
        self, x: torch.Tensor, state: RWKV4State | None, scale: float = 1.0
    ) -> tuple[torch.Tensor, RWKV4State]:
        """``x: (B, T, d)`` (``T >= 1``) after ``state`` (None: empty), in one pass."""
        u = self.ln1(x)
        y, att = self.att._prefill(u, None if state is None else state.att)
        h = x + _scaled(y, scale)
        u = self.ln2(h)
        out = h + _scaled(self.ffn(u, None if state is None else state.ffn), scale)
        return out, RWKV4State(att, u[:, -1].clone())  # not a view of the chunk

    def _step(
        self, x: torch.Tensor, state: RWKV4State, scale: float = 1.0
    ) -> tuple[torch.Tensor, RWKV4State]:
        """One token ``x: (B, d)``: the C++ kernel (:meth:`_step_kernel`) when it can run,
        else these modules' own steps (its reference)."""
        if self._kernel_runs(x, state, weights := self._kernel_weights()):
            return self._step_kernel(x, state, scale, weights)
        u = self.ln1(x)
        y, att = self.att._step(u, state.att)
        h = x + _scaled(y, scale)
        u = self.ln2(h)
        return h + _scaled(self.ffn(u, state.ffn), scale), RWKV4State(att, u)

    def _kernel_runs(
        self, x: torch.Tensor, state: RWKV4State, weights: list[torch.Tensor]
    ) -> bool:
        """Whether :meth:`_step_kernel` computes this step from ``weights``
        (:meth:`_kernel_weights`, every parameter it reads): no gradient is taken (of any
        parameter of the block), no dropout or autocast applies, the projections are plain
        ``nn.Linear`` without bias, both LayerNorms share one epsilon, and the kernels run on
        ``x``."""
        linears = (self.att.to_q, self.att.to_k, self.att.to_v, self.att.proj, self.ffn.key,
                   self.ffn.receptance, self.ffn.value)
        sums = state.att.inner
        return (
            not (self.training and self.att.drop.p > 0)
            and all(type(lin) is nn.Linear and lin.bias is None for lin in linears)
            # a parameter besides the 18 (an adapter) needs autograd too; no walk without grad
            and not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))
            and self.ln1.eps == self.ln2.eps
            and state.att.last.dtype == x.dtype == state.ffn.dtype
            and _inference_kernel_runs(
                x, state.att.last, state.ffn, sums.a, sums.b, sums.p, *weights
            )
        )

    def _step_kernel(
        self, x: torch.Tensor, state: RWKV4State, scale: float, weights: list[torch.Tensor]
    ) -> tuple[torch.Tensor, RWKV4State]:
        """:meth:`_step` as one call of ``aftlab::rwkv4_step`` (:mod:`aftlab.kernels.rwkv4`):
        the same formulas, the elementwise work fused between ATen's matrix products."""
        sums = state.att.inner
        out, last_att, a, b, p, last_ffn = kernels.rwkv4.rwkv4_step(
            x, [state.att.last, sums.a, sums.b, sums.p, state.ffn], weights,
            eps=self.ln1.eps, scale=scale,
        )
        inner = RunningSums(a, b, p, position=sums.position + 1)
        return out, RWKV4State(ShiftedState(last_att, inner), last_ffn)

    def _kernel_weights(self) -> list[torch.Tensor]:
        """The parameters in the order of :data:`aftlab.kernels.rwkv4.WEIGHTS`."""
        att, ffn = self.att, self.ffn
        return [
            self.ln1.weight, self.ln1.bias, att.mix_q, att.mix_k, att.mix_v, att.to_q.weight,
            att.to_k.weight, att.to_v.weight, att.proj.weight, att.time_decay, att.time_bonus,
            self.ln2.weight, self.ln2.bias, ffn.mix_k, ffn.mix_r, ffn.key.weight,
            ffn.receptance.weight, ffn.value.weight,
        ]

    def init_state(self, batch_size: int, device, dtype) -> RWKV4State:
        att = self.att.init_state(batch_size, device=device, dtype=dtype)
        d = self.ln1.normalized_shape[0]
        return RWKV4State(att, torch.zeros(batch_size, d, device=device, dtype=dtype))

    def check_state(self, state: object, x: torch.Tensor, *, name: str) -> None:
        """Raise unless ``state`` is an :class:`RWKV4State` fitting ``x: (B, ...)``."""
        if not isinstance(state, RWKV4State):
            raise TypeError(
                f"RWKV4LM: '{name}' must be an RWKV4State, got {type(state).__name__}"
            )
        self.att.check_state(state.att, x, name=f"{name}.att")
        check_tensor("RWKV4LM", f"{name}.ffn", state.ffn, shape=(x.shape[0], self.att.d_model),
                     floating=True)


def _inference_kernel_runs(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a kernel without autograd may compute from ``x`` and ``tensors``: none requires
    grad under grad mode, no CPU autocast applies, and the kernels run on ``x``."""
    return (
        not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)))
        and not torch.is_autocast_enabled("cpu")
        and kernels.enabled(x)
    )


def _global_hooks() -> bool:
    """Whether a global module forward hook is registered (``register_module_forward_hook``)."""
    return bool(nn.modules.module._global_forward_hooks)


def _scaled(y: torch.Tensor, scale: float) -> torch.Tensor:
    return y if scale == 1.0 else y * scale


@torch.no_grad()
def init_rwkv4(model: RWKV4LM) -> None:
    """RWKV-4's own initialisation (BlinkDL/RWKV-LM, ``RWKV-v4neo/src/model.py``,
    ``RWKV.generate_init_weight``; docs/rwkv.md, "Initialisation"):

    * the embedding ``~ U(-6e-4, 6e-4)`` (v4neo draws ``U(-lr_init, lr_init)``; 6e-4 is the
      default ``--lr_init`` of its ``train.py``);
    * the time mix's ``W_k, W_r, W_o`` and the channel mix's ``W_v, W_r``: zeros;
    * every other matrix orthogonal with gain ``sqrt(rows / cols)`` when it has more rows than
      columns (else 1); the head's gain ``0.5`` times that;
    * LayerNorms ``gamma = 1, beta = 0``; the decays, bonus and mixes at their ramps (each
      module's ``reset_parameters``).
    """
    nn.init.uniform_(model.embeddings.weight, -6e-4, 6e-4)
    zero = {"att.to_k", "att.to_q", "att.proj", "ffn.value", "ffn.receptance"}
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, (RWKV4TimeMix, ChannelMix)):
            m.reset_parameters()
        elif isinstance(m, nn.Linear) and not (name == "head" and model.config.tie_embeddings):
            rows, cols = m.weight.shape
            if name.split(".", 2)[-1] in zero:
                nn.init.zeros_(m.weight)
            else:
                gain = (rows / cols) ** 0.5 if rows > cols else 1.0
                nn.init.orthogonal_(m.weight, gain=gain * (0.5 if name == "head" else 1.0))


class RWKV4LM(nn.Module):
    """RWKV-4 language model (module docstring), with :class:`~aftlab.models.TransformerLM`'s
    interface: ``forward``, ``prefill``, ``step``, ``generate``, ``stream_generate``.

    ``rescale_every`` (Hugging Face's, inference only): in eval mode block ``l``'s two branches
    are scaled by ``2^-(l // r)`` and the hidden state is halved after every ``r``-th block, as
    HF does by dividing ``attention.output`` and ``feed_forward.value`` (powers of two: exact in
    any float format). It keeps a float16 hidden state in range. In float32 it is not a no-op:
    LayerNorm sees ``h / 2^j``, and ``LN(h / s) = (h - mean) / sqrt(var + eps s^2)``, so block
    ``l`` normalises with an effective ``eps 4^(l // r)`` (and ``LN_out`` with ``4^(N // r)``).
    Measured on random ``d = 32`` models (``r = 6``; tests/models/test_rwkv4.py): the logits
    move by up to 9e-6 of their largest magnitude at 7 blocks and 1.3e-5 at 12, the same in
    float64 (the epsilons, not rounding); less where the hidden state's variance is larger.
    ``model.train()`` turns it off, as in HF.

    Args:
        config: an :class:`~aftlab.models.config.RWKV4Config`.

    Example:
        >>> import torch
        >>> from aftlab.models import RWKV4Config, RWKV4LM
        >>> lm = RWKV4LM(RWKV4Config(vocab_size=50, d_model=32, n_layers=2)).eval()
        >>> lm(torch.randint(0, 50, (2, 7))).shape
        torch.Size([2, 7, 50])
        >>> lm.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0).shape
        torch.Size([2, 8])
    """

    def __init__(self, config: RWKV4Config) -> None:
        super().__init__()
        if not isinstance(config, RWKV4Config):
            raise TypeError(
                f"RWKV4LM: 'config' must be an RWKV4Config, got {type(config).__name__}"
            )
        self.config = config
        d, V = config.d_model, config.vocab_size
        self.embeddings = nn.Embedding(V, d)
        self.ln0 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.blocks = nn.ModuleList(RWKV4Block(config, layer_idx=i) for i in range(config.n_layers))
        self.ln_out = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.head = nn.Linear(d, V, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embeddings.weight
        init_rwkv4(self)

    # ------------------------------------------------------------------ facts
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def length_limit(self) -> LengthLimit | None:
        """None: RWKV-4 runs any length."""
        return None

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied head once; ``exclude_embeddings``: without ``E``)."""
        skip = {id(self.embeddings.weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def _scales(self) -> list[tuple[float, bool]]:
        """Per block: its branches' scale and whether the hidden state is halved after it."""
        r = self.config.rescale_every
        if self.training or not r:
            return [(1.0, False)] * len(self.blocks)
        return [(2.0 ** -(i // r), (i + 1) % r == 0) for i in range(len(self.blocks))]

    @staticmethod
    def batch_input(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The arguments of :meth:`forward` for a task batch (``input``, ``padding_mask``)."""
        return {"idx": batch["input"], "padding_mask": batch.get("padding_mask")}

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        idx: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        logits_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits ``(B, T, V)`` of ``idx: (B, T)`` (the last ``logits_to_keep``
        positions only, 0: all; or ``(n, V)`` at the True positions of a bool ``(B, T)``
        ``logits_mask``, as :meth:`TransformerLM.forward`). Padded tokens (``padding_mask``
        False) are skipped by the WKV and pass zeros to the token shifts, so a left-padded row's
        logits equal the unpadded row's at its real tokens."""
        where = "RWKV4LM"
        check_tokens(where, "idx", idx, ndim=2, vocab_size=self.vocab_size, in_forward=True)
        if padding_mask is not None:
            check_padding_mask(where, padding_mask, tuple(idx.shape[:2]), "idx", idx)
        check_logits_selection(where, idx, logits_to_keep, logits_mask)
        h = self.ln0(self.embeddings(idx))
        for block, (scale, halve) in zip(self.blocks, self._scales(), strict=True):
            h = block(h, padding_mask=padding_mask, scale=scale)
            if halve:
                h = h / 2
        return self.head(self.ln_out(keep_positions(h, logits_to_keep, logits_mask)))

    # ------------------------------------------------------------------ decoding
    def init_cache(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DecodingCache:
        """The empty :class:`DecodingCache`: an :class:`RWKV4State` per block (``dtype`` the
        inputs', by default the embedding's; the WKV sums in float32 for float16/bfloat16)."""
        check_positive_int("RWKV4LM", "batch_size", batch_size)
        w = self.embeddings.weight
        device = device or w.device
        dtype = w.dtype if dtype is None else check_floating_dtype("RWKV4LM", "dtype", dtype)
        states = [b.init_state(batch_size, device, dtype) for b in self.blocks]
        return DecodingCache(states=states, position=0, batch_size=batch_size)

    def check_cache(self, cache: object, h: torch.Tensor, *, input_name: str = "tokens") -> None:
        """Raise unless ``cache`` is this model's :class:`DecodingCache` for ``h: (B, ...)``."""
        if not isinstance(cache, DecodingCache):
            raise TypeError(f"RWKV4LM: 'cache' must be a DecodingCache, got {type(cache).__name__}")
        if h.shape[0] != cache.batch_size:
            raise ValueError(
                f"RWKV4LM: {input_name!r} has batch size {h.shape[0]} but 'cache' was made for "
                f"batch_size={cache.batch_size}"
            )
        if len(cache.states) != len(self.blocks):
            raise ValueError(
                f"RWKV4LM: 'cache' holds {len(cache.states)} layer states but the model has "
                f"n_layers={len(self.blocks)}"
            )
        for i, block in enumerate(self.blocks):
            block.check_state(cache.states[i], h, name=f"cache.states[{i}]")

    def prefill(
        self,
        idx: torch.Tensor,
        *,
        cache: DecodingCache | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, DecodingCache]:
        """Feed ``idx: (B, T)`` in one parallel pass after ``cache`` (None: from the start).

        Each block runs its time mix's one-pass prefill (one aft-decay op call continuing the
        WKV sums) and its channel mix on the whole chunk. ``prefill(a)`` then
        ``prefill(b, cache=c)`` equals ``prefill(a + b)`` and ``forward(a + b)`` (within float
        rounding); gradients flow through the cache (``cache.detach()`` cuts them).

        Returns:
            ``(logits, cache)``: ``(B, T, V)`` logits (the last ``logits_to_keep`` positions;
            0: all) and the cache at ``position + T``; a given ``cache`` is advanced in place.
        """
        where = "RWKV4LM"
        check_tokens(where, "idx", idx, ndim=2, vocab_size=self.vocab_size)
        check_positive_int(where, "logits_to_keep", logits_to_keep, allow_zero=True)
        if cache is not None:
            self.check_cache(cache, idx, input_name="idx")
        B, T = idx.shape  # T >= 1: check_tokens refuses an empty idx
        h = self.ln0(self.embeddings(idx))
        states = []
        for i, (block, (scale, halve)) in enumerate(zip(self.blocks, self._scales(), strict=True)):
            h, state = block._prefill(h, None if cache is None else cache.states[i], scale)
            states.append(state)
            if halve:
                h = h / 2
        h = keep_positions(h, logits_to_keep)
        if cache is None:
            cache = DecodingCache(states=states, position=T, batch_size=B)
        else:
            cache.states, cache.position = states, cache.position + T
        return self.head(self.ln_out(h)), cache

    def step(self, tokens: torch.Tensor, cache: DecodingCache) -> torch.Tensor:
        """One token per sequence ``tokens: (B,)``; the next logits ``(B, V)``; advances
        ``cache`` in place. Equals :meth:`forward` on the whole prefix at its last position."""
        check_tokens("RWKV4LM", "tokens", tokens, ndim=1, vocab_size=self.vocab_size)
        self.check_cache(cache, tokens)
        h = self.ln0(self.embeddings(tokens))
        for i, (block, (scale, halve)) in enumerate(zip(self.blocks, self._scales(), strict=True)):
            h, cache.states[i] = block._step(h, cache.states[i], scale)
            if halve:
                h = h / 2
        cache.position += 1
        h, w = self.ln_out(h), self.head.weight
        if self.head.bias is None and w.dtype == h.dtype and _inference_kernel_runs(h, w):
            return kernels.rwkv4.rwkv4_linear(h, w)  # a few rows: read W once, faster than ATen
        return self.head(h)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """:func:`aftlab.models.generation.generate` of this model (``temperature``,
        ``top_k``, ``generator``)."""
        return generation.generate(self, prompt, max_new_tokens, **sampling)

    def stream_generate(
        self, prompt: torch.Tensor, max_new_tokens: int, **sampling
    ) -> Iterator[torch.Tensor]:
        """:func:`aftlab.models.generation.stream_generate` of this model."""
        return generation.stream_generate(self, prompt, max_new_tokens, **sampling)

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(cls, path: str | PathLike, **kwargs: Any) -> RWKV4LM:
        """Load a Hugging Face RWKV-4 folder or a BlinkDL ``.pth``
        (:func:`aftlab.models.rwkv4_io.load_rwkv4`, its keywords ``dtype``, ``device``)."""
        from .rwkv4_io import load_rwkv4

        return load_rwkv4(path, **kwargs)

    def save_pretrained(self, path: str | PathLike) -> None:
        """Write a Hugging Face folder (``config.json``, ``model.safetensors``) that
        transformers' ``RwkvForCausalLM.from_pretrained`` loads
        (:func:`aftlab.models.rwkv4_io.save_rwkv4`)."""
        from .rwkv4_io import save_rwkv4

        save_rwkv4(self, path)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, *, dtype: torch.dtype | None = None) -> RWKV4LM:
        """The model of a transformers ``RwkvForCausalLM`` instance, weights copied, in
        ``dtype`` (:func:`aftlab.models.rwkv4_io.from_hf_model`)."""
        from .rwkv4_io import from_hf_model

        return from_hf_model(hf_model, dtype=dtype)


# --------------------------------------------------------------------------- HF's state
def to_hf_state(cache: DecodingCache) -> list[torch.Tensor]:
    """Hugging Face's RWKV state of a cache: five float32 tensors ``(B, d, N)``.

    ``[0]`` the channel mixes' last inputs, ``[1]`` the time mixes' last inputs, ``[2]`` ``aa``
    (= ``a``), ``[3]`` ``bb`` (= ``b``), ``[4]`` ``pp`` (= ``p``; ``-1e38`` where it is
    ``-inf``: HF's empty state), the state ``RwkvForCausalLM(..., state=)`` continues.
    """
    fields = (
        [s.ffn for s in cache.states],
        [s.att.last for s in cache.states],
        [s.att.inner.a for s in cache.states],
        [s.att.inner.b for s in cache.states],
        [s.att.inner.p.clamp_min(HF_EMPTY) for s in cache.states],
    )
    return [torch.stack([t.float() for t in f], dim=-1) for f in fields]


def from_hf_state(
    state: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    position: int = 0,
    dtype: torch.dtype | None = None,
) -> DecodingCache:
    """The :class:`DecodingCache` of Hugging Face's five-tensor RWKV state (:func:`to_hf_state`).

    ``pp <= -1e30`` (HF's empty state) reads as ``-inf``. HF's state carries no position:
    ``position`` is the cache's (nothing in RWKV-4 depends on it). ``dtype``: the token-shift
    vectors' (the model's inputs'; default float32); the WKV sums stay float32.
    """
    if not isinstance(state, (list, tuple)) or len(state) != 5:
        raise ValueError(
            "from_hf_state: 'state' must be Hugging Face's list of 5 tensors (B, d, n_layers), "
            f"got {type(state).__name__}"
        )
    shape = tuple(state[0].shape)
    for i, t in enumerate(state):
        check_tensor("from_hf_state", f"state[{i}]", t, shape=shape, floating=True)
    dtype = dtype or torch.float32
    B, _, N = shape
    states = []
    for layer in range(N):
        ffn, last, a, b, p = (t[..., layer] for t in state)
        p = p.float().masked_fill(p <= -1e30, float("-inf"))
        sums = RunningSums(a.float(), b.float(), p, position=position)
        states.append(RWKV4State(ShiftedState(last.to(dtype), sums), ffn.to(dtype)))
    return DecodingCache(states=states, position=position, batch_size=B)
