"""Load a checkpoint (any of the path forms users pass) with its tokenizer, ready for inference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmforge.errors import LMForgeError
from lmforge.models import load_model
from lmforge.recipes import kind_of_family
from lmforge.checkpoint import resolve_model_dir
from lmforge.device import pick_device, pick_precision


def find_tokenizer(model_dir: Path) -> Path:
    """The tokenizer saved with a checkpoint, else the run directory's copy."""
    for candidate in (model_dir / "tokenizer.json", model_dir.parent.parent / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise LMForgeError(f"no tokenizer.json in {model_dir} or its run directory; copy the tokenizer the model "
                       "was trained with into the checkpoint directory")


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def inference_dtype(precision: str, device) -> torch.dtype:
    """The weight dtype for generation. ``auto``: bf16 on GPUs that have it and on CPUs with bf16
    units (AMX / AVX512-BF16), where decoding is bound by reading the weights and bf16 halves that;
    fp32 elsewhere."""
    if precision not in PRECISIONS:
        raise LMForgeError(f"unknown precision {precision!r}; use one of: {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type == "cpu":
        raise LMForgeError("--precision fp16 is for GPUs; on a CPU use fp32, or bf16 on CPUs with bf16 units")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise LMForgeError("this GPU has no bf16 support; use --precision fp16 or fp32")
    if precision == "auto":
        precision = pick_precision("auto", device)
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def load_for_inference(checkpoint: str | Path, device: str = "auto", precision: str = "fp32",
                       model_class: type | None = None, quantize: str = "none"):
    """Returns ``(model, tokenizer, device)`` with the model in eval mode, its weights in ``precision``
    (``inference_dtype``; the default fp32 is what evaluation needs). ``model_class``: the class the
    checkpoint must hold; by default a text generator (a model with a KV cache). ``quantize="int8"``:
    int8 weights for CPU decoding (``lmforge.infer.quantize``; device auto is then the CPU), with
    ``precision`` the activations' (auto: bf16 on CPUs with bf16 units, else fp32)."""
    from lmforge.infer.quantize import check_quantize, quantize_int8
    from lmforge.tokenizer import Tokenizer, unused_vocab

    model_dir = resolve_model_dir(checkpoint)
    dev = pick_device(check_quantize(quantize, device, precision))
    dtype = inference_dtype(precision, dev)
    model = load_model(model_dir, map_location=dev)
    model.eval()
    if dtype != torch.float32 and quantize == "none":
        model.to(dtype)
    if model_class is not None and not isinstance(model, model_class):
        raise LMForgeError(f"{model_dir} holds a {model.family!r} model, not a {model_class.family!r} model")
    if model_class is None and not hasattr(model, "new_kv_cache"):
        kind = kind_of_family(model.family)
        what = f"`lmforge generate CKPT ...` runs it ({kind.generate.help})" if kind.generate else "it has no generate"
        raise LMForgeError(f"{model_dir} holds a {model.family!r} model (kind {kind.name}), which does not generate "
                           f"text, so this command cannot take it; {what}, and `lmforge eval` scores it")
    if quantize != "none":
        quantize_int8(model, dtype)  # from the checkpoint's fp32 weights
    tokenizer = Tokenizer.load(find_tokenizer(model_dir))
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise LMForgeError(f"the tokenizer beside {model_dir} has {tokenizer.vocab_size} tokens but the model "
                           f"only {vocab}: they do not belong together")
    if vocab is not None and unused_vocab(vocab, tokenizer.vocab_size):
        print(f"note: the model in {model_dir} has a vocabulary of {vocab} but its tokenizer only "
              f"{tokenizer.vocab_size} tokens: if the tokenizer is not the one the model was trained with, the "
              "output is meaningless", file=sys.stderr)
    return model, tokenizer, dev
