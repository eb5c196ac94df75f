"""The top-level names of HRM's `pretrain.py` (seed 003): `lmforge train hrm_sudoku data_path=... epochs=500
eval_interval=100 global_batch_size=4 lr=1e-4 arch.hidden_size=32 ...` works as written. Each maps
to one lmforge key; `arch.*` is `model.*`. (HRM counts `eval_interval` in epochs.)"""

from __future__ import annotations

from typing import Any

from lmforge.config import move_keys
from lmforge.errors import LMForgeError
from lmforge.typed import short_repr

HRM_ALIASES = {
    "data_path": "data.path",
    "epochs": "training.epochs",
    "eval_interval": "training.eval_interval_epochs",
    "global_batch_size": "training.global_batch_size",
    "lr": "training.lr",
    "lr_warmup_steps": "training.warmup_steps",
    "lr_min_ratio": "training.min_lr_ratio",
    "beta1": "training.beta1",
    "beta2": "training.beta2",
    "weight_decay": "training.weight_decay",
    "puzzle_emb_lr": "recipe.puzzle_emb_lr",
    "puzzle_emb_weight_decay": "recipe.puzzle_emb_weight_decay",
    "project_name": "logging.wandb_project",
    "run_name": "name",
}
# Training settings that lmforge 0.1 kept under model.* (and HRM under arch.*): the puzzle kind's now.
MOVED_FROM_MODEL = {f"model.{key}": f"recipe.{key}" for key in ("puzzle_emb_lr", "puzzle_emb_weight_decay")}


def hrm_aliases(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    if "arch" in out:
        arch = out.pop("arch")
        if not isinstance(arch, dict):
            raise LMForgeError(f"'arch' must be a mapping of model keys (arch.hidden_size=...), got {short_repr(arch)}")
        clash = set(arch) & set(out.get("model") or {})
        if clash:
            raise LMForgeError(f"arch.{sorted(clash)[0]} and model.{sorted(clash)[0]} are both given; keep one")
        out["model"] = {**(out.get("model") or {}), **arch}
    return move_keys(out, {**HRM_ALIASES, **MOVED_FROM_MODEL})
