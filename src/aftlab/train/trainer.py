"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, bf16, DDP/FSDP, checkpoints.

One optimizer step reads the step's global batch of ``batch_size`` sequences: with ``N``
processes each rank reads its ``batch_size / N`` rows (``task.train_batch(step, rank=r,
world_size=N)``) and splits them into ``grad_accum`` micro-batches. The loss is the mean
negative log-likelihood over every scored target of the global batch,

    L = (1 / n_global) * sum_{ranks, micro-batches, positions} -log p(target),

so each micro-batch backpropagates ``N * nll_sum / n_global`` (DDP and FSDP average gradients
over the ``N`` ranks; :mod:`aftlab.train.distributed`). The result does not depend on ``N`` or
``grad_accum`` beyond float rounding.

With ``carry_state`` a step reads ``k = carry_grad_windows`` consecutive windows of every stream
(:meth:`~aftlab.data.ByteLMTask.consecutive_windows`) and each micro-batch carries its rows'
:class:`~aftlab.models.DecodingCache` from step to step (:mod:`aftlab.train.streams`); with
``pack_documents`` each micro-batch is packed into one row of documents
(:func:`~aftlab.data.base.pack_rows`).

Resuming restores weights, optimizer, step and every RNG (and the carried state); the data
position *is* the step, so a resumed run reads the batches an uninterrupted run reads and ends
with the same weights.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import random
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .._json import dumps
from .._system import memory_baseline, peak_memory_since
from ..data.base import IGNORE_INDEX, DataError, count_correct, pack_rows
from ..errors import UsageError
from .build import build_model, build_task, check_training_memory, model_config_for
from .checkpoint import (
    CARRIED_FILE,
    LOCK_FILE,
    RunLock,
    _write_error,
    atomic_write_text,
    latest_checkpoint,
    load_carried_state,
    load_checkpoint,
    open_run_file,
    rng_state,
    run_started,
    save_checkpoint,
    set_rng_state,
)
from .config import TrainConfig, resume_conflicts, to_toml
from .distributed import (
    full_model_state,
    full_optimizer_state,
    load_optimizer_state,
    no_grad_sync,
    weights_finite,
    wrap_model,
)
from .optim import build_optimizer, lr_at
from .progress import Progress, format_duration
from .run import read_run_config
from .streams import (
    CarriedWindows,
    cache_rows,
    cat_caches,
    flatten_state,
    restore_state,
    stream_refusal,
)
from .tensorboard import TB_DIR, TensorBoardLog, check_tensorboard

__all__ = [
    "Trainer",
    "evaluate",
    "forward_batch",
    "scored_forward",
    "resolve_device",
    "DistInfo",
]

# --------------------------------------------------------------------------- devices, processes


def resolve_device(name: str, *, arg: str = "--set device", local_rank: int = 0) -> torch.device:
    """The device ``name`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``: checked where it is
    read) on this machine; ``"auto"`` is CUDA (this process's local rank) when available.

    The one check that the machine has the device, named ``arg`` in the error.

    Raises:
        UsageError: CUDA is not available, or there is no ``cuda:N``.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"{arg} is {name!r} but CUDA is not available here; use cpu")
        if name != "cuda" and int(name[5:]) >= count:
            raise UsageError(
                f"{arg} is {name!r} but this machine has {count} CUDA device(s): cuda:0 .. "
                f"cuda:{count - 1}"
            )
        if name == "cuda":
            name = f"cuda:{local_rank}"
    return torch.device(name)


@dataclass
class DistInfo:
    """This process's place in a multi-process run (``rank 0 of 1`` without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_distributed(device_name: str) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).

    Uses NCCL on CUDA and gloo on CPU. Without torchrun's variables this is one process.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = DistInfo(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, local_rank=info.local_rank)
    if info.active and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info, device


# --------------------------------------------------------------------------- forward, loss, eval


