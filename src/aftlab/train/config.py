"""The training config: a typed, validated dataclass, loaded from TOML and ``--set`` overrides.

A config file is TOML (``tomllib``; ``tomli`` on Python 3.10) with the fields of
:class:`TrainConfig` at the top level and three tables::

    task = "text"
    seq_len = 128
    mixer = "aft-local"
    steps = 500

    [mixer_options]          # keyword options of the mixer
    window = 32

    [model]                  # TransformerConfig fields (sizes, norm, positions, ...)
    d_model = 128
    n_layers = 4

    [task_options]           # keyword options of the task (see ``aftlab.data``)

``--set key=value`` overrides any field after the file is read; ``key`` may be dotted
(``model.d_model=256``) and ``value`` is a TOML literal (``3e-4``, ``true``, ``[0.9, 0.95]``,
``{window = 32}``); a value that is not a TOML literal is taken as a string
(``--set mixer=aft-full``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.config import TransformerConfig
from .errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "TrainConfig",
    "MODEL_KEYS",
    "DEFAULT_MODEL",
    "load_config",
    "apply_overrides",
    "parse_override",
    "to_toml",
    "RESUMABLE_CHANGES",
    "resume_conflicts",
]

#: TransformerConfig fields that the ``[model]`` table may set; the others are derived from the
#: task (``vocab_size``, ``causal``), the context (``max_seq_len``) and ``mixer``/``mixer_options``.
_DERIVED = ("vocab_size", "max_seq_len", "mixer", "mixer_options", "causal")
MODEL_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(TransformerConfig) if f.name not in _DERIVED
)
#: The default model: small enough that ``aftlab train`` finishes in minutes on 2 CPU cores.
DEFAULT_MODEL: dict[str, Any] = {"d_model": 128, "n_layers": 3, "n_heads": 4}

_PRECISIONS = ("fp32", "bf16")
_PARALLEL = ("ddp", "fsdp")  # aftlab.train.distributed.PARALLEL
_LOGS = ("jsonl", "tensorboard")
_FREE_TABLES = ("mixer_options", "task_options")  # tables whose keys are not checked here


def _close(name: str, candidates: list[str] | tuple[str, ...]) -> str:
    near = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    if near:
        return f"; did you mean {' or '.join(repr(n) for n in near)}?"
    return f"; known keys: {', '.join(sorted(candidates))}"


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    Attributes:
        task: task name (``aftlab.data.available_tasks()``), e.g. ``"text"``.
        data: path of the task's data (file or folder); ``None`` for the task's built-in data.
        task_options: extra keyword options of the task.
        seq_len: context length ``T`` (the task may fix it, e.g. the 64 pixels of ``digits``).
        mixer: registered token mixer (``"attention"``, ``"aft-full"``, ``"aft-local"``, ...).
        mixer_options: keyword options of the mixer (e.g. ``{"window": 32}``).
        model: :class:`~aftlab.models.TransformerConfig` fields other than the derived
            ``vocab_size``, ``max_seq_len``, ``mixer``, ``mixer_options`` and ``causal``; keys not
            given take :data:`DEFAULT_MODEL`, then TransformerConfig's defaults.
        batch_size: sequences per optimizer step, over all processes and accumulation steps.
        grad_accum: micro-batches per optimizer step on each process.
        lr: peak learning rate (after warm-up).
        min_lr: learning rate at the end of the cosine decay.
        warmup: linear warm-up steps.
        steps: optimizer steps in total.
        weight_decay: AdamW decoupled weight decay, applied to matrices only.
        betas: AdamW ``(beta1, beta2)``.
        grad_clip: clip the global gradient norm to this value; ``0`` disables.
        eval_interval: evaluate on the validation split every this many steps; ``0``: never.
        eval_batches: validation batches per periodic evaluation.
        eval_batch_size: sequences per evaluation batch; ``None``: ``batch_size``.
        test_batches: test batches evaluated at the end of training; ``0``: the whole split
            (``aftlab eval`` reads the whole split unless told otherwise).
        checkpoint_interval: save a checkpoint every this many steps (also at the end and on
            Ctrl-C).
        keep_last: checkpoints kept (older ones are deleted).
        log_interval: steps between plain log lines (when stderr is not a terminal).
        sample_tokens: tokens of text sampled at the end of training (text tasks); ``0``: none.
        seed: seed of the model initialisation, the data order and every random generator.
        precision: ``"fp32"``, or ``"bf16"`` autocast for the forward pass.
        compile: wrap the model in ``torch.compile``.
        parallel: under torchrun, ``"ddp"`` (a full replica per process) or ``"fsdp"``
            (FSDP2: parameters, gradients and optimizer moments sharded over the processes;
            :mod:`aftlab.train.distributed`); ignored by a single process.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        log: ``"jsonl"`` (``metrics.jsonl`` only), or ``"tensorboard"``: the same scalars also
            as TensorBoard event files in ``RUN_DIR/tb`` (the ``tensorboard`` extra).
        out: run folder; ``None``: ``runs/<task>-<mixer>-<date>-<time>``.
    """

    task: str = "text"
    data: str | None = None
    task_options: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 128
    mixer: str = "attention"
    mixer_options: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    steps: int = 500
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 10
    eval_batch_size: int | None = 32
    test_batches: int = 20
    checkpoint_interval: int = 100
    keep_last: int = 2
    log_interval: int = 20
    sample_tokens: int = 200
    seed: int = 0
    precision: str = "fp32"
    compile: bool = False
    parallel: str = "ddp"
    device: str = "auto"
    log: str = "jsonl"
    out: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self.model = {**DEFAULT_MODEL, **self.model}  # the [model] table refines the defaults
        for name in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "steps",
            "eval_batches",
            "keep_last",
            "log_interval",
        ):
            if getattr(self, name) <= 0:
                self._fail(name, "> 0")
        for name in (
            "warmup",
            "eval_interval",
            "test_batches",
            "checkpoint_interval",
            "sample_tokens",
        ):
            if getattr(self, name) < 0:
                self._fail(name, ">= 0")
        if not 0 <= self.seed < 2**32:  # NumPy's legacy generator takes 32-bit seeds
            self._fail("seed", "in [0, 2**32)")
        if self.eval_batch_size is not None and self.eval_batch_size <= 0:
            self._fail("eval_batch_size", "> 0 or absent")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            self._fail("lr", "a positive finite number")
        if not (0 <= self.min_lr <= self.lr):
            self._fail("min_lr", f"in [0, lr={self.lr}]")
        if not self.weight_decay >= 0:
            self._fail("weight_decay", ">= 0")
        if not self.grad_clip >= 0:
            self._fail("grad_clip", ">= 0 (0 disables clipping)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            self._fail("betas", "two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.precision not in _PRECISIONS:
            self._fail("precision", f"one of {list(_PRECISIONS)}")
        if self.parallel not in _PARALLEL:
            self._fail("parallel", f"one of {list(_PARALLEL)}")
        if self.log not in _LOGS:
            self._fail("log", f"one of {list(_LOGS)}")
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            self._fail("device", "'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.batch_size % self.grad_accum:
            self._fail("batch_size", f"a multiple of grad_accum={self.grad_accum}")
        for key in self.model:
            if key not in MODEL_KEYS:
                hint = " (it is set by the trainer)" if key in _DERIVED else _close(key, MODEL_KEYS)
                raise UsageError(f"config: unknown key 'model.{key}'{hint}")
        try:  # the model table must make a valid TransformerConfig
            self.transformer_config(vocab_size=256, causal=True)
        except (TypeError, ValueError) as e:
            raise UsageError(f"config: [model]: {e}") from None

    # ----------------------------------------------------------------- validation
    def _fail(self, name: str, expected: str) -> None:
        raise UsageError(
            f"config: '{name}' must be {expected}, got {getattr(self, name)!r} "
            f"(fix it in the config file or with --set {name}=...)"
        )

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _FIELD_TYPES[f.name]
            optional = f.name in ("data", "out", "eval_batch_size")
            if value is None and optional:
                continue
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f.name, float(value))
                continue
            if kind is int and isinstance(value, bool):
                ok = False
            elif kind == "betas":
                ok = isinstance(value, (list, tuple)) and all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) for b in value
                )
                if ok:
                    setattr(self, f.name, [float(b) for b in value])
            else:
                ok = isinstance(value, kind)
            if not ok:
                want = "list of 2 numbers" if kind == "betas" else kind.__name__
                raise UsageError(
                    f"config: '{f.name}' must be of type {want}{' or absent' if optional else ''}, "
                    f"got {type(value).__name__} {value!r}"
                )

    # ----------------------------------------------------------------- derived
    def transformer_config(
        self, *, vocab_size: int, causal: bool, **extra: Any
    ) -> TransformerConfig:
        """The model's :class:`TransformerConfig` for a task with ``vocab_size`` tokens.

        ``extra`` entries go into ``mixer_options`` when not already there (e.g. a task's ``grid``).
        """
        options = {**extra, **self.mixer_options}
        return TransformerConfig(
            vocab_size=vocab_size,
            max_seq_len=self.seq_len,
            mixer=self.mixer,
            mixer_options=options,
            causal=causal,
            **self.model,
        )

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML-serialisable dict of every field."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from :meth:`to_dict` output; an unknown key raises :class:`UsageError`."""
        if not isinstance(data, dict):
            raise UsageError(f"config: expected a table of settings, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise UsageError(f"config: unknown key '{key}'{_close(key, known)}")
        data = dict(data)
        for table in ("model", *_FREE_TABLES):
            if table in data and not isinstance(data[table], dict):
                raise UsageError(f"config: '{table}' must be a table, got {data[table]!r}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes`` applied."""
        return TrainConfig.from_dict({**self.to_dict(), **changes})


_FIELD_TYPES: dict[str, Any] = {
    "task": str,
    "data": str,
    "task_options": dict,
    "seq_len": int,
    "mixer": str,
    "mixer_options": dict,
    "model": dict,
    "batch_size": int,
    "grad_accum": int,
    "lr": float,
    "min_lr": float,
    "warmup": int,
    "steps": int,
    "weight_decay": float,
    "betas": "betas",
    "grad_clip": float,
    "eval_interval": int,
    "eval_batches": int,
    "eval_batch_size": int,
    "test_batches": int,
    "checkpoint_interval": int,
    "keep_last": int,
    "log_interval": int,
    "sample_tokens": int,
    "seed": int,
    "precision": str,
    "compile": bool,
    "parallel": str,
    "device": str,
    "log": str,
    "out": str,
}


#: Fields that may differ from the checkpoint's config on ``--resume``: they do not change
#: what one step computes (``steps`` moves the end of the cosine; ``data`` may move, same bytes).
RESUMABLE_CHANGES = (
    "steps",
    "eval_interval",
    "eval_batches",
    "eval_batch_size",
    "test_batches",
    "checkpoint_interval",
    "keep_last",
    "log_interval",
    "sample_tokens",
    "device",
    "compile",
    "parallel",
    "out",
    "data",
    "log",
)


def resume_conflicts(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """The settings of ``config`` that differ from a checkpoint's ``saved`` train config.

    Fields of :data:`RESUMABLE_CHANGES` may differ; tables are compared key by key.

    Returns:
        One ``"lr is 0.002 there but 0.01 here"`` per differing (dotted) key; empty when the
        run may be resumed with ``config``.
    """
    new = config.to_dict()
    out = []
    for key in sorted(set(saved) | set(new)):
        if key in RESUMABLE_CHANGES or saved.get(key) == new.get(key):
            continue
        old_v, new_v = saved.get(key), new.get(key)
        if isinstance(old_v, dict) and isinstance(new_v, dict):
            for sub in sorted(set(old_v) | set(new_v)):
                if old_v.get(sub) != new_v.get(sub):
                    out.append(
                        f"{key}.{sub} is {old_v.get(sub)!r} there but {new_v.get(sub)!r} here"
                    )
        else:
            out.append(f"{key} is {old_v!r} there but {new_v!r} here")
    return out


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into ``(["a", "b"], value)``; value: a TOML literal or a string."""
    if "=" not in text:
        raise UsageError(f"--set {text!r}: expected key=value, e.g. --set model.d_model=256")
    key, _, raw = text.partition("=")
    path = [k.strip() for k in key.strip().split(".")]
    if not all(path):
        raise UsageError(f"--set {text!r}: empty key; expected key=value, e.g. --set lr=3e-4")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: a string such as aft-local or runs/x
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to a config dict; unknown keys raise :class:`UsageError`."""
    out = json.loads(json.dumps(data))
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    for text in overrides:
        path, value = parse_override(text)
        head = path[0]
        if head not in known:
            raise UsageError(f"--set {text!r}: unknown key '{head}'{_close(head, known)}")
        if len(path) == 1:
            out[head] = value
            continue
        if head == "model":
            if len(path) != 2 or path[1] not in MODEL_KEYS:
                sub = ".".join(path[1:])
                raise UsageError(
                    f"--set {text!r}: unknown key 'model.{sub}'{_close(sub, MODEL_KEYS)}"
                )
        elif head not in _FREE_TABLES:
            raise UsageError(f"--set {text!r}: '{head}' is not a table; use --set {head}=VALUE")
        node = (
            out.setdefault(head, {})
            if head != "model"
            else out.setdefault("model", dict(DEFAULT_MODEL))
        )
        for k in path[1:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UsageError(f"--set {text!r}: '{k}' is not a table")
        node[path[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML (or JSON) config file, apply ``--set`` overrides and validate.

    Args:
        path: a ``.toml`` or ``.json`` file; ``None`` starts from the defaults.
        overrides: ``key=value`` strings (see :func:`parse_override`).

    Raises:
        UsageError: missing or malformed file, unknown key, invalid value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file {str(p)!r} does not exist (check the --config path)")
        text = p.read_text(encoding="utf-8")
        try:
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise UsageError(
                f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: "
                f"{e}"
            ) from None
    data = apply_overrides(data, overrides or [])
    if "model" in data and not isinstance(data["model"], dict):
        raise UsageError(f"config: 'model' must be a table, got {data['model']!r}")
    return TrainConfig.from_dict(data)


# --------------------------------------------------------------------------- writing TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"to_toml: cannot write {type(v).__name__} {v!r}")


def to_toml(config: TrainConfig) -> str:
    """The config as TOML that :func:`load_config` reads back to an equal config.

    ``None`` fields (``data``, ``out``, ``eval_batch_size`` when unset) are written as comments.
    """
    d = config.to_dict()
    lines = []
    tables = {}
    for k, v in d.items():
        if isinstance(v, dict):
            tables[k] = v
        elif v is None:
            lines.append(f"# {k} = (unset)")
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"
