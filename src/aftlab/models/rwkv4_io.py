"""Loading and saving RWKV-4 checkpoints: Hugging Face folders and BlinkDL ``.pth`` files.

Nothing read runs code: ``config.json`` is JSON, weights are safetensors or
``torch.load(weights_only=True)``. The names (docs/rwkv.md, "Loading"):

* Hugging Face (``RwkvForCausalLM``): ``rwkv.embeddings``, ``rwkv.blocks.{i}.{ln1,ln2}``,
  ``rwkv.blocks.0.pre_ln``, ``rwkv.blocks.{i}.attention.{time_decay, time_first,
  time_mix_{key,value,receptance}, key, value, receptance, output}``,
  ``rwkv.blocks.{i}.feed_forward.{time_mix_{key,receptance}, key, receptance, value}``,
  ``rwkv.ln_out``, ``head``; the mixes ``(1, 1, d)``.
* BlinkDL: the same without ``rwkv.``, with ``emb``, ``ln0``, ``att``, ``ffn`` and
  ``time_mix_{k,v,r}`` (transformers' ``convert_rwkv_checkpoint_to_hf.py``, inverted).
"""

from __future__ import annotations

import json
import pickle
import re
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import RWKV4Config
from .rwkv4 import RWKV4LM

__all__ = [
    "load_rwkv4",
    "save_rwkv4",
    "from_hf_model",
    "hf_names",
    "hf_state_dict",
    "blinkdl_to_hf",
    "hf_config_dict",
    "config_from_hf",
]

#: aftlab's name of each per-block tensor -> Hugging Face's (after ``rwkv.blocks.{i}.``)
_BLOCK = {
    "ln1.weight": "ln1.weight",
    "ln1.bias": "ln1.bias",
    "ln2.weight": "ln2.weight",
    "ln2.bias": "ln2.bias",
    "att.time_decay": "attention.time_decay",
    "att.time_bonus": "attention.time_first",
    "att.mix_k": "attention.time_mix_key",
    "att.mix_v": "attention.time_mix_value",
    "att.mix_q": "attention.time_mix_receptance",
    "att.to_k.weight": "attention.key.weight",
    "att.to_v.weight": "attention.value.weight",
    "att.to_q.weight": "attention.receptance.weight",
    "att.proj.weight": "attention.output.weight",
    "ffn.mix_k": "feed_forward.time_mix_key",
    "ffn.mix_r": "feed_forward.time_mix_receptance",
    "ffn.key.weight": "feed_forward.key.weight",
    "ffn.receptance.weight": "feed_forward.receptance.weight",
    "ffn.value.weight": "feed_forward.value.weight",
}
_TOP = {
    "embeddings.weight": "rwkv.embeddings.weight",
    "ln0.weight": "rwkv.blocks.0.pre_ln.weight",
    "ln0.bias": "rwkv.blocks.0.pre_ln.bias",
    "ln_out.weight": "rwkv.ln_out.weight",
    "ln_out.bias": "rwkv.ln_out.bias",
    "head.weight": "head.weight",
}
#: kept in float32 whatever the weights' dtype (as Hugging Face and ChatRWKV keep them)
_FLOAT32 = ("att.time_decay", "att.time_bonus")
#: the token-shift mixes: ``(d,)`` in aftlab, ``(1, 1, d)`` in Hugging Face's and BlinkDL's files
_MIXES = ("mix_k", "mix_v", "mix_q", "mix_r")


def hf_names(n_layers: int) -> dict[str, str]:
    """aftlab's parameter names -> Hugging Face's, for ``n_layers`` blocks."""
    names = dict(_TOP)
    for i in range(n_layers):
        names.update({f"blocks.{i}.{a}": f"rwkv.blocks.{i}.{h}" for a, h in _BLOCK.items()})
    return names


