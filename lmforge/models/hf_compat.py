"""State-dict conversion from lmforge GPT models to Hugging Face ``transformers`` layouts.

The results load with ``load_state_dict(strict=True)`` into ``GPT2LMHeadModel`` /
``LlamaForCausalLM`` built from a config with the same sizes; no ``transformers`` import needed here.
"""

from __future__ import annotations

import torch

from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPT


def _require_flavor(model: GPT, flavor: str) -> None:
    if not isinstance(model, GPT) or model.config.flavor != flavor:
        got = model.config.flavor if isinstance(model, GPT) else type(model).__name__
        raise LMForgeError(f"this export needs a gpt model with model.flavor={flavor}, got {got}")
    if model.config.mhc_enabled:
        raise LMForgeError("a model with mHC (model.mhc_enabled=true) has no transformers equivalent: its residual "
                           f"stream is {model.config.mhc_flows} flows wide; only plain gpt2/llama models convert (lmforge's own "
                           "checkpoint format, config.yaml + model.safetensors, always works)")


def gpt2_state_dict_for_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our gpt2-flavor weights under ``GPT2LMHeadModel`` names.

    HF GPT-2 uses ``Conv1D`` (``x @ W + b`` with ``W`` of shape ``[in, out]``), so every block
    matrix is our ``nn.Linear`` weight transposed; the fused qkv rows are already in HF's q|k|v order.
    """
    _require_flavor(model, "gpt2")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {
        "transformer.wte.weight": sd["tok_embed.weight"],
        "transformer.wpe.weight": sd["pos_embed.weight"],
        "transformer.ln_f.weight": sd["norm_f.weight"],
        "transformer.ln_f.bias": sd["norm_f.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    renames = {"norm_1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "norm_2": "ln_2", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(model.config.n_layer):
        for ours, theirs in renames.items():
            weight = sd[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = weight.t().contiguous() if weight.dim() == 2 else weight
            out[f"transformer.h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{ours}.bias"]
    return out


def llama_state_dict_for_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our llama-flavor weights under ``LlamaForCausalLM`` names (fused projections split).

    Both use the rotate-half RoPE convention, so q/k rows need no permutation.
    """
    _require_flavor(model, "llama")
    c = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {
        "model.embed_tokens.weight": sd["tok_embed.weight"],
        "model.norm.weight": sd["norm_f.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    q_rows, kv_rows = c.n_head * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.n_layer):
        p, hf = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[p + "attn.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        gate, up = sd[p + "mlp.gate_up.weight"].chunk(2)
        out.update({
            hf + "input_layernorm.weight": sd[p + "norm_1.weight"],
            hf + "self_attn.q_proj.weight": q,
            hf + "self_attn.k_proj.weight": k,
            hf + "self_attn.v_proj.weight": v,
            hf + "self_attn.o_proj.weight": sd[p + "attn.proj.weight"],
            hf + "post_attention_layernorm.weight": sd[p + "norm_2.weight"],
            hf + "mlp.gate_proj.weight": gate,
            hf + "mlp.up_proj.weight": up,
            hf + "mlp.down_proj.weight": sd[p + "mlp.proj.weight"],
        })
    return out
