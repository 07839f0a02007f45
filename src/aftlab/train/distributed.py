"""Data parallel training: DDP (a full replica per process) or FSDP2 (sharded), and their states.

``parallel = "ddp"`` (the default) wraps the model in ``DistributedDataParallel``: every process
holds the whole model, its gradients and its optimizer moments. ``parallel = "fsdp"`` shards
them with FSDP2 (``torch.distributed.fsdp.fully_shard``): each transformer block is one unit,
then the root (embeddings, head, final norm); a process keeps ``1/N`` of every parameter, its
gradient and its AdamW moments, and all-gathers a block's weights just for that block's forward
and backward. The loss and the gradients are the same in both: each rank backpropagates
``N * nll_sum / n_global`` and both average the gradients over the ``N`` ranks.

Checkpoints stay the single-process format (``model.safetensors`` and ``train_state.*`` of
:mod:`aftlab.train.checkpoint`): :func:`full_model_state` and :func:`full_optimizer_state` gather
the full state to rank 0's CPU with ``torch.distributed.checkpoint.state_dict``
(``full_state_dict=True, cpu_offload=True``), and a resume loads the full weights before
sharding and :func:`load_optimizer_state` shards the full optimizer state again
(``set_optimizer_state_dict(full_state_dict=True)``). A run saved with ``N`` processes therefore
resumes with any ``M`` (one included), under either ``parallel``, and ``eval``, ``sample`` and
``export`` read it like any run. DCP's own ``dcp.save`` format is not used: its ``.metadata``
file is read back with ``pickle.load`` (``FileSystemReader.read_metadata``), and nothing aftlab
reads from disk may run code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "wrap_model",
    "is_sharded",
    "no_grad_sync",
    "weights_finite",
    "full_model_state",
    "full_optimizer_state",
    "load_optimizer_state",
]


def wrap_model(model: nn.Module, *, parallel: str, device: torch.device) -> nn.Module:
    """The module that trains ``model`` across the process group (call with a group only).

    ``"ddp"``: a ``DistributedDataParallel`` wrapper (``model`` is unchanged). ``"fsdp"``:
    ``fully_shard`` on every block (:class:`~aftlab.models.blocks.TransformerBlock`,
    :class:`~aftlab.models.rwkv4.RWKV4Block`), then on the root;
    this shards ``model`` itself in place (its parameters become ``DTensor`` shards), and it is
    returned. Build the optimizer after this call.
    """
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from ..models.blocks import TransformerBlock
        from ..models.rwkv4 import RWKV4Block

        for module in list(model.modules()):
            if isinstance(module, (TransformerBlock, RWKV4Block)):
                fully_shard(module)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def is_sharded(model: nn.Module) -> bool:
    """``model`` was sharded by :func:`wrap_model` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no all-reduce / reduce-scatter) inside the block.

    ``model`` is the training module (DDP wrapper, FSDP2 module, or either under
    ``torch.compile``).
    """
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if is_sharded(inner):
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
    else:
        with inner.no_sync() if hasattr(inner, "no_sync") else nullcontext():
            yield


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def weights_finite(model: nn.Module, *, device: torch.device) -> bool:
    """Every weight of every rank is finite (each rank checks its shard; collective)."""
    ok = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
    flag = torch.tensor(float(ok), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag > 0)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on rank 0's CPU; ``{}`` on the other ranks (collective).

    A tied weight (the head that is the token embedding) is kept under the first of its names in
    sorted order, as safetensors' ``save_model`` keeps it, so the file is a single process's.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options())
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for tied in names.values():
        for name in sorted(tied)[1:]:
            state.pop(name, None)
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state on rank 0's CPU, as ``optimizer.state_dict()`` lays it out.

    ``get_optimizer_state_dict`` keys the state by parameter name; this renumbers it the way a
    single process's ``optimizer.state_dict()`` does (parameters counted in param-group order),
    so the checkpoint is the one a single process writes. ``{}`` on the other ranks (collective).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=_options())
    if not osd:
        return {}
    order = [name for group in osd["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[name] for name in g["params"]]} for g in osd["param_groups"]
        ],
    }


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a full ``optimizer.state_dict()`` (every rank passes it) into a sharded optimizer.

    The inverse of :func:`full_optimizer_state`: parameter ``i`` (in param-group order) gets its
    name in ``model``, then ``set_optimizer_state_dict`` keeps this rank's shard of each moment.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = state["param_groups"]
    if sum(len(g["params"]) for g in groups) != len(order):
        raise ValueError(
            f"the optimizer state has {sum(len(g['params']) for g in groups)} parameters, "
            f"the model {len(order)}"
        )
    osd = {
        "state": {order[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in groups],
    }
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))
