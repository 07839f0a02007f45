"""The training config: a typed, validated dataclass, loaded from TOML and ``--set`` overrides.

:class:`TrainConfig` holds the run's settings as a config file writes them. A config file is
TOML (``tomllib``; ``tomli`` on Python 3.10) with the run's fields at the top level and three
tables::

    task = "text"
    seq_len = 128            # the context T asked of the task
    mixer = "aft-local"
    steps = 500

    [mixer_options]          # keyword options of the mixer
    window = 32

    [model]                  # the other TransformerConfig fields (sizes, norm, positions, ...)
    d_model = 128
    n_layers = 4

    [task_options]           # keyword options of the task (see ``aftlab.data``)

A ``[model]`` key not given takes :func:`default_model`'s value. The model's
:class:`~aftlab.models.TransformerConfig` is built once the task is known, by
``aftlab.train.build.model_config_for`` (the task gives ``vocab_size``, the context and
causality); loading a config checks that its model settings make a valid one.
:meth:`TrainConfig.to_dict`, :func:`to_toml` and the ``config.toml`` of a run folder (and the
``train`` section of a checkpoint's ``config.json``) use this same layout.

``--set key=value`` overrides any field after the file is read; ``key`` may be dotted
(``model.d_model=256``, ``mixer_options.window=32``) and ``value`` is a TOML literal
(``3e-4``, ``true``, ``[0.9, 0.95]``, ``{window = 32}``); a value that is not a TOML literal
is taken as a string (``--set mixer=aft-full``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._checks import did_you_mean
from ..errors import READ_ERRORS, UsageError, reason
from ..models.config import ARCHITECTURES, TransformerConfig, model_config_from_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "TrainConfig",
    "default_model",
    "load_config",
    "apply_overrides",
    "parse_override",
    "to_toml",
    "RESUMABLE_CHANGES",
    "resume_conflicts",
    "LATER_KEYS",
    "STORED_KEYS",
    "check_stored",
]

#: TransformerConfig fields a config file writes at the top level: field -> the file's key.
_ON_TOP = {"max_seq_len": "seq_len", "mixer": "mixer", "mixer_options": "mixer_options"}
#: TransformerConfig fields that only the task decides (``model_config_for``).
_FROM_TASK = ("vocab_size", "causal")
#: The keys of the ``[model]`` table by its ``architecture`` (the model config's other fields).
_ARCH_KEYS = {
    name: tuple(f.name for f in dataclasses.fields(cls) if f.name not in (*_ON_TOP, *_FROM_TASK))
    for name, cls in ARCHITECTURES.items()
}
#: The keys a ``[model]`` table may hold (those of its architecture are checked once it is known).
_MODEL_KEYS = ("architecture", *dict.fromkeys(k for keys in _ARCH_KEYS.values() for k in keys))
#: The mixer of an architecture that has one time mix (``mixer`` is set to it when not given).
_ARCH_MIXER = {"rwkv4": "rwkv4"}

_PRECISIONS = ("fp32", "bf16")
_PARALLEL = ("ddp", "fsdp")  # aftlab.train.distributed.PARALLEL
_LOGS = ("jsonl", "tensorboard")
_FREE_TABLES = ("mixer_options", "task_options")  # tables whose keys are not checked here


def default_model(architecture: str = "transformer") -> dict[str, Any]:
    """The default ``[model]`` table of ``architecture``: small enough that ``aftlab train``
    finishes in minutes on 2 CPU cores.

    ``d_model=128, n_layers=3`` (and ``n_heads=4`` for the Transformer); the other keys take
    the model config's defaults (:data:`~aftlab.models.config.ARCHITECTURES`), and an
    architecture other than ``"transformer"`` is named by the ``architecture`` key. A config's
    ``[model]`` table refines it.
    """
    fields = dataclasses.fields(ARCHITECTURES[architecture])
    defaults = {f.name: f.default for f in fields if f.name in _ARCH_KEYS[architecture]}
    if architecture == "transformer":  # written as it was before there were others
        return {**defaults, "d_model": 128, "n_layers": 3, "n_heads": 4}
    return {"architecture": architecture, **defaults, "d_model": 128, "n_layers": 3}


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    Attributes:
        task: task name (``aftlab.data.available_tasks()``), e.g. ``"text"``.
        data: path of the task's data (file or folder); ``None`` for the task's built-in data.
        task_options: extra keyword options of the task.
        seq_len: the context ``T`` asked of the task, the model's ``max_seq_len`` (the task may
            fix it, e.g. the 64 pixels of ``digits``).
        mixer: registered token mixer (``"attention"``, ``"aft-full"``, ``"aft-local"``, ...).
        mixer_options: keyword options of the mixer (e.g. ``{"window": 32}``).
        model: the ``[model]`` table: every other :class:`~aftlab.models.TransformerConfig`
            field but the task's ``vocab_size`` and ``causal``; keys not given take
            :func:`default_model`'s values.
        batch_size: sequences per optimizer step, over all processes and accumulation steps.
        grad_accum: micro-batches per optimizer step on each process.
        carry_state: train on consecutive windows of ``batch_size`` contiguous streams of the
            train split, carrying the model's state (its :class:`~aftlab.models.DecodingCache`)
            from one step to the next (text tasks; a causal model whose state does not grow;
            docs/training.md, "Carried state").
        carry_grad_windows: with ``carry_state``, the windows each step reads and backpropagates
            through at once (``k``; the state is detached between steps).
        pack_documents: pack each micro-batch into one row whose documents (the rows and the
            files of a folder corpus inside them) are separated by ``cu_seqlens``, so that no
            position sees across a file (docs/training.md, "Packed documents").
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

    Example:
        >>> cfg = TrainConfig.from_dict({"mixer": "aft-local", "model": {"d_model": 64}})
        >>> cfg.mixer, cfg.model["d_model"], cfg.model["n_layers"], cfg.seq_len
        ('aft-local', 64, 3, 128)
        >>> wide = cfg.replace(model={"d_ff": 512}, seq_len=64)
        >>> wide.model["d_model"], wide.model["d_ff"], wide.seq_len
        (64, 512, 64)
    """

    task: str = "text"
    data: str | None = None
    task_options: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 128
    mixer: str = "attention"
    mixer_options: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=default_model)
    batch_size: int = 16
    grad_accum: int = 1
    carry_state: bool = False
    carry_grad_windows: int = 1
    pack_documents: bool = False
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
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _typed(f.name, getattr(self, f.name), hints[f.name]))
        for key in self.model:
            problem = _key_problem(["model", key])
            if problem:
                raise UsageError(f"config: {problem}")
        arch = self.model.get("architecture", "transformer")
        if arch not in _ARCH_KEYS:
            raise UsageError(
                f"config: 'model.architecture' must be one of {sorted(_ARCH_KEYS)}, got {arch!r}"
            )
        stray = [k for k in self.model if k not in ("architecture", *_ARCH_KEYS[arch])]
        if stray:
            raise UsageError(
                f"config: 'model.{stray[0]}' is not a setting of model.architecture = {arch!r}; "
                f"its settings: {', '.join(_ARCH_KEYS[arch])}"
            )
        self.model = {**default_model(arch), **self.model}
        if arch in _ARCH_MIXER and (self.mixer != _ARCH_MIXER[arch] or self.mixer_options):
            raise UsageError(
                f"config: model.architecture = {arch!r} has one time mix, mixer = "
                f"{_ARCH_MIXER[arch]!r} with no mixer_options; got mixer = {self.mixer!r}"
                + (f" with mixer_options {self.mixer_options}" if self.mixer_options else "")
            )
        for name in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "carry_grad_windows",
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
        if self.carry_grad_windows != 1 and not self.carry_state:
            self._fail("carry_grad_windows", "1 unless carry_state = true")
        if self.carry_state and self.pack_documents:
            raise UsageError(
                "config: carry_state and pack_documents exclude each other (one carries the "
                "state across windows, the other restarts it at every file); set one of them"
            )
        try:  # a valid model once the task adds its own (model_config_for builds the run's)
            self.model_config()
        except (TypeError, ValueError) as e:
            raise UsageError(f"config: [model]: {e}") from None

    @property
    def architecture(self) -> str:
        """The ``[model]`` table's ``architecture``: ``"transformer"`` unless it names another
        (:data:`~aftlab.models.config.ARCHITECTURES`)."""
        return self.model.get("architecture", "transformer")

    @property
    def model_label(self) -> str:
        """What the run trains, for its messages: the mixer (``"aft-local"``), and the
        architecture when it is not the Transformer (``"rwkv4 (model.architecture = rwkv4)"``).
        """
        arch = self.architecture
        if arch == "transformer":
            return self.mixer
        return f"{self.mixer} (model.architecture = {arch})"

    def model_config(self, **task: Any) -> Any:
        """The model config of this run's settings and the task's ``task`` fields
        (``vocab_size``, ``max_seq_len``, ``causal``, more ``mixer_options``; defaults when
        not given):
        a :class:`~aftlab.models.TransformerConfig`, or the config of ``model.architecture``.

        Raises:
            TypeError, ValueError: the settings make no valid model config.
        """
        fields = {**self.model, "max_seq_len": self.seq_len}
        if self.architecture == "transformer":
            options = {**self.mixer_options, **task.pop("mixer_options", {})}
            return TransformerConfig(
                **{**fields, **task, "mixer": self.mixer, "mixer_options": options}
            )
        task.pop("causal", None)  # every other architecture is a causal language model
        task.pop("mixer_options", None)
        return model_config_from_dict({**fields, **task})

    def _fail(self, name: str, expected: str) -> None:
        _fail(name, expected, getattr(self, name))

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON/TOML-serialisable dict: the config file's layout."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from the config file's layout (:meth:`to_dict`, a TOML file, an older run's
        ``config.toml``); a ``[model]`` key not given takes :func:`default_model`'s value.

        Raises:
            UsageError: an unknown or misplaced key (the message says what to write), a value
                of the wrong type, an invalid value.
        """
        if not isinstance(data, dict):
            raise UsageError(f"config: expected a table of settings, got {type(data).__name__}")
        for table in ("model", *_FREE_TABLES):
            if table in data and not isinstance(data[table], dict):
                raise UsageError(f"config: '{table}' must be a table, got {data[table]!r}")
        for key in data:
            problem = _key_problem([key])
            if problem:
                raise UsageError(f"config: {problem}")
        arch = data.get("model", {}).get("architecture")
        if arch in _ARCH_MIXER and "mixer" not in data:
            data = {**data, "mixer": _ARCH_MIXER[arch]}
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes``; a ``model`` table refines this config's.

        Raises:
            UsageError: an unknown key (the message says what to write), an invalid value.
        """
        for key in changes:
            problem = _key_problem([key])
            if problem:
                raise UsageError(f"config: {problem}")
        model = changes.get("model")
        if isinstance(model, dict):
            arch = model.get("architecture", self.architecture)
            if arch == self.architecture:
                changes["model"] = {**self.model, **model}
            elif arch in _ARCH_MIXER and "mixer" not in changes:  # another architecture
                changes.update(mixer=_ARCH_MIXER[arch], mixer_options={})
        return dataclasses.replace(self, **changes)