def forward_batch(
    model: nn.Module, batch: dict[str, torch.Tensor], *, wrapper: nn.Module | None = None
) -> torch.Tensor:
    """Logits ``(B, T, V)`` (language and pixel models) or ``(B, C)`` (classifiers) of a batch.

    Every model says which entries of a task batch its ``forward`` reads: ``model(
    **model.batch_input(batch))`` (a language model or classifier ``batch["input"]`` and its
    padding mask, a :class:`~aftlab.models.PixelTransformer` the pixels ``batch["target"]``).

    Args:
        model: the model (plain, or sharded in place by FSDP).
        batch: a task batch, ``input`` and ``target`` ``(B, T)``.
        wrapper: called instead of ``model`` with the same arguments: its ``torch.compile`` or
            DDP wrapper.
    """
    return (model if wrapper is None else wrapper)(**model.batch_input(batch))


@functools.cache
def _takes_logits_mask(model_type: type) -> bool:
    return "logits_mask" in inspect.signature(model_type.forward).parameters


def scored_forward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    wrapper: nn.Module | None = None,
    select: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets of a batch's scored positions, for :func:`nll_sum`.

    Where at most half of a language model's targets are scored (the rest ``-100``: a recall
    task scores its queries only) and its ``forward`` takes ``logits_mask``, the head runs at
    the scored positions only: ``(n, V)`` logits and ``(n,)`` targets, the rows of the full
    ``(B, T, V)`` ones there. The head and its softmax cost ``V`` per position, most of a small
    model's step at a large vocabulary. Otherwise (a text batch, scored everywhere but at a
    window's or document's first bytes) :func:`forward_batch`'s logits and
    ``batch["target"]``, as before.

    Args:
        model: the model (plain, or sharded in place by FSDP).
        batch: a task batch, ``input`` and ``target``.
        wrapper: called instead of ``model`` (:func:`forward_batch`).
        select: False: always the full logits (a ``torch.compile`` wrapper, whose graph a
            data-dependent shape would break).
    """
    target = batch["target"]
    if select and target.ndim == 2 and _takes_logits_mask(type(model)):
        keep = target != IGNORE_INDEX
        if 2 * int(keep.sum()) <= keep.numel():
            call = model if wrapper is None else wrapper
            return call(**model.batch_input(batch), logits_mask=keep), target[keep]
    return forward_batch(model, batch, wrapper=wrapper), target


def nll_sum(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy (nats) over scored targets and their count; computed in fp32.

    ``nll = sum_{i: y_i != -100} -log softmax(z_i)[y_i]``.
    """
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (target != IGNORE_INDEX).sum()


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Any,
    split: str,
    *,
    batch_size: int,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> dict[str, float]:
    """Mean loss and the task's metric on ``split``.

    Returns:
        ``{"loss": mean nll in nats, task.metric: value, "targets": scored targets}``; the bits
        metrics are ``loss / ln 2``, accuracy is correct / scored arg-max predictions.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, count, correct = 0.0, 0, 0
    try:
        for batch in task.eval_batches(split, batch_size=batch_size, max_batches=max_batches):
            batch = {k: v.to(device) for k, v in batch.items()}
            with _autocast(device, precision):
                logits, target = scored_forward(model, batch)
            s, n = nll_sum(logits, target)
            total += float(s)
            count += int(n)
            if task.metric == "accuracy":
                correct += count_correct(logits.float(), target)[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise UsageError(f"the {split} split of task {task.name!r} is empty (use more data)")
    loss = total / count
    value = correct / count if task.metric == "accuracy" else task.metric_from_loss(loss)
    return {"loss": loss, task.metric: value, "targets": count}


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Train the model a :class:`TrainConfig` describes, in the run folder ``run_dir``.

    Args:
        config: the resolved config (``config.out`` is ignored; ``run_dir`` is used).
        run_dir: run folder; must not exist (or be empty) unless ``resume``.
        resume: continue from the newest checkpoint in ``run_dir`` (from scratch if it has none).
        stream: where progress goes (default ``sys.stderr``); results are printed to ``sys.stdout``.

    Files written (rank 0 only): ``config.toml`` (resolved config), ``task.json`` (the task's
    :meth:`~aftlab.data.Task.info`, also a checkpoint's ``task``),
    ``metrics.jsonl`` (one JSON object per step and per evaluation), ``checkpoints/``,
    ``summary.json`` (at the end); all JSON is strict (a non-finite number is ``null``).

    Safety: :meth:`fit` holds the run folder's :class:`~aftlab.train.checkpoint.RunLock` from
    start to end (a second process training into it gets a :class:`UsageError` and changes
    nothing); a resume must keep every setting of the checkpoint's config except
    :data:`~aftlab.train.config.RESUMABLE_CHANGES`, and ``steps`` may not be below the
    checkpoint's step; a non-finite loss stops the run before anything non-finite is saved.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        run_dir: str | Path,
        resume: bool = False,
        stream: TextIO | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self._stop_signal: int | None = None

    # ----------------------------------------------------------------- setup
    def _lock(self) -> None:
        """Rank 0 locks the run folder (every rank stops when it cannot); checks what it holds."""
        error = None
        if self.dist.is_main:
            try:
                self._check_new_run()
                self._run_lock = RunLock(self.run_dir)
                self._check_new_run()  # again: another process may have started in between
                self._run_lock.remove_stale_temporaries()
            except UsageError as e:
                error = e
        failed = torch.tensor(float(error is not None), device=self.device)
        if float(self._all_reduce(failed, dist.ReduceOp.MAX if self.dist.active else None)) > 0:
            raise error or UsageError(f"rank 0 could not lock the run folder {str(self.run_dir)!r}")

    def _check_new_run(self) -> None:
        """Without ``resume``, the run folder must not hold a run (:func:`run_started`)."""
        d = self.run_dir
        if not self.resume and run_started(d):
            raise UsageError(
                f"run folder {str(d)!r} already exists; continue it with --resume, or choose "
                "another --out"
            )

    def _check_resume(self, ckpt: Path) -> None:
        """Refuse to resume from ``ckpt`` with settings that change what is learned."""
        saved = read_run_config(ckpt)[0]  # the checks of aftlab eval
        step = int(ckpt.name.removeprefix("step_"))
        conflicts = resume_conflicts(saved.to_dict(), self.config)
        if conflicts:
            raise UsageError(
                f"cannot resume {str(self.run_dir)!r} with a different config: "
                f"{'; '.join(conflicts)} (compared with {ckpt.name}/config.json; drop those "
                "changes, or train into a new --out; docs/training.md lists what may change)"
            )
        if self.config.steps < step:
            raise UsageError(
                f"cannot resume {str(self.run_dir)!r} with steps={self.config.steps}: its "
                f"checkpoint is at step {step} (give --steps {step} or more)"
            )

    def _setup(self) -> None:
        cfg = self.config
        if cfg.log == "tensorboard":
            check_tensorboard()  # before anything is written
        self.dist, self.device = init_distributed(cfg.device)
        self._lock()
        ckpt = latest_checkpoint(self.run_dir) if self.resume else None
        if ckpt is not None:
            self._check_resume(ckpt)
        world = self.dist.world_size
        if world > 1 and cfg.batch_size % (world * cfg.grad_accum):  # 1: TrainConfig's check
            raise UsageError(
                f"batch_size={cfg.batch_size} must be a multiple of processes "
                f"({world}) x grad_accum ({cfg.grad_accum}); "
                "change --set batch_size=... or grad_accum"
            )
        self.per_rank = cfg.batch_size // world
        self.micro = self.per_rank // cfg.grad_accum
        self.task = build_task(cfg)
        self.task_info = _jsonable(self.task.info())
        self.model_config = model_config_for(cfg, self.task)
        micro = None if self.dist.active and cfg.parallel == "fsdp" else self.micro  # sharded
        if micro is not None and cfg.carry_state:
            micro *= cfg.carry_grad_windows  # the k windows of a step backpropagate together
        check_training_memory(cfg, self.model_config, self.task_info, micro, device=self.device)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = build_model(self.model_config, self.task_info).to(self.device)
        if self.device.type == "cpu" and cfg.mixer.startswith(("aft", "rwkv")):
            kernels.status()  # compile the CPU kernels (first use) now, not in a timed step
        state = load_checkpoint(ckpt, self.model, map_location=self.device) if ckpt else None
        # FSDP shards self.model in place (full weights first, so a resume may change N)
        self._sharded = self.dist.active and cfg.parallel == "fsdp"
        self._check_stream_options()
        if self._sharded:
            wrap_model(self.model, parallel="fsdp", device=self.device)
        self.optimizer = build_optimizer(
            self.model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas
        )
        self.step = 0
        self.tokens_seen = 0
        if state is not None:
            try:
                if self._sharded:
                    load_optimizer_state(self.model, self.optimizer, state["optimizer"])
                else:
                    self.optimizer.load_state_dict(state["optimizer"])
                set_rng_state(state["rng"])
                self.step = int(state["step"])
                self.tokens_seen = int(state["tokens_seen"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise UsageError(
                    f"checkpoint {str(ckpt)!r} has an unreadable training state "
                    f"({type(e).__name__}: {e}); delete it to fall back to the previous one"
                ) from None
        self._caches = self._initial_caches(ckpt) if cfg.carry_state else None
        self._reset: tuple[bool, ...] = ()
        train_model: nn.Module = CarriedWindows(self.model) if cfg.carry_state else self.model
        if cfg.compile:
            train_model = torch.compile(train_model)
        if self.dist.active and not self._sharded:
            train_model = wrap_model(train_model, parallel="ddp", device=self.device)
        self.train_model = train_model
        if self.dist.is_main:
            self._check_run_dir()
            atomic_write_text(self.run_dir / "config.toml", to_toml(cfg))
            atomic_write_text(self.run_dir / "task.json", dumps(self.task_info, indent=2))
            self._trim_metrics()

    def _check_stream_options(self) -> None:
        """Refuse ``carry_state`` and ``pack_documents`` where the task or model cannot do them."""
        cfg, d = self.config, self.dist
        where = {"batch_size": self.per_rank, "rank": d.rank, "world_size": d.world_size}
        try:  # the task's own refusal: not a stream, no documents, streams too short
            if cfg.carry_state:
                self.task.consecutive_windows(0, windows=cfg.carry_grad_windows, **where)
            if cfg.pack_documents:
                self.task.document_batch(0, **where)
        except DataError as e:
            raise UsageError(str(e)) from None
        if not cfg.carry_state:
            return
        why = stream_refusal(self.model)
        if why is not None:
            raise UsageError(
                f"carry_state: this {cfg.mixer} model cannot carry its state along a stream: "
                f"{why}; carry_state needs a causal model whose state has a fixed size "
                "(aft-simple, aft-decay, aft-conv, aft-local with relative_bias, with "
                "model.positional = 'none' or 'sinusoidal')"
            )
        if self._sharded:
            raise UsageError(
                "carry_state: parallel = 'fsdp' is not supported (model.prefill is not an FSDP "
                "forward); use parallel = 'ddp'"
            )

    def _initial_caches(self, ckpt: Path | None) -> list[Any]:
        """``carry_state``: one cache per micro-batch, this rank's rows of the checkpoint's carried
        state (empty caches for a new run)."""
        cfg, micro = self.config, self.micro
        if ckpt is None:
            return [self.model.init_cache(micro) for _ in range(cfg.grad_accum)]
        carried = load_carried_state(ckpt)
        if carried is None:
            raise UsageError(
                f"checkpoint {str(ckpt)!r} of a carry_state run has no {CARRIED_FILE}; delete "
                "it to fall back to the previous one"
            )
        try:
            whole = restore_state(
                self.model.init_cache(cfg.batch_size),
                *carried,
                where=f"checkpoint {str(ckpt)!r}: {CARRIED_FILE}",
            )
        except ValueError as e:
            raise UsageError(f"{e} (use the config the run was trained with)") from None
        first = self.dist.rank * self.per_rank
        return [
            cache_rows(whole, first + i * micro, first + (i + 1) * micro)
            for i in range(cfg.grad_accum)
        ]

    def _carried(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The carried state of every rank as one cache of ``batch_size`` rows, flattened
        (:func:`~aftlab.train.streams.flatten_state`); collective."""
        mine = self._caches[0] if len(self._caches) == 1 else cat_caches(self._caches)
        tensors, values = flatten_state(mine)
        if self.dist.active:
            for name, t in tensors.items():
                local = t.contiguous().to(torch.uint8 if t.dtype == torch.bool else t.dtype)
                parts = [torch.empty_like(local) for _ in range(self.dist.world_size)]
                dist.all_gather(parts, local)
                tensors[name] = torch.cat(parts).to(t.dtype)
            values["batch_size"] = self.config.batch_size
        return tensors, values

    def _trim_metrics(self) -> None:
        """On resume, drop metric lines written after the checkpoint (they will be recomputed)."""
        path = self.run_dir / "metrics.jsonl"
        if not os.path.lexists(path):
            return
        with open(open_run_file(path, os.O_RDONLY), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= self.step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError, RecursionError):
                continue  # a line cut short by a kill, or damaged
        atomic_write_text(path, "".join(x + "\n" for x in keep))

    # ----------------------------------------------------------------- helpers
    def _log(self, record: dict[str, Any]) -> None:
        if self.dist.is_main:
            self._check_run_dir()
            try:
                self._metrics.write(dumps(record) + "\n")
                self._metrics.flush()
                if self._tb is not None:
                    self._tb.write(record)
            except OSError as e:
                raise _write_error(repr(str(self.run_dir / "metrics.jsonl")), e) from None

    def _check_run_dir(self) -> None:
        """Rank 0 stops when its run folder or lock file was deleted or moved (``rm -rf RUN``)."""
        if self._run_lock is not None and not self._run_lock.intact():
            raise UsageError(
                f"run folder {str(self.run_dir)!r} or its {LOCK_FILE} was deleted or moved "
                f"during training: stopped at step {self.step}, writing nothing more (a moved "
                "folder continues with aftlab train --resume --out NEW_PLACE)"
            )

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.dist.active:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _barrier(self) -> None:
        if self.dist.active:
            dist.barrier()

    def _save(self) -> Path | None:
        path = None
        if not weights_finite(self.model, device=self.device):
            raise _Diverged(self.step, "the weights are not finite")  # never saved
        if self._last_saved == self.step:
            self._barrier()
            return path
        carried = self._carried() if self._caches is not None else None  # collective
        if self._sharded:  # every rank gathers; rank 0 receives the full state
            weights = full_model_state(self.model)
            optim = full_optimizer_state(self.model, self.optimizer)
        else:
            weights, optim = self.model, self.optimizer.state_dict()
        if self.dist.is_main:
            self._check_run_dir()
            path = save_checkpoint(
                self.run_dir,
                step=self.step,
                model=weights,
                config={
                    "train": self.config.to_dict(),
                    "model": self.model_config.to_dict(),
                    "task": self.task_info,
                },
                train_state={
                    "step": self.step,
                    "tokens_seen": self.tokens_seen,
                    "optimizer": optim,
                    "rng": rng_state(),
                    "world_size": self.dist.world_size,
                },
                keep_last=self.config.keep_last,
                carried=carried,
            )
        self._last_saved = self.step
        self._barrier()
        return path

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # second Ctrl-C: stop now
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self._stop_signal = signum
        if self.dist.is_main:
            print(
                f"\naftlab: {signal.Signals(signum).name} received: saving a checkpoint after "
                "this step "
                "(press Ctrl-C again to abort without saving)",
                file=self.stream,
                flush=True,
            )

    def evaluate(self, split: str, max_batches: int | None) -> dict[str, float]:
        """Evaluate the current weights on ``split`` (see :func:`evaluate`)."""
        return evaluate(
            self.model,
            self.task,
            split,
            batch_size=self.config.eval_batch_size or self.config.batch_size,
            max_batches=max_batches,
            device=self.device,
            precision=self.config.precision,
        )

    # ----------------------------------------------------------------- one step
    def _train_step(self) -> float:
        cfg, d = self.config, self.dist
        lr = lr_at(self.step, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, steps=cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self._step_batch()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        n_global = self._all_reduce(
            (batch["target"] != IGNORE_INDEX).sum().to(torch.float64)
        ).clamp_min(1)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(cfg.grad_accum):
            sync = d.active and i < cfg.grad_accum - 1
            with no_grad_sync(self.train_model) if sync else nullcontext():
                with _autocast(self.device, cfg.precision):
                    logits, target = self._micro_forward(batch, i)
                s, _ = nll_sum(logits, target)
                (s * (d.world_size / n_global.float())).backward()
            total += s.detach().double()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(batch["input"].numel()) * d.world_size
        self._lr = lr
        return float(self._all_reduce(total) / n_global)

    def _step_batch(self) -> dict[str, torch.Tensor]:
        """This rank's batch of the step: ``(B, T)`` rows (with ``doc_start`` when packing
        documents), or ``carry_state``'s ``(k, B, T)`` windows (their ``reset`` flags kept)."""
        cfg, d = self.config, self.dist
        where = {"batch_size": self.per_rank, "rank": d.rank, "world_size": d.world_size}
        if cfg.carry_state:
            batch = self.task.consecutive_windows(
                self.step, windows=cfg.carry_grad_windows, **where
            )
            self._reset = tuple(bool(r) for r in batch.pop("reset"))
            return batch
        if cfg.pack_documents:
            return self.task.document_batch(self.step, **where)
        return self.task.train_batch(self.step, **where)

    def _micro_forward(
        self, batch: dict[str, torch.Tensor], i: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and targets of micro-batch ``i`` (rows ``[i micro, (i + 1) micro)``).

        ``carry_state``: its windows from its carried cache, which then holds the state after
        them, detached (the gradient stops at the step's first window). ``pack_documents``: its
        rows packed into one (:func:`~aftlab.data.base.pack_rows`).
        """
        rows = slice(i * self.micro, (i + 1) * self.micro)
        if self._caches is not None:
            logits, cache = self.train_model(batch["input"][:, rows], self._caches[i], self._reset)
            self._caches[i] = cache.detach()
            return logits, batch["target"][:, rows]
        mb = {k: v[rows] for k, v in batch.items()}
        if self.config.pack_documents:
            mb = pack_rows(mb)
        return scored_forward(
            self.model, mb, wrapper=self.train_model, select=not self.config.compile
        )

    # ----------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to ``config.steps`` (or until Ctrl-C), then evaluate on the test split and sample.

        Returns:
            The summary (also written to ``summary.json``): parameters, steps, final train loss,
            final validation and test loss and metric, training tokens/s, peak memory;
            ``"interrupted": True`` when a signal stopped the run (after saving a checkpoint);
            ``"diverged": True`` when the loss became non-finite (nothing saved after the last
            good checkpoint, no summary).

        Raises:
            UsageError: another process holds the run folder, a resume that changes the config,
                a failed write (disk full), bad data.
        """
        self._run_lock: RunLock | None = None
        try:
            self._setup()
            stopped = self._loop()
            return stopped if stopped is not None else self._finish()
        finally:
            if self._run_lock is not None:
                self._run_lock.release()

    def _loop(self) -> dict[str, Any] | None:
        """Train to ``config.steps``, saving checkpoints; the stop record if it stopped early.

        Returns:
            None after the last step (its checkpoint saved), ``{"interrupted": True, "step"}``
            after a signal (checkpoint saved), ``{"diverged": True, "step"}`` on a non-finite
            loss or weights (nothing saved).
        """
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._memory_baseline = memory_baseline(self.device)
        self._last_saved = self.step if self.resume and self.step > 0 else -1
        self._start_step, self._session_tokens0 = self.step, self.tokens_seen
        self._train_time, self._loss = 0.0, float("nan")
        self._open_logs()
        progress = self._start_progress()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            while self.step < cfg.steps:
                self._logged_step(progress)
                if self._stop_requested():
                    return self._interrupted(progress)
                if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                    self._save()
            self._save()
        except _Diverged as e:
            return self._diverged(e, progress)
        finally:
            progress.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
            self._close_logs(quiet=sys.exc_info()[1] is not None)
        return None

    def _open_logs(self) -> None:
        """Rank 0 appends to ``metrics.jsonl`` (and TensorBoard's); the other ranks log nothing."""
        self._metrics = self._tb = None
        if not self.dist.is_main:
            return
        where = self.run_dir / "metrics.jsonl"
        try:
            fd = open_run_file(where, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self._metrics = open(fd, "a", encoding="utf-8")
            if self.config.log == "tensorboard":
                where = self.run_dir / TB_DIR
                self._tb = TensorBoardLog(self.run_dir, resumed_at=self.step)
        except OSError as e:
            self._close_logs(quiet=True)
            raise _write_error(repr(str(where)), e) from None
        except UsageError:
            self._close_logs(quiet=True)
            raise

    def _close_logs(self, *, quiet: bool) -> None:
        """Close ``metrics.jsonl`` (and TensorBoard's); a failed flush (full disk) is one line,
        unless ``quiet`` (another error is on its way)."""
        error = None
        for log, name in ((self._metrics, "metrics.jsonl"), (self._tb, TB_DIR)):
            try:
                if log is not None:
                    log.close()
            except OSError as e:
                error = error or _write_error(repr(str(self.run_dir / name)), e)
        self._metrics = self._tb = None
        if error is not None and not quiet:
            raise error

    def _start_progress(self) -> Progress:
        """The progress display, after a first line saying what is trained (or resumed)."""
        cfg = self.config
        progress = Progress(
            total=cfg.steps,
            initial=self.step,
            log_interval=cfg.log_interval,
            stream=self.stream,
            enabled=self.dist.is_main,
        )
        if self.step == 0 or not self.resume:
            n_params = sum(p.numel() for p in self.model.parameters())
            progress.write(
                f"aftlab: training {cfg.model_label} on {cfg.task} ({n_params:,} parameters, "
                f"{self.dist.world_size} process(es)"
                f"{' ' + cfg.parallel if self.dist.active else ''}, device {self.device}) -> "
                f"{self.run_dir}"
            )
        else:
            progress.write(f"aftlab: resuming {self.run_dir} at step {self.step}/{cfg.steps}")
        return progress

    def _logged_step(self, progress: Progress) -> None:
        """One optimizer step, its metrics line and progress, and the periodic evaluation."""
        cfg = self.config
        t0 = time.perf_counter()
        loss = self._train_step()
        if not math.isfinite(loss):
            raise _Diverged(self.step, f"the loss is {loss}")
        self._train_time += time.perf_counter() - t0
        self._loss = loss
        tok_s = (self.tokens_seen - self._session_tokens0) / max(self._train_time, 1e-9)
        self._log(
            {
                "step": self.step,
                "split": "train",
                "loss": loss,
                "lr": self._lr,
                "tokens": self.tokens_seen,
                "tokens_per_s": tok_s,
                "peak_memory_bytes": peak_memory_since(self.device, self._memory_baseline),
                "time": time.time(),
            }
        )
        progress.update(self.step, loss=loss, lr=self._lr, tokens_per_s=tok_s)
        if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
            self._periodic_eval(progress)

    def _stop_requested(self) -> bool:
        """Whether any rank received SIGINT/SIGTERM (every rank gets the same answer)."""
        stop = torch.tensor(float(self._stop_signal is not None), device=self.device)
        return float(self._all_reduce(stop, dist.ReduceOp.MAX if self.dist.active else None)) > 0

    def _interrupted(self, progress: Progress) -> dict[str, Any]:
        """Save a checkpoint after a signal and say how to continue."""
        path = self._save()
        progress.close()
        if self.dist.is_main:
            print(
                f"aftlab: interrupted at step {self.step}/{self.config.steps}; checkpoint "
                f"{path or latest_checkpoint(self.run_dir)}; "
                f"continue with: aftlab train --resume --out {self.run_dir}",
                file=self.stream,
                flush=True,
            )
        return {"interrupted": True, "step": self.step}

    def _diverged(self, e: _Diverged, progress: Progress) -> dict[str, Any]:
        """Say where a non-finite loss or weights stopped the run (nothing is saved)."""
        progress.close()
        if self.dist.is_main:
            last = latest_checkpoint(self.run_dir)
            print(
                f"aftlab: error: training diverged at step {e.step}/{self.config.steps}: "
                f"{e.reason}; stopped without saving (last good checkpoint: "
                f"{last.name if last else 'none'}); lower lr (or raise warmup) and train "
                "into a new --out",
                file=self.stream,
                flush=True,
            )
        return {"diverged": True, "step": e.step}

    # ----------------------------------------------------------------- the finish
    def _finish(self) -> dict[str, Any]:
        """After the last step: validation and test evaluation, ``summary.json``, the result
        line, a sample. The validation is the periodic one's (``eval_batches``), which
        ``aftlab compare`` chooses its rate on."""
        cfg = self.config
        summary = self._summary()
        if self.dist.is_main or self._sharded:  # a sharded forward needs every rank
            val = self.evaluate("val", cfg.eval_batches)
            test = self.evaluate("test", cfg.test_batches or None)
        if self.dist.is_main:
            metric = self.task.metric
            summary.update({"val_loss": val["loss"], "val_" + metric: val[metric]})
            summary.update({"test_loss": test["loss"], "test_" + metric: test[metric]})
            self._check_run_dir()
            atomic_write_text(self.run_dir / "summary.json", dumps(summary, indent=2))
            print(
                f"test {metric}: {test[metric]:.4f}  (loss {test['loss']:.4f} nats, "
                f"{test['targets']:,} targets; {format_duration(self._train_time)} of training, "
                f"{summary['train_tokens_per_s'] or 0:,.0f} tok/s)",
                file=self.out,
                flush=True,
            )
            self._sample()
        self._barrier()
        return summary

    def _summary(self) -> dict[str, Any]:
        """What the run did (``summary.json`` before the test figures are added)."""
        cfg, train_time = self.config, self._train_time
        tokens = self.tokens_seen - self._session_tokens0
        return {
            "task": cfg.task,
            "mixer": cfg.mixer,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "steps": self.step,
            "train_loss": self._loss,
            "tokens_seen": self.tokens_seen,
            "train_tokens_per_s": tokens / train_time if train_time else None,
            "train_time_s": train_time,
            "peak_memory_bytes": peak_memory_since(self.device, self._memory_baseline),
            "device": str(self.device),
            "world_size": self.dist.world_size,
            "metric": self.task.metric,
            "resumed_from": self._start_step if self.resume else None,
        }

    def _sample(self) -> None:
        """Rank 0 prints ``sample_tokens`` of text from a language model of a text task."""
        cfg = self.config
        if not (
            cfg.sample_tokens
            and hasattr(self.task, "decode")
            and self.task_info["image_shape"] is None
            and self.task.kind == "lm"
        ):
            return
        from .sampling import sample_text

        print("--- sample ---", file=self.out, flush=True)
        sample_text(
            self._unsharded_model(),
            self.task,
            prompt=None,
            tokens=cfg.sample_tokens,
            temperature=0.8,
            top_k=None,
            seed=cfg.seed,
            out=self.out,
        )

    def _periodic_eval(self, progress: Progress) -> None:
        if self.dist.is_main or self._sharded:  # a sharded forward needs every rank
            res = self.evaluate("val", self.config.eval_batches)
        if self.dist.is_main:
            metric = self.task.metric
            self._log(
                {
                    "step": self.step,
                    "split": "val",
                    "loss": res["loss"],
                    metric: res[metric],
                    "time": time.time(),
                }
            )
            progress.write(
                f"step {self.step}: val loss {res['loss']:.4f}, val {metric} {res[metric]:.4f}"
            )
        self._barrier()

    def _unsharded_model(self) -> nn.Module:
        """The model for rank 0 alone (sampling): itself, or under FSDP the final checkpoint's.

        A sharded model's forward is collective, and decoding calls the blocks one by one, so
        rank 0 reads the checkpoint just saved into a plain model, as ``aftlab sample`` does.
        """
        if not self._sharded:
            return self.model
        with torch.random.fork_rng(devices=[]):  # building initialises: leave the RNGs alone
            model = build_model(self.model_config, self.task_info).to(self.device)
        ckpt = latest_checkpoint(self.run_dir)
        load_checkpoint(ckpt, model, map_location=self.device, with_state=False)
        return model


def _jsonable(obj: Any) -> Any:
    return json.loads(dumps(obj, default=str))


class _Diverged(Exception):
    """A non-finite loss or weights at ``step``: :meth:`Trainer.fit` stops without saving."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason
