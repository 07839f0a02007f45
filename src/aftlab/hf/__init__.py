"""Hugging Face transformers integration: aftlab language models as transformers models.

Importing this package registers ``model_type = "aftlab"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_pretrained(folder)`` loads a folder
written by ``save_pretrained`` or ``aftlab export`` (safetensors weights, JSON config; for a
byte-level text run also the byte tokenizer of :mod:`aftlab.hf.tokenizer`, which
``AutoTokenizer`` loads). RWKV-4 needs no registration (its folders are transformers' own
``RwkvForCausalLM``): :func:`to_transformers` converts an :class:`~aftlab.models.RWKV4LM` in
memory. Needs the ``hf`` extra: ``pip install 'aftlab[hf]'`` (docs/huggingface.md).

Example:
    >>> import torch
    >>> from aftlab.hf import AftlabConfig, AftlabForCausalLM
    >>> model = AftlabForCausalLM(AftlabConfig(vocab_size=256, d_model=32, n_layers=2,
    ...                                        n_heads=2, max_seq_len=64, mixer="aft-full"))
    >>> model.eval().generate(torch.tensor([[104, 105]]), max_new_tokens=4).shape
    torch.Size([1, 6])
"""

from __future__ import annotations

try:
    import transformers
except ImportError as e:  # pragma: no cover - the hf extra is missing
    raise ImportError("aftlab.hf needs Hugging Face transformers: pip install 'aftlab[hf]'") from e

from .configuration import AftlabConfig
from .export import export_run
from .modeling import AftlabCausalLMOutput, AftlabForCausalLM
from .rwkv4 import to_transformers
from .tokenizer import byte_tokenizer, write_byte_tokenizer

__all__ = [
    "AftlabConfig",
    "AftlabForCausalLM",
    "AftlabCausalLMOutput",
    "export_run",
    "byte_tokenizer",
    "write_byte_tokenizer",
    "to_transformers",
]

transformers.AutoConfig.register(AftlabConfig.model_type, AftlabConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(AftlabConfig, AftlabForCausalLM, exist_ok=True)
