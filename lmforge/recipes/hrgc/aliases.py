"""Seed 000's names for the hrgc kind: its training settings, which lmforge 0.1 read under ``model.*``
(as the seed's config dict keeps them beside the model's sizes), are the kind's ``recipe.*`` now."""

from __future__ import annotations

from typing import Any

from lmforge.config import move_keys
from lmforge.recipes.hrgc.model import TRAINING_KEYS

MOVED_FROM_MODEL = {f"model.{key}": f"recipe.{key}" for key in TRAINING_KEYS}


def hrgc_aliases(values: dict[str, Any]) -> dict[str, Any]:
    return move_keys(values, MOVED_FROM_MODEL)
