"""What each export format can express, and the one refusal message that says so."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import LMForgeError

SUPPORTED = ("lmforge's own checkpoint format (config.yaml + model.safetensors) always works; "
             "--format hf and --format gguf export plain (non-mHC) gpt models of the gpt2 or llama flavor")


def check_exportable(model, model_dir: Path, tool: str) -> None:
    """Refuse models that ``tool`` (transformers, llama.cpp) has no architecture for."""
    from lmforge.models.gpt import GPT

    if not isinstance(model, GPT):
        raise LMForgeError(f"{model_dir} holds a {model.family!r} model, which {tool} has no architecture for; "
                           f"{SUPPORTED}")
    if model.config.mhc_enabled:
        raise LMForgeError(f"{model_dir} holds a model with mHC (model.mhc_enabled=true), whose "
                           f"{model.config.mhc_flows}-flow residual stream {tool} cannot run; {SUPPORTED}")
