"""Model classes and their on-disk format. ``build_model(config)`` and ``load_model(dir)`` are the entry
points; which class a family name means is the recipe registry's to say (``lmforge.recipes``), because
kinds bring their own families."""

from __future__ import annotations

from typing import Any

from lmforge.models.base import LMForgeModel
from lmforge.recipes import families, family_of_config, model_class


def build_model(config: Any) -> LMForgeModel:
    return model_class(family_of_config(config))(config)


def build_empty_model(config: Any, device) -> LMForgeModel:
    """The model ``config`` describes, its weights allocated on ``device`` but not initialised: for a caller that
    loads every one of them (a resume; a 1.3B model spent ~30 s on random weights it threw away). The tables a
    model computes from its config (``reset_buffers``) are computed."""
    import torch

    from lmforge.models.base import on_meta_device, rebuild_unsaved_buffers

    with on_meta_device():
        model = build_model(config)
    # to_empty gives each module its own tensor: a parameter several modules share (a tied LM head, a trunk two
    # models use) is shared again afterwards, wherever the model tied it.
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (module, name), *others in places.values():
        for other, other_name in others:
            other._parameters[other_name] = module._parameters[name]
    rebuild_unsaved_buffers(model, device)
    return model


def load_model(directory, map_location="cpu") -> LMForgeModel:
    return LMForgeModel.from_pretrained(directory, map_location=map_location)


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes (a shared tensor, e.g. a tied LM head, counted once),
    without allocating them: the model is built on PyTorch's meta device, so a 7B config costs nothing."""
    from lmforge.models.base import on_meta_device

    with on_meta_device():
        model = build_model(config)
    return model.num_parameters()


__all__ = ["LMForgeModel", "build_empty_model", "build_model", "count_parameters", "families", "load_model", "model_class"]


def __getattr__(name: str):
    # `from lmforge.models import RLMModel` (the RLM-mHC guide's name), without importing gpt eagerly.
    if name == "RLMModel":
        from lmforge.models.gpt import RLMModel

        return RLMModel
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
