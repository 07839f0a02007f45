"""RWKV-4 and transformers' own class: :func:`to_transformers`.

An RWKV-4 folder is transformers' ``RwkvForCausalLM`` format: ``RWKV4LM.save_pretrained``
writes it, ``RWKV4LM.from_pretrained`` reads it (and transformers' own folders), and
``AutoModelForCausalLM.from_pretrained(folder)`` loads transformers' class from it
(docs/huggingface.md, "RWKV-4"). In memory, :func:`to_transformers` gives transformers' model of
an :class:`~aftlab.models.RWKV4LM` and ``RWKV4LM.from_hf`` the reverse.

Example:
    >>> import torch
    >>> from aftlab.hf import to_transformers
    >>> from aftlab.models import RWKV4Config, RWKV4LM
    >>> lm = RWKV4LM(RWKV4Config(vocab_size=50, d_model=32, n_layers=2)).eval()
    >>> hf = to_transformers(lm)
    >>> type(hf).__name__, hf.training
    ('RwkvForCausalLM', False)
    >>> idx = torch.randint(0, 50, (2, 7))
    >>> torch.allclose(hf(idx).logits, lm(idx), rtol=1e-5, atol=1e-5)
    True
"""

from __future__ import annotations

import torch
import transformers

from ..models.rwkv4 import RWKV4LM
from ..models.rwkv4_io import hf_config_dict, hf_state_dict

__all__ = ["to_transformers"]


def to_transformers(model: RWKV4LM) -> transformers.RwkvForCausalLM:
    """transformers' ``RwkvForCausalLM`` with ``model``'s weights (copied: the two share no
    tensor), in their dtypes (the decays and bonuses float32), on their device, in
    ``model``'s mode.

    Its logits equal ``model``'s within float32 rounding, and its greedy ``generate`` gives
    ``model.generate(..., temperature=0)``'s tokens (a batch of one: transformers 5.24's
    one-token step mixes the rows of a larger batch). ``RWKV4LM.from_hf`` is the reverse.

    Raises:
        TypeError: ``model`` is not an :class:`~aftlab.models.RWKV4LM`.
    """
    if not isinstance(model, RWKV4LM):
        raise TypeError(
            f"to_transformers: 'model' must be an RWKV4LM, got {type(model).__name__}"
        )
    config = transformers.RwkvConfig.from_dict(hf_config_dict(model.config))
    with torch.device("meta"):  # no initialisation to pay: every tensor is assigned
        hf = transformers.RwkvForCausalLM(config)
    hf.load_state_dict(hf_state_dict(model), strict=True, assign=True)
    if model.config.tie_embeddings:
        hf.head.weight = hf.rwkv.embeddings.weight
    return hf.train(model.training)
