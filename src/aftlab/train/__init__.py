"""Training, evaluation, checkpoints, sampling and comparison (what ``aftlab`` runs).

Example::

    from aftlab.train import Trainer, load_config
    cfg = load_config(None, ["mixer=aft-local", "steps=200", "out=runs/local"])
    Trainer(cfg, run_dir=cfg.out).fit()

See docs/training.md.
"""

from ..errors import UsageError
from .checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from .config import TrainConfig, load_config
from .optim import build_optimizer, lr_at, param_groups
from .run import load_run
from .trainer import Trainer, evaluate

__all__ = [
    "TrainConfig",
    "load_config",
    "Trainer",
    "evaluate",
    "UsageError",
    "build_optimizer",
    "param_groups",
    "lr_at",
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "load_run",
]
