"""Load a checkpoint (any of the path forms users pass) with its tokenizer, ready for inference."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import LMForgeError
from lmforge.models import load_model
from lmforge.train.checkpoint import resolve_model_dir
from lmforge.train.device import pick_device


def find_tokenizer(model_dir: Path) -> Path:
    """The tokenizer saved with a checkpoint, else the run directory's copy."""
    for candidate in (model_dir / "tokenizer.json", model_dir.parent.parent / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise LMForgeError(f"no tokenizer.json in {model_dir} or its run directory; copy the tokenizer the model "
                       "was trained with into the checkpoint directory")


def load_for_inference(checkpoint: str | Path, device: str = "auto"):
    """Returns ``(model, tokenizer, device)`` with the model in eval mode."""
    from lmforge.tokenizer import Tokenizer

    model_dir = resolve_model_dir(checkpoint)
    dev = pick_device(device)
    model = load_model(model_dir, map_location=dev)
    model.eval()
    if not hasattr(model, "new_kv_cache"):
        raise LMForgeError(f"{model_dir} holds a {model.family!r} model, which does not generate text; this "
                           "command takes gpt-family checkpoints (for Sudoku models use `lmforge solve` / "
                           "`lmforge eval`)")
    tokenizer = Tokenizer.load(find_tokenizer(model_dir))
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise LMForgeError(f"the tokenizer beside {model_dir} has {tokenizer.vocab_size} tokens but the model "
                           f"only {vocab}: they do not belong together")
    return model, tokenizer, dev
