"""``AftlabForCausalLM``: :class:`aftlab.models.TransformerLM` as a transformers causal LM.

Decoding state. aftlab's mixers keep their own state (a KV cache for attention, running sums
for AFT), gathered per model in a :class:`~aftlab.models.DecodingCache`. That object itself is
the model's cache: ``forward(..., use_cache=True)`` returns it as ``cache`` (transformers 5's
name for ``past_key_values``, which transformers 5 also reads), and passing it back (``cache=``
or ``past_key_values=``) feeds only the new tokens through ``TransformerLM.step``, updating it
in place (as transformers' ``DynamicCache`` is).
``generate`` carries it the way transformers carries the state of its recurrent models (RWKV,
Mamba): no ``DynamicCache`` is made (``_supports_default_dynamic_cache`` is False),
:meth:`~AftlabForCausalLM.prepare_inputs_for_generation` feeds the tokens the state has not
seen yet, and ``_update_model_kwargs_for_generation`` hands the returned state to the next
step. A ``transformers.Cache`` subclass was not used: its interface (layers of key/value
tensors) does not fit running sums and differs between transformers 4 and 5. The first step of
``generate`` runs the prompt in one parallel pass (``TransformerLM.prefill``, every mixer's
one-pass prefill) and the head on the last position only (``logits_to_keep=1``), as
``TransformerLM.generate`` does, so greedy decoding gives exactly its tokens.

Limits: prompts in a batch must not be padded (the decoding state has no padding; an
``attention_mask`` with zeros is refused when a state is used), and beam search and assisted
generation are refused (the state is not reordered between beams nor rewound).
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .._checks import check_state_dtypes, check_tokens
from ..errors import reason
from ..models.generation import DecodingCache
from ..models.transformer import TransformerLM
from .configuration import AftlabConfig

__all__ = ["AftlabForCausalLM", "AftlabCausalLMOutput"]


@dataclass
class AftlabCausalLMOutput(ModelOutput):
    """Output of :meth:`AftlabForCausalLM.forward`.

    Attributes:
        loss: mean next-token cross-entropy (nats) when ``labels`` were given.
        logits: ``(B, T', vocab_size)``; ``T' = T``, or ``logits_to_keep`` last positions.
        cache: the :class:`~aftlab.models.DecodingCache` after the tokens seen so far
            (``use_cache``), or None; transformers 5 also reads it as ``past_key_values``.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: DecodingCache | None = None


class AftlabForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`~aftlab.models.TransformerLM` with any causal mixer, for transformers.

    ``logits = LN_f(Blocks(E[idx] + P)) W_head^T`` as in TransformerLM, which it holds as
    ``self.model`` (its weights are ``model.*`` in ``model.safetensors``). Registered with
    ``AutoConfig`` / ``AutoModelForCausalLM`` under ``model_type = "aftlab"`` when
    :mod:`aftlab.hf` is imported.

    Args:
        config: an :class:`AftlabConfig`.

    Example:
        >>> import torch
        >>> from aftlab.hf import AftlabConfig, AftlabForCausalLM
        >>> cfg = AftlabConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2,
        ...                    max_seq_len=32, mixer="aft-simple")
        >>> model = AftlabForCausalLM(cfg).eval()
        >>> model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=5,
        ...                do_sample=False).shape
        torch.Size([1, 8])
    """

    config_class = AftlabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # transformers refuses assisted generation, which would rewind the state
    _no_split_modules = ["TransformerBlock"]
    # tied head: transformers 5 reads a {target: source} dict (only when tie_word_embeddings)
    _tied_weights_keys = {"model.head.weight": "model.backbone.token_embedding.weight"}

    def __init__(self, config: AftlabConfig) -> None:
        super().__init__(config)
        self.model = TransformerLM(config.to_transformer_config())
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: aftlab's modules initialise themselves when built."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state is aftlab's DecodingCache, never a transformers Cache

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """transformers' ``from_pretrained``, refusing damaged files and weights of a local
        folder that are not floating point (transformers would cast int, bool and complex).

        Raises:
            ValueError: a JSON file nested too deeply, a ``.safetensors`` file safetensors
                cannot read, or a weight of another dtype than the model can take
                (:func:`aftlab._checks.check_state_dtypes`); the message names the folder.
        """
        where = f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r})"
        try:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except (RecursionError, SafetensorError) as e:
            what = "JSON file" if isinstance(e, RecursionError) else ".safetensors file"
            raise ValueError(f"{where}: a {what} is damaged ({reason(e)})") from None
        name, local = pretrained_model_name_or_path, []
        if isinstance(name, (str, PathLike)) and Path(name).is_dir():  # a hub model: not read
            local = sorted(Path(name, kwargs.get("subfolder") or "").glob("*.safetensors"))
        own = model.state_dict()
        for path in local:
            with safe_open(str(path), framework="pt") as f:
                slices = {k: f.get_slice(k) for k in f.keys()}
                # an empty slice gives the dtype without reading the data (0-d: one element)
                dtypes = {k: (s[:0] if s.get_shape() else s[...]).dtype for k, s in slices.items()}
            check_state_dtypes(f"{where}: {path.name}", dtypes, own)
        return model

    # ------------------------------------------------------------------ embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.backbone.token_embedding

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.backbone.token_embedding = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.head = value

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DecodingCache | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> AftlabCausalLMOutput | tuple:
        """Next-token logits, the loss for ``labels``, and the decoding state.

        Without ``cache``: the whole sequence in one pass; with ``use_cache`` (the config's
        default) through the mixers' one-pass prefill, which also returns the state. With
        ``cache``: ``input_ids`` are the tokens after those the state has seen, fed one by one
        (``TransformerLM.step``); the state is updated in place.

        Args:
            input_ids: ``(B, T)`` token ids.
            attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding. Padding is honoured
                only without a state (``use_cache=False``, no ``cache``).
            cache: a :class:`~aftlab.models.DecodingCache` from an earlier call (also accepted
                as ``past_key_values``).
            labels: ``(B, T)`` ids; the loss is ``CE(logits[:, t], labels[:, t + 1])``
                averaged over the labels that are not ``-100``.
            use_cache: return the decoding state (default ``config.use_cache``, False when
                ``attention_mask`` has padding).
            logits_to_keep: compute the logits of the last ``logits_to_keep`` positions only
                (0: all).
            return_dict: False returns a tuple ``(loss?, logits, cache?)``.
            **kwargs: ``past_key_values`` (transformers 4's name of ``cache``); any other
                argument must be None or False (``position_ids``: positions come from the
                state).

        Returns:
            :class:`AftlabCausalLMOutput`: ``logits`` ``(B, T', vocab_size)``.
        """
        where = type(self).__name__
        state = kwargs.pop("past_key_values", None) if cache is None else cache
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if unsupported:
            raise TypeError(f"{where}.forward: unsupported argument(s) {unsupported}")
        if input_ids is None:
            raise ValueError(
                f"{where}.forward: 'input_ids' is required (inputs_embeds is not supported)"
            )
        if (
            isinstance(logits_to_keep, bool)
            or not isinstance(logits_to_keep, int)
            or logits_to_keep < 0
        ):
            raise ValueError(
                f"{where}.forward: 'logits_to_keep' must be an int >= 0, got {logits_to_keep!r}"
            )
        padded = attention_mask is not None and not bool(attention_mask.all())
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and not padded
        lm = self.model
        # named as the caller wrote it; the model's entries check again under their own names
        check_tokens(where, "input_ids", input_ids, ndim=2, vocab_size=lm.config.vocab_size)
        if state is not None or use_cache:
            if padded:
                raise ValueError(
                    f"{where}.forward: 'attention_mask' has padding (zeros), which aftlab's "
                    "decoding state cannot skip; pass use_cache=False, or prompts of equal "
                    "length without padding"
                )
            if state is None:
                logits, state = lm.prefill(input_ids, logits_to_keep=logits_to_keep)
            else:
                if not isinstance(state, DecodingCache):
                    raise TypeError(
                        f"{where}.forward: 'cache' must be the DecodingCache this model "
                        f"returned, got {type(state).__name__}"
                    )
                logits = torch.stack([lm.step(t, state) for t in input_ids.unbind(1)], dim=1)
                logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        else:
            mask = attention_mask.bool() if padded else None
            logits = lm(input_ids, padding_mask=mask, logits_to_keep=logits_to_keep)
        loss = None
        if labels is not None:
            if logits.shape[1] != labels.shape[1]:
                raise ValueError(
                    f"{where}.forward: 'labels' must have shape {tuple(logits.shape[:2])} (one "
                    f"per position with logits), got {tuple(labels.shape)}"
                )
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        out = AftlabCausalLMOutput(loss=loss, logits=logits, cache=state)
        return out if return_dict is not False else out.to_tuple()

    # ------------------------------------------------------------------ generate
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``: greedy or sampling (temperature, top-k, top-p, ...).

        Raises:
            ValueError: ``num_beams > 1`` (aftlab's state is not reordered between beams).
        """
        generation_config = kwargs.get("generation_config") or self.generation_config
        beams = kwargs.get("num_beams", generation_config.num_beams)
        if beams is not None and beams > 1:
            raise ValueError(
                f"{type(self).__name__}.generate: beam search (num_beams={beams}) is not "
                "supported; use greedy (do_sample=False) or sampling (do_sample=True)"
            )
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        cache: DecodingCache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The next ``forward``'s inputs: the tokens the state has not seen, and the state.

        The other keywords of ``generate``'s loop (``next_sequence_length``, ``cache_position``,
        ``is_first_iteration``, ...) are not needed: the state knows its position.
        """
        if cache is not None:
            input_ids = input_ids[:, cache.position :]
        return {
            "input_ids": input_ids,
            "cache": cache,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
            "logits_to_keep": 1,  # generate reads the last position only
        }

    def _update_model_kwargs_for_generation(
        self,
        outputs: ModelOutput,
        model_kwargs: dict[str, Any],
        is_encoder_decoder: bool = False,
        num_new_tokens: int = 1,
    ) -> dict[str, Any]:
        """transformers' update, then the state under ``cache`` (transformers 4 reads
        ``past_key_values`` only)."""
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs,
            model_kwargs,
            is_encoder_decoder=is_encoder_decoder,
            num_new_tokens=num_new_tokens,
        )
        model_kwargs["cache"] = outputs.get("cache")
        return model_kwargs
