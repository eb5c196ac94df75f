"""Model families, registered by name. ``build_model(config)`` and ``load_model(dir)`` are the entry points."""

from __future__ import annotations

import difflib
from typing import Any

from lmforge.errors import LMForgeError
from lmforge.models.base import LMForgeModel

_REGISTRY: dict[str, type[LMForgeModel]] = {}


def register(model_cls: type[LMForgeModel]) -> type[LMForgeModel]:
    _REGISTRY[model_cls.family] = model_cls
    return model_cls


def families() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def model_class(family: str | None) -> type[LMForgeModel]:
    _load_builtin()
    if family not in _REGISTRY:
        close = difflib.get_close_matches(str(family), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise LMForgeError(f"unknown model family {family!r}; known: {', '.join(sorted(_REGISTRY))}.{hint}")
    return _REGISTRY[family]


def config_class(family: str | None) -> type:
    return model_class(family).config_class


def config_from_dict(family: str | None, values: dict[str, Any], source: str = "model") -> Any:
    """Build a family's config dataclass from a plain dict, rejecting unknown keys with a suggestion."""
    from lmforge.config import dataclass_from_dict

    return dataclass_from_dict(config_class(family), values, prefix=source)


def build_model(config: Any) -> LMForgeModel:
    for family, cls in _registry_items():
        if isinstance(config, cls.config_class):
            return cls(config)
    raise LMForgeError(f"no model family takes a config of type {type(config).__name__}")


def load_model(directory, map_location="cpu") -> LMForgeModel:
    return LMForgeModel.from_pretrained(directory, map_location=map_location)


def _registry_items():
    _load_builtin()
    return list(_REGISTRY.items())


def _load_builtin() -> None:
    # Importing a family module registers it; keep this list the one place families are named.
    from lmforge.models import gpt, hrgc, hrm, puzzle_transformer, trm  # noqa: F401


__all__ = ["LMForgeModel", "build_model", "load_model", "register", "families", "model_class",
           "config_class", "config_from_dict"]


def __getattr__(name: str):
    # `from lmforge.models import RLMModel` (the RLM-mHC guide's name), without importing gpt eagerly.
    if name == "RLMModel":
        from lmforge.models.gpt import RLMModel

        return RLMModel
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
