"""``lmforge export CKPT --format hf --out DIR``: a Hugging Face ``transformers`` model directory.

The gpt2 flavor becomes ``GPT2LMHeadModel``, the llama flavor ``LlamaForCausalLM`` (both use the
rotate-half rotary layout, so q/k rows need no permutation; ``lmforge.models.hf_compat``). The
directory holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer
files, so ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
work without lmforge. Written into a hidden sibling and renamed into place (``lmforge.files``): never half a directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from lmforge.errors import LMForgeError
from lmforge.export.formats import check_exportable
from lmforge.files import atomic_directory, remove_stale

def _gpt2_config(c) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
        "n_positions": c.n_positions, "n_ctx": c.n_positions, "n_embd": c.n_embd, "n_layer": c.n_layer,
        "n_head": c.n_head, "n_inner": c.inner_size, "activation_function": c.activation_function,
        "resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop,
        "layer_norm_epsilon": c.layer_norm_epsilon, "initializer_range": c.initializer_range,
        "tie_word_embeddings": c.tie_word_embeddings, "scale_attn_weights": True, "use_cache": True,
    }


def _llama_config(c) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd, "intermediate_size": c.inner_size, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.n_positions, "rms_norm_eps": c.layer_norm_epsilon, "hidden_act": "silu",
        # transformers < 5 reads rope_theta, >= 5 rope_parameters
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": c.attn_pdrop,
        "initializer_range": c.initializer_range, "tie_word_embeddings": c.tie_word_embeddings, "use_cache": True,
    }


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``checkpoint`` (any form ``lmforge eval`` takes) as a transformers model directory."""
    from lmforge.infer.loading import find_tokenizer
    from lmforge.models import load_model
    from lmforge.models.hf_compat import gpt2_state_dict_for_hf, llama_state_dict_for_hf
    from lmforge.tokenizer import Tokenizer
    from lmforge.checkpoint import resolve_model_dir

    model_dir = resolve_model_dir(checkpoint)
    model = load_model(model_dir)
    check_exportable(model, model_dir, "transformers")
    c = model.config
    if c.flavor == "gpt2":
        state, config = gpt2_state_dict_for_hf(model), _gpt2_config(c)
    else:
        state, config = llama_state_dict_for_hf(model), _llama_config(c)
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding on load
    tokenizer = Tokenizer.load(find_tokenizer(model_dir))
    ids = {"bos_token_id": tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id,
           "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    # Where the weights came from, as an absolute path with links resolved: the path as typed (runs/x) means
    # nothing read from another directory, and a link (runs/current -> runs/exp7) may be pointed elsewhere
    # later, while the real directory keeps naming the weights that were exported.
    config.update({**ids, "torch_dtype": "float32", "lmforge_source": str(model_dir.resolve())})

    out = Path(out).resolve()
    remove_stale(out)  # an export killed mid-replacement may have moved the previous one aside
    kept: list[Path] = []
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # only an earlier export of lmforge's may be replaced: --overwrite is named where it would be taken
        if not _is_lmforge_export(out):
            raise LMForgeError(f"--out {out} exists and is not an earlier lmforge export (a config.json with "
                               "lmforge_source); lmforge does not replace it, even with --overwrite: choose another "
                               "directory")
        if not overwrite:
            raise LMForgeError(f"--out {out} holds an earlier export; pass --overwrite to replace it or choose "
                               "another directory")
        kept = sorted(out.iterdir())  # what the new export does not write is carried over: a model card the user added
    with atomic_directory(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({**ids, "do_sample": False}, indent=2) + "\n")
        tokenizer.save(tmp)
        for extra in kept:  # carried into the new export, not deleted with the old one
            if extra.name in {p.name for p in tmp.iterdir()}:
                continue
            if extra.is_symlink():  # a link stays a link
                os.symlink(os.readlink(extra), tmp / extra.name)
            elif extra.is_dir():
                shutil.copytree(extra, tmp / extra.name, symlinks=True)
            else:
                shutil.copy2(extra, tmp / extra.name)
    return out


def _is_lmforge_export(directory: Path) -> bool:
    try:
        return directory.is_dir() and "lmforge_source" in json.loads((directory / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
