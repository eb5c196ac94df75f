"""Model classes and their on-disk format. ``build_model(config)`` and ``load_model(dir)`` are the entry
points; which class a family name means is the recipe registry's to say (``lmforge.recipes``), because
kinds bring their own families."""

from __future__ import annotations

from typing import Any

from lmforge.models.base import LMForgeModel
from lmforge.recipes import families, family_of_config, model_class


def build_model(config: Any) -> LMForgeModel:
    return model_class(family_of_config(config))(config)


def load_model(directory, map_location="cpu") -> LMForgeModel:
    return LMForgeModel.from_pretrained(directory, map_location=map_location)


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes (a shared tensor, e.g. a tied LM head, counted once),
    without allocating them: the model is built on PyTorch's meta device, so a 7B config costs nothing."""
    import torch

    with torch.device("meta"):
        model = build_model(config)
    return model.num_parameters()


__all__ = ["LMForgeModel", "build_model", "count_parameters", "families", "load_model", "model_class"]


def __getattr__(name: str):
    # `from lmforge.models import RLMModel` (the RLM-mHC guide's name), without importing gpt eagerly.
    if name == "RLMModel":
        from lmforge.models.gpt import RLMModel

        return RLMModel
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
