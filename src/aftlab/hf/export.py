"""Export a trained run folder to a transformers folder (``aftlab export RUN_DIR OUT_DIR``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from .._system import proc_field
from ..data import byte_level
from ..errors import UsageError
from ..models.rwkv4 import RWKV4LM
from ..models.transformer import TransformerLM
from ..train.run import load_run
from .configuration import AftlabConfig
from .modeling import AftlabForCausalLM
from .tokenizer import write_byte_tokenizer

__all__ = ["export_run"]


def _umask() -> int:
    """The process's umask: read from ``/proc`` where it can be (setting it to read it, the
    only portable way, leaves a moment in which another thread creates files without one)."""
    if shown := proc_field("self/status", "Umask"):
        return int(shown, 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the newest checkpoint of ``run_dir`` as a ``save_pretrained`` folder ``out_dir``.

    The newest checkpoint is the one ``aftlab eval`` and ``aftlab sample`` use (a run keeps its
    last ``keep_last`` checkpoints, and no "best" one). ``out_dir`` gets ``config.json``
    (an :class:`AftlabConfig`), ``model.safetensors`` and ``generation_config.json``, and for a
    byte-level text task (:func:`aftlab.data.byte_level`: text, enwik8, text8) the byte
    tokenizer (:func:`~aftlab.hf.tokenizer.write_byte_tokenizer`: ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``). A run of another language-model
    task (recall, copy: ids that are not text) gets no tokenizer: its ids are used as they are.
    A run of ``model.architecture = "rwkv4"`` is written in transformers' own format
    (``RwkvForCausalLM``: :meth:`~aftlab.models.RWKV4LM.save_pretrained`), with the same
    tokenizer. ``out_dir`` is written in a temporary folder beside it and renamed into place,
    so it is complete or absent.

    Args:
        run_dir: a folder written by ``aftlab train`` on a language-model task (text, enwik8, ...).
        out_dir: a folder that does not exist yet, or an empty one.

    Returns:
        ``out_dir``.

    Raises:
        UsageError: no such run or no checkpoint, damaged checkpoint, non-finite weights, a run
            that is not a causal language model (pixel model, classifier), or an ``out_dir``
            that is a file or not empty.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise UsageError(f"OUT_DIR {str(out)!r} {what}; choose a new folder")
    run = load_run(run_dir, load_task=False)
    if type(run.model) not in (TransformerLM, RWKV4LM):
        raise UsageError(
            f"run {str(run_dir)!r} holds a {type(run.model).__name__} (task "
            f"{run.config.task!r}); export writes causal language models (e.g. --task text)"
        )
    for name, param in run.model.named_parameters():
        if not torch.isfinite(param).all():
            raise UsageError(
                f"the weights in {str(run.checkpoint)!r} are not finite (NaN or inf in {name}): "
                "the run diverged"
            )
    if isinstance(run.model, RWKV4LM):
        model = run.model  # transformers' own format (RwkvForCausalLM)
    else:
        model = AftlabForCausalLM(AftlabConfig.from_transformer_config(run.model_config))
        model.model.load_state_dict(run.model.state_dict())
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # as mkdir makes a folder (mkdtemp's is 0700)
        model.save_pretrained(tmp)
        if byte_level(run.task_info):
            write_byte_tokenizer(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as e:
        raise UsageError(f"could not write {str(out)!r}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
