"""``lmforge export CKPT --format gguf --out FILE``: one GGUF file that llama.cpp loads and runs.

Layout decisions (checked against llama.cpp's loaders and ``convert_hf_to_gguf.py``):

* gpt2 flavor -> GGUF arch ``gpt2``: the fused ``attn_qkv`` keeps our [q | k | v] rows. llama.cpp
  requires every bias of that architecture, so a missing one is written as zeros. llama.cpp's GELU is
  the tanh approximation (``gelu_new``; on CPU read from an fp16 table) and GGUF has no switch for
  exact erf: a ``gelu`` model is exported unchanged, and its logits differ by up to ~1e-2 (``gelu_new``
  models: ~3e-3), which flips greedy tokens only where the top two are nearly tied.
* llama flavor -> GGUF arch ``llama``: fused qkv and gate_up are split. llama.cpp's rotary embedding
  rotates adjacent pairs (2i, 2i+1), ours (like HF Llama) pairs i with i + head_dim/2, so within each
  head the q and k rows are reordered [0, h/2, 1, h/2+1, ...] (k per kv head: GQA works unchanged).
* A tied LM head is not written: both architectures fall back to ``token_embd`` when ``output`` is
  missing.
* dtype ``f32``: everything f32. ``f16``: weight matrices f16; norms, biases and the gpt2 position
  table stay f32 (what llama.cpp's converter does). ``q8_0``: matrices whose rows are a multiple of
  32 long become Q8_0, other matrices f16, the rest f32 as for f16.
* The tokenizer travels as llama.cpp's ``gpt2`` BPE with the ``gpt-2`` pre-tokenizer (the GPT-2
  regex our ByteLevel pre-tokenizer uses), special tokens as control tokens (other added tokens as
  user-defined ones), no automatic bos/eos, and the chat template. Other tokenizers (sentencepiece,
  custom split regexes) are refused rather than exported with a tokenization that silently differs.
  Two llama.cpp behaviours remain: special tokens written in text are split out only when tokenizing
  with ``special=True`` (lmforge always splits them), and its whole-sequence ``llama_detokenize``
  applies GPT-2's space clean-up (" ," -> ","); per-token pieces, which streaming uses, are exact.

Written to a hidden sibling file and renamed into place: never half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.export.formats import check_exportable
from lmforge.files import atomic_file, remove_stale, reporting_write_faults

GGUF_DTYPES = ("f32", "f16", "q8_0")
GGUF_MAGIC = b"GGUF"


class _FileWrittenArray(np.ndarray):
    """An array whose ``tofile`` (what GGUFWriter writes tensors with) is a file write: a full disk raises
    ENOSPC with its errno, where ``ndarray.tofile`` raises an OSError without one ("N requested and M written")."""

    def tofile(self, fid, *args, **kwargs) -> None:
        fid.write(np.ascontiguousarray(self).data)


def _rope_pairs_adjacent(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from rotate-half pairs (i, i + h/2) to adjacent pairs (2i, 2i+1)."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gpt2_tensors(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def with_bias(gguf_name: str, ours: str) -> dict[str, torch.Tensor]:
        weight = sd[ours + ".weight"]
        return {f"{gguf_name}.weight": weight,
                f"{gguf_name}.bias": sd.get(ours + ".bias", torch.zeros(weight.shape[0]))}

    out = {"token_embd.weight": sd["tok_embed.weight"], "position_embd.weight": sd["pos_embed.weight"],
           **with_bias("output_norm", "norm_f")}
    for i in range(model.config.n_layer):
        for gguf_name, ours in (("attn_norm", "norm_1"), ("attn_qkv", "attn.qkv"), ("attn_output", "attn.proj"),
                                ("ffn_norm", "norm_2"), ("ffn_up", "mlp.fc"), ("ffn_down", "mlp.proj")):
            out.update(with_bias(f"blk.{i}.{gguf_name}", f"blocks.{i}.{ours}"))
    return out


# transformers' Llama names -> llama.cpp's, per block (hf_compat has already split the fused projections).
_LLAMA_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_tensors(model) -> dict[str, torch.Tensor]:
    """The HF layout (``llama_state_dict_for_hf``) under llama.cpp's names, q/k rows reordered."""
    from lmforge.models.hf_compat import llama_state_dict_for_hf

    c = model.config
    hf = {k: v.float() for k, v in llama_state_dict_for_hf(model).items()}
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    for i in range(c.n_layer):
        for theirs, ours in _LLAMA_BLOCK_NAMES.items():
            weight = hf[f"model.layers.{i}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                weight = _rope_pairs_adjacent(weight, c.n_head if ours == "attn_q" else c.kv_heads)
            out[f"blk.{i}.{ours}.weight"] = weight
    return out


def _encoded(name: str, tensor: torch.Tensor, dtype: str):
    """``(array, ggml type)`` of one tensor as ``dtype`` asks (see the module docstring)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    data = tensor.contiguous().numpy().astype(np.float32)
    if dtype == "f32" or data.ndim < 2 or name == "position_embd.weight":
        return data, Q.F32
    if dtype == "q8_0" and data.shape[-1] % 32 == 0:  # Q8_0 blocks are 32 values of one row
        return quantize(data, Q.Q8_0), Q.Q8_0
    return data.astype(np.float16), Q.F16


def _vocab(tokenizer_file: Path, tokenizer, model_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens in id order, their GGUF token types and the merges, from ``tokenizer.json``."""
    from gguf import TokenType

    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    bpe, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    plain_byte_level = (
        bpe.get("type") == "BPE" and not data.get("normalizer") and pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space") and pre.get("use_regex", True)
        and not bpe.get("ignore_merges") and not bpe.get("continuing_subword_prefix")
        and not bpe.get("end_of_word_suffix"))
    if not plain_byte_level:
        raise LMForgeError(
            f"{tokenizer_file} is not a plain byte-level BPE tokenizer (ByteLevel pre-tokenizer without prefix "
            "space, no normalizer), so llama.cpp would tokenize text differently; --format gguf needs one like "
            "`lmforge tokenizer train` makes (or export with --format hf)")
    by_id = {i: t for t, i in bpe.get("vocab", {}).items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    special = {i for i, t in added.items() if t.get("special")}
    n = tokenizer.vocab_size
    if sorted(by_id) != list(range(n)):
        raise LMForgeError(f"{tokenizer_file}: its token ids are not 0..{n - 1} without gaps, which GGUF's "
                           "token list needs; re-create the tokenizer with `lmforge tokenizer train`")
    if n > model_vocab:
        raise LMForgeError(f"{tokenizer_file} has {n} tokens but the model only {model_vocab}: they do not "
                           "belong together; put the tokenizer the model was trained with beside it")
    tokens = [by_id[i] for i in range(n)]
    # Like HF, llama.cpp always splits user-defined tokens out of text, control tokens only on request.
    types = [int(TokenType.CONTROL if i in special else TokenType.USER_DEFINED if i in added
                 else TokenType.NORMAL) for i in range(n)]
    # A model vocabulary larger than the tokenizer's (padded for speed): llama.cpp needs one entry per row.
    tokens += [f"[PAD{i}]" for i in range(n, model_vocab)]
    types += [int(TokenType.UNUSED)] * (model_vocab - n)
    # tokenizers >= 0.20 stores merges as pairs, older versions as "a b" strings.
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    return tokens, types, merges


def _check_out(out: Path, overwrite: bool) -> None:
    in_the_way = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if in_the_way is not None and not in_the_way.is_dir():
        raise LMForgeError(f"--out {out} cannot be written: {in_the_way} is a file, not a directory. Choose "
                           "another path for the GGUF file, or move that file away.")
    remove_stale(out)  # what an export killed mid-write left beside it
    if not out.exists():
        return
    is_gguf = False
    if out.is_file():
        with open(out, "rb") as f:
            is_gguf = f.read(4) == GGUF_MAGIC
    if not is_gguf:  # said first: --overwrite would not replace it either
        raise LMForgeError(f"--out {out} exists and is not a GGUF file ({'a directory' if out.is_dir() else 'another file'}), "
                           "so lmforge does not replace it, even with --overwrite; choose another path")
    if not overwrite:
        raise LMForgeError(f"--out {out} holds a GGUF file; pass --overwrite to replace it or choose another file")


def export_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32",
                overwrite: bool = False) -> Path:
    """Write ``checkpoint`` (any form ``lmforge eval`` takes) as one GGUF file; returns its path."""
    try:
        import gguf
    except ImportError as e:
        raise LMForgeError("--format gguf needs the gguf package (llama.cpp's writer): pip install gguf") from e

    from lmforge.infer.loading import find_tokenizer
    from lmforge.models import load_model
    from lmforge.tokenizer import Tokenizer
    from lmforge.checkpoint import resolve_model_dir

    if dtype not in GGUF_DTYPES:
        raise LMForgeError(f"unknown GGUF dtype {dtype!r}; use one of: {', '.join(GGUF_DTYPES)}")
    model_dir = resolve_model_dir(checkpoint)
    model = load_model(model_dir)
    check_exportable(model, model_dir, "llama.cpp")
    c = model.config
    tokenizer_file = find_tokenizer(model_dir)
    tokenizer = Tokenizer.load(tokenizer_file)
    tokens, token_types, merges = _vocab(tokenizer_file, tokenizer, c.vocab_size)
    out = Path(out).resolve()
    _check_out(out, overwrite)

    tensors = _gpt2_tensors(model) if c.flavor == "gpt2" else _llama_tensors(model)
    if not c.tie_word_embeddings:
        tensors["output.weight"] = model.lm_head.weight.detach().float()
    name = model_dir.parent.parent.name if model_dir.parent.name == "checkpoints" else model_dir.name
    with reporting_write_faults(out), atomic_file(out) as tmp:
        out.parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(tmp, c.flavor)  # lmforge's flavor names are the GGUF architecture names
        try:
            w.add_name(name)
            w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            w.add_context_length(c.n_positions)
            w.add_embedding_length(c.n_embd)
            w.add_block_count(c.n_layer)
            w.add_feed_forward_length(c.inner_size)
            w.add_head_count(c.n_head)
            w.add_head_count_kv(c.kv_heads)
            if c.flavor == "gpt2":
                w.add_layer_norm_eps(c.layer_norm_epsilon)
            else:
                w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
                w.add_rope_freq_base(c.rope_theta)
                w.add_rope_dimension_count(c.head_dim)
            w.add_vocab_size(c.vocab_size)

            w.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
            w.add_tokenizer_pre("gpt-2")  # the plain GPT-2 split regex
            w.add_token_list(tokens)
            w.add_token_types(token_types)
            w.add_token_merges(merges)
            for role, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                              ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
                token_id = getattr(tokenizer, f"{role}_id")
                if token_id is not None:
                    add(token_id)
            w.add_add_bos_token(False)  # lmforge never adds bos/eos when encoding
            w.add_add_eos_token(False)
            w.add_chat_template(tokenizer.chat_template)

            for tensor_name, tensor in tensors.items():
                data, qtype = _encoded(tensor_name, tensor, dtype)
                w.add_tensor(tensor_name, data.view(_FileWrittenArray), raw_dtype=qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return out