def hf_state_dict(
    model: RWKV4LM, *, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """``model``'s tensors under Hugging Face's names (:func:`hf_names`; the mixes
    ``(1, 1, d)``): detached, contiguous copies on ``device`` (default: the model's), in their
    dtypes. A tied head is there too, as ``head.weight``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for ours, theirs in hf_names(model.config.n_layers).items():
        t = params[ours].detach()
        if ours.endswith(_MIXES):
            t = t.reshape(1, 1, -1)
        out[theirs] = t.to(device=device or t.device, copy=True).contiguous()
    return out


def blinkdl_to_hf(name: str) -> str:
    """A BlinkDL ``.pth`` tensor name as Hugging Face names it."""
    if name.startswith("emb."):
        name = "embeddings." + name[4:]
    name = name.replace("blocks.0.ln0.", "blocks.0.pre_ln.")
    name = re.sub(r"^blocks\.(\d+)\.att\.", r"blocks.\1.attention.", name)
    name = re.sub(r"^blocks\.(\d+)\.ffn\.", r"blocks.\1.feed_forward.", name)
    name = re.sub(r"\.time_mix_k$", ".time_mix_key", name)
    name = re.sub(r"\.time_mix_v$", ".time_mix_value", name)
    name = re.sub(r"\.time_mix_r$", ".time_mix_receptance", name)
    return name if name == "head.weight" else "rwkv." + name


# --------------------------------------------------------------------------- configs
def config_from_hf(data: dict[str, Any], *, where: str = "config.json") -> RWKV4Config:
    """The :class:`RWKV4Config` of a Hugging Face ``RwkvConfig`` dict."""
    if data.get("model_type") not in (None, "rwkv"):
        raise ValueError(
            f"{where}: 'model_type' must be 'rwkv' (an RWKV-4 model), got {data['model_type']!r}"
        )
    d = data.get("hidden_size", 4096)
    att = data.get("attention_hidden_size")
    if att is not None and att != d:
        raise ValueError(
            f"{where}: 'attention_hidden_size' {att} differs from 'hidden_size' {d}; aftlab's "
            "RWKV-4 has the time mix as wide as the model (as every released checkpoint)"
        )
    try:
        return RWKV4Config(
            vocab_size=data.get("vocab_size", 50277),
            d_model=d,
            n_layers=data.get("num_hidden_layers", 32),
            d_ff=data.get("intermediate_size"),
            max_seq_len=data.get("context_length", 1024),
            layer_norm_eps=data.get("layer_norm_epsilon", 1e-5),
            rescale_every=data.get("rescale_every", 6),
            tie_embeddings=data.get("tie_word_embeddings", False),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def hf_config_dict(config: RWKV4Config) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``config`` (``RwkvConfig``'s fields)."""
    return {
        "architectures": ["RwkvForCausalLM"],
        "model_type": "rwkv",
        "vocab_size": config.vocab_size,
        "context_length": config.max_seq_len,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "attention_hidden_size": config.d_model,
        "intermediate_size": config.resolved_d_ff,
        "layer_norm_epsilon": config.layer_norm_eps,
        "rescale_every": config.rescale_every,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    }


def _config_from_tensors(hf: dict[str, torch.Tensor], where: str) -> RWKV4Config:
    """The shape of a BlinkDL checkpoint, read off its tensors (HF names)."""
    try:
        V, d = hf["rwkv.embeddings.weight"].shape
        d_ff = hf["rwkv.blocks.0.feed_forward.key.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"{where}: no tensor {e.args[0]!r}: not an RWKV-4 checkpoint") from None
    blocks = {int(m.group(1)) for n in hf if (m := re.match(r"rwkv\.blocks\.(\d+)\.", n))}
    return RWKV4Config(vocab_size=V, d_model=d, n_layers=max(blocks) + 1, d_ff=d_ff)


# --------------------------------------------------------------------------- reading
def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)``: a pickle that would build anything but tensors and
    plain containers fails with one line, having run nothing."""
    try:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # an old (non-zip) file cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path}: not a weights-only checkpoint, refused without running it ({first})"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"{path}: expected a dict of tensors (a state dict)")
    return data


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's tensors: one or sharded safetensors, else ``pytorch_model.bin``."""
    for index, read in (
        ("model.safetensors.index.json", _read_safetensors),
        ("pytorch_model.bin.index.json", _torch_load),
    ):
        if (folder / index).is_file():
            weight_map = _read_json(folder / index).get("weight_map", {})
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                tensors.update(read(folder / shard))
            return tensors
    if (folder / "model.safetensors").is_file():
        return _read_safetensors(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        return _torch_load(folder / "pytorch_model.bin")
    raise ValueError(
        f"{folder}: no weights (model.safetensors, pytorch_model.bin or a sharded index)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _state_dict(
    hf: dict[str, torch.Tensor], model: RWKV4LM, where: str
) -> dict[str, torch.Tensor]:
    """aftlab's state dict of Hugging Face-named tensors: every tensor present, none left over,
    each of the parameter's shape (the mixes from ``(1, 1, d)``)."""
    names = hf_names(model.config.n_layers)
    if model.config.tie_embeddings:
        names.pop("head.weight")
        hf = {k: v for k, v in hf.items() if k != "head.weight"}
    missing = sorted(h for h in names.values() if h not in hf)
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = sorted(set(hf) - set(names.values()))
    if unexpected:
        raise ValueError(
            f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} not RWKV-4's)"
        )
    params = dict(model.named_parameters())
    out = {}
    for ours, theirs in names.items():
        t, want = hf[theirs], params[ours].shape
        if t.numel() == want.numel() and t.dim() == 3 and t.shape[:2] == (1, 1):
            t = t.reshape(want)
        if t.shape != want:
            raise ValueError(
                f"{where}: tensor {theirs!r} has shape {tuple(t.shape)}, expected {tuple(want)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{where}: tensor {theirs!r} is {t.dtype}, expected a float dtype")
        out[ours] = t
    return out


def _build(
    config: RWKV4Config,
    hf: dict[str, torch.Tensor],
    where: str,
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> RWKV4LM:
    with torch.device("meta"):  # no initialisation to pay: every tensor is loaded
        model = RWKV4LM(config)
    sd = _state_dict(hf, model, where)
    dtype = dtype or torch.float32
    sd = {
        k: v.to(device=device or "cpu", dtype=torch.float32 if k.endswith(_FLOAT32) else dtype)
        for k, v in sd.items()
    }
    model.load_state_dict(sd, assign=True, strict=not config.tie_embeddings)
    if config.tie_embeddings:
        model.head.weight = model.embeddings.weight
    return model.eval()


def load_rwkv4(
    path: str | PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> RWKV4LM:
    """An :class:`RWKV4LM` from a Hugging Face folder or a BlinkDL ``.pth`` file, in eval mode.

    Args:
        path: a folder with ``config.json`` (``model_type: "rwkv"``) and ``model.safetensors``
            (or a sharded index, or ``pytorch_model.bin``); or a BlinkDL ``.pth`` (its shape read
            off the tensors: vocabulary and width from ``emb``, the blocks, the channel mix's
            width; ``max_seq_len`` 1024, ``rescale_every`` 6, as the released models).
        dtype: the weights' dtype (default float32); the decays and bonuses stay float32 and
            the WKV runs in float32 for float16/bfloat16.
        device: where the weights go (default CPU).

    Raises:
        FileNotFoundError: no such path.
        ValueError: a config or weights file that cannot be read, a pickle that is not weights
            only, a missing or unexpected tensor (named), a tensor of another shape.
    """
    p = Path(path)
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{p}: no config.json (not a Hugging Face model folder)")
        config = config_from_hf(_read_json(cfg_file), where=str(cfg_file))
        return _build(config, _read_folder(p), str(p), dtype=dtype, device=device)
    if p.is_file():
        hf = {blinkdl_to_hf(k): v for k, v in _torch_load(p).items()}
        return _build(_config_from_tensors(hf, str(p)), hf, str(p), dtype=dtype, device=device)
    raise FileNotFoundError(f"{p}: no such file or folder")


def from_hf_model(hf_model: nn.Module, *, dtype: torch.dtype | None = None) -> RWKV4LM:
    """An :class:`RWKV4LM` with the weights of a transformers ``RwkvForCausalLM`` (copied; in
    the mode of ``hf_model``), in ``dtype`` (default ``hf_model``'s; the decays and bonuses
    stay float32, as :func:`load_rwkv4` keeps them). Weights HF has rescaled in place for
    inference are read back at their trained scale."""
    config = config_from_hf(hf_model.config.to_dict(), where="RwkvConfig")
    hf = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if getattr(getattr(hf_model, "rwkv", None), "layers_are_rescaled", False) and (
        r := config.rescale_every
    ):
        for i in range(config.n_layers):
            for name in ("attention.output.weight", "feed_forward.value.weight"):
                hf[f"rwkv.blocks.{i}.{name}"] *= 2 ** (i // r)
    dtype = dtype or hf_model.rwkv.embeddings.weight.dtype
    model = _build(config, hf, "RwkvForCausalLM", dtype=dtype, device=None)
    return model.train(hf_model.training)


# --------------------------------------------------------------------------- writing
def save_rwkv4(model: RWKV4LM, path: str | PathLike) -> Path:
    """Write ``model`` as a Hugging Face folder: ``config.json`` and ``model.safetensors``.

    transformers' ``RwkvForCausalLM.from_pretrained(path)`` loads it back with equal logits.
    ``path`` must not exist yet or be an empty folder (nothing already there is overwritten).
    """
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise ValueError(f"save_pretrained: {str(out)!r} {what}; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, device="cpu")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2) + "\n")
    return out