def _fail(name: str, expected: str, got: Any) -> None:
    raise UsageError(
        f"config: '{name}' must be {expected}, got {got!r} "
        f"(fix it in the config file or with --set {name}=...)"
    )


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the annotation ``hint`` takes it (an int for a float becomes a float, a
    tuple for a list a list); :class:`UsageError` naming ``name`` when it does not fit."""
    try:
        return _coerce(value, hint)
    except TypeError:
        raise UsageError(
            f"config: '{name}' must be of type {_type_name(hint)}, got "
            f"{type(value).__name__} {value!r}"
        ) from None


def _coerce(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for arg in args:
            try:
                return _coerce(value, arg)
            except TypeError:
                pass
        raise TypeError
    if hint is Any:
        return value
    if origin is type(None) and value is None:
        return None
    if isinstance(value, bool) and origin in (int, float):
        raise TypeError
    if origin is float and isinstance(value, int):
        return float(value)
    if origin is list and isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, origin):
        raise TypeError
    return [_coerce(v, args[0]) for v in value] if origin is list else value


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("absent" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return getattr(origin, "__name__", str(hint))


def _key_problem(path: list[str]) -> str | None:
    """What is wrong with the dotted key ``path`` of a config (one line), or None."""
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    head, sub = path[0], ".".join(path[1:])
    if head not in known:
        return _unknown(head, known)
    if not sub:
        return None
    if head in _FREE_TABLES:
        return None
    if head != "model":
        return f"'{head}' is not a table; use --set {head}=VALUE"
    top = _ON_TOP.get(path[1])
    if top is not None:
        return (
            f"'model.{path[1]}' is written '{top}', at the top level ({top} = ... in the "
            f"file, --set {top}=... on the command line)"
        )
    if path[1] in _FROM_TASK:
        return f"unknown key 'model.{path[1]}' (it is set by the task)"
    return None if sub in _MODEL_KEYS else _unknown(f"model.{sub}", list(_MODEL_KEYS), near=sub)


def _unknown(key: str, known: list[str], *, near: str | None = None) -> str:
    hint = did_you_mean(near or key, known).rstrip()
    return f"unknown key '{key}'; {hint or 'known keys: ' + ', '.join(sorted(known))}"


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


#: Keys added after runs were first stored, whose default is what every run before them did
#: (off): a stored config without them reads as one with the default.
LATER_KEYS = ("carry_state", "carry_grad_windows", "pack_documents")

#: The keys a run's stored config (its ``config.toml``, a checkpoint's ``config.json``) must
#: hold: those that change what is learned (but :data:`LATER_KEYS`). aftlab writes every key,
#: so a missing one means a damaged or edited file, which is refused rather than read with
#: today's default.
STORED_KEYS = tuple(
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.name not in RESUMABLE_CHANGES and f.name not in LATER_KEYS
)


def check_stored(data: Any, where: str) -> None:
    """Refuse a run's stored config ``data`` (named ``where``) that lacks a :data:`STORED_KEYS`.

    Raises:
        UsageError: naming ``where`` and the missing keys.
    """
    missing = [key for key in STORED_KEYS if isinstance(data, dict) and key not in data]
    if missing:
        raise UsageError(
            f"{where} has no {', '.join(map(repr, missing))}: aftlab writes every setting there, "
            "so the file is damaged or was edited; restore it, or train into a new --out"
        )


def resume_conflicts(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """The settings of ``config`` that differ from a checkpoint's ``saved`` train config.

    Fields of :data:`RESUMABLE_CHANGES` may differ; tables are compared key by key.

    Returns:
        One ``"lr is 0.002 there but 0.01 here"`` per differing (dotted) key; empty when the
        run may be resumed with ``config``.
    """
    try:  # an older version's layout (a partial [model] table) reads as this one's
        saved = TrainConfig.from_dict(saved).to_dict()
    except UsageError:
        pass  # compared as it is
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


def apply_overrides(
    data: dict[str, Any], overrides: list[str], *, values: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Set ``values`` (top-level keys, e.g. ``{"mixer": "aft-local"}`` from the CLI's flags),
    then the ``--set`` ``overrides``, in a config dict (the file's layout).

    Raises:
        UsageError: an unknown or misplaced key, or a dotted key into a value that is not a
            table.
    """
    out = json.loads(json.dumps(data))
    items = [([key], value, f"--{key}") for key, value in (values or {}).items()]
    items += [(*parse_override(text), f"--set {text!r}") for text in overrides]
    for path, value, where in items:
        problem = _key_problem(path)
        if problem:
            raise UsageError(f"{where}: {problem}")
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UsageError(f"{where}: '{k}' is not a table")
        node[path[-1]] = value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    values: dict[str, Any] | None = None,
    stored: bool = False,
) -> TrainConfig:
    """Read a TOML (or JSON) config file, apply ``values`` and ``--set`` overrides, validate.

    Args:
        path: a ``.toml`` or ``.json`` file; ``None`` starts from the defaults.
        overrides: ``key=value`` strings (see :func:`parse_override`).
        values: top-level settings as they are (the CLI's ``--mixer``, ``--steps``, ...),
            applied before ``overrides``.
        stored: ``path`` is a run's own ``config.toml``: each of :data:`STORED_KEYS` must be
            in it (:func:`check_stored`).

    Raises:
        UsageError: missing or malformed file, unknown key, invalid value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file {str(p)!r} does not exist (check the --config path)")
        try:
            text = p.read_text(encoding="utf-8")
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except OSError as e:  # not a syntax error: permissions, I/O
            raise UsageError(f"cannot read config file {str(p)!r}: {reason(e)}") from None
        except READ_ERRORS as e:
            raise UsageError(
                f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: "
                f"{reason(e)}"
            ) from None
        if stored:
            check_stored(data, f"config file {str(p)!r}")
    return TrainConfig.from_dict(apply_overrides(data, overrides or [], values=values))


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

    ``None`` fields (``data``, ``out``, ``eval_batch_size``, ``model.d_ff``, ... when unset) are
    written as comments.
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
        lines.extend(
            f"# {k} = (unset)" if v is None else f"{json.dumps(k)} = {_toml_value(v)}"
            for k, v in table.items()
        )
    return "\n".join(lines) + "\n"
