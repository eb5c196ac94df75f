"""Decoder-only transformer in two flavors: ``gpt2`` (GPT-2 layout) and ``llama`` (Llama layout).

gpt2:  token + learned position embeddings, pre-LN blocks with LayerNorm (with bias), GELU MLP,
       biases everywhere, final LayerNorm, LM head. Converts 1:1 to ``transformers.GPT2LMHeadModel``
       (see ``lmforge.models.hf_compat``).
llama: RMSNorm with learned scale, rotary position embeddings, SwiGLU MLP, no biases, optional
       grouped-query attention (``n_kv_head < n_head``).

RoPE convention: "rotate half", exactly as HF ``LlamaForCausalLM`` computes it: the head dimension
is split into two halves (not interleaved pairs), ``inv_freq[i] = rope_theta ** (-2i / head_dim)``,
``cos``/``sin`` are ``cat(freqs, freqs)`` and ``q' = q * cos + rotate_half(q) * sin`` with
``rotate_half([x1, x2]) = [-x2, x1]`` (``_rotary`` computes the same on the two halves). Our q/k
projection rows are therefore in HF's order and an export to HF Llama needs no permutation (Meta's
original checkpoints use interleaved pairs instead).

Presets (``model.preset``) fill the sizes a config does not set explicitly; parameter counts:

=======  ======================  =============  =================  =================  ==================
preset   layers / width / heads  non-embedding  gpt2, vocab 50257  gpt2, vocab 32000  llama, vocab 32000
=======  ======================  =============  =================  =================  ==================
tiny     6 / 384 / 6             10,647,552     30,339,456         23,328,768         22,909,824
small    12 / 768 / 12           85,056,000     124,439,808        110,418,432        109,529,856
medium   24 / 1024 / 16          302,311,424    354,823,168        336,128,000        336,380,928
large    24 / 2048 / 16          1,208,602,624  1,313,626,112      1,276,235,776      1,279,887,360
=======  ======================  =============  =================  =================  ==================

"non-embedding" is the gpt2 flavor's transformer blocks + final norm; totals are with the default
n_positions=1024 and count the tied LM head once (llama SwiGLU widths: 1024, 2048, 2752, 5504). ``small``/``medium`` are GPT-2 124M/350M, ``large`` is GPT-3 XL (1.3B, head dim 128); ``tiny``
is ~10M parameters in its blocks (the embeddings dominate at tiny sizes).

Seed 004's sizes (the staged code-assistant guide; ``lmforge train --stage ... --model-size X`` picks
``pipeline-X``) are a separate set, so the names above keep their meaning. Each sets ``flavor: llama``
(an explicit ``model.flavor=gpt2`` beside one is an error, never silently replaced) and the guide's
d_ff as ``n_inner``, which SwiGLU spends on three d_ff x width matrices. Counted at the guide's 32000
vocabulary with tied embeddings (``lmforge.models.count_parameters``, on the meta device):

===============  ======================  ====  =============  =============  ===========
preset           layers / width / heads  d_ff  non-embedding  total          guide's row
===============  ======================  ====  =============  =============  ===========
pipeline-tiny    4 / 256 / 4             1024  4,196,608      12,388,608     "10M"
pipeline-medium  12 / 768 / 12           3072  113,265,408    137,841,408    "150M"
pipeline-large   32 / 1600 / 25          6400  1,310,824,000  1,362,024,000  "1.6B"
pipeline-xlarge  40 / 2048 / 32          8192  2,684,520,448  2,750,056,448  "7B"
===============  ======================  ====  =============  =============  ===========

The guide's figures are not what its shapes give: 12.4M, 138M, 1.36B and 2.75B (an untied LM head adds
8.2M, 24.6M, 51.2M, 65.5M; a 7B model is 4096 wide, not 2048).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from lmforge.errors import LMForgeError
from lmforge.typed import dataclass_from_dict, short_repr
from lmforge.models.base import LMForgeModel
from lmforge.models.losses import linear_cross_entropy, lm_loss_problem
from lmforge.models.mhc import (
    UNHEALTHY_GAIN,
    MHC_KERNELS,
    MHCLayer,
    MHCMetrics,
    gain_tensors,
    metrics_from_gains,
)

FLAVORS = ("gpt2", "llama")
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh"}  # name -> F.gelu(approximate=...)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "large": {"n_layer": 24, "n_embd": 2048, "n_head": 16},
    # Seed 004's model sizes (the staged code-assistant guide, `lmforge train --stage ...`): a set of their
    # own, so the GPT-2 names above keep their meaning. Each is llama-flavored with the guide's d_ff = 4 x width.
    "pipeline-tiny": {"flavor": "llama", "n_layer": 4, "n_embd": 256, "n_head": 4, "n_inner": 1024},
    "pipeline-medium": {"flavor": "llama", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": 3072},
    "pipeline-large": {"flavor": "llama", "n_layer": 32, "n_embd": 1600, "n_head": 25, "n_inner": 6400},
    "pipeline-xlarge": {"flavor": "llama", "n_layer": 40, "n_embd": 2048, "n_head": 32, "n_inner": 8192},
}


@dataclass
class GPTConfig:
    """Sizes and options of a GPT model; names follow HF ``GPT2Config``.

    ``preset`` is applied by ``resolve_dict`` (config files, CLI overrides, checkpoints) and by
    ``GPTConfig.from_preset``; the plain constructor records it but fills no sizes from it.
    """

    flavor: str = "gpt2"  # gpt2 | llama
    preset: str = ""  # "" | tiny | small | medium | large | pipeline-*: fills sizes not set explicitly
    vocab_size: int = 0  # 0 = taken from the tokenizer by the trainer; a model needs it > 0
    n_positions: int = 1024  # context length
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0  # llama only: key/value heads for grouped-query attention; 0 = n_head
    n_inner: int = 0  # MLP width; 0 = 4*n_embd (gpt2) or 8/3*n_embd rounded up to 64 (llama SwiGLU)
    activation_function: str = "gelu"  # gpt2 only: gelu (exact erf) | gelu_new (tanh approx.)
    embd_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    rope_theta: float = 10000.0  # llama only
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True  # LM head shares the token embedding (both flavors)
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    mhc_enabled: bool = False  # manifold-constrained hyper-connections (lmforge.models.mhc)
    mhc_flows: int = 4  # n: parallel residual flows
    mhc_sinkhorn_iters: int = 20  # Sinkhorn-Knopp rounds for the residual mixing matrices
    # The n-flow stream's dtype: fp32 (the plain model's residual, whatever the autocast) or autocast
    # (bf16 under bf16 autocast, the paper's choice: half the stream's memory traffic, rounded flows).
    mhc_stream_dtype: str = "fp32"
    # mHC's kernels: auto (the fastest measured: PyTorch ops, which Inductor fuses under torch.compile) | torch
    # (the same, by name) | triton (the Triton operators mhc_pre / mhc_mix_out on CUDA: slower on an H200).
    mhc_kernels: str = "auto"
    # The LM head's loss (lmforge.models.losses): auto | chunked (fused chunks, no [tokens, vocab] logits
    # kept; the CPU's best) | logits (whole 16-bit logits, padded vocabulary, the cross-entropy operator; CUDA's).
    lm_loss: str = "auto"

    @classmethod
    def from_preset(cls, preset: str, **values: Any) -> "GPTConfig":
        """The preset's sizes, with ``values`` (any field, sizes included) taking precedence: what
        ``model.preset=NAME`` gives in a config, checked the same way."""
        return dataclass_from_dict(cls, {"preset": preset, **values}, prefix="model")

    @classmethod
    def resolve_dict(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Map the RLM-mHC guide's names (``hidden_dim`` ...) to ours, then fill the preset's sizes
        into ``values`` wherever the user did not set them."""
        values = _seed_names(values)
        preset = values.get("preset") or ""
        if not preset:
            return values
        if not isinstance(preset, str) or preset not in PRESETS:
            raise LMForgeError(f"unknown model.preset {short_repr(preset)}; use one of: {', '.join(PRESETS)} "
                               "(or leave it empty)")
        fills = PRESETS[preset]
        flavor = values.get("flavor")
        if "flavor" in fills and flavor is not None and flavor != fills["flavor"]:
            # A preset that brings its flavor never silently replaces the one the config asks for.
            any_flavor = ", ".join(name for name, sizes in PRESETS.items() if "flavor" not in sizes)
            sizes = " ".join(f"model.{key}={value}" for key, value in fills.items() if key != "flavor")
            raise LMForgeError(
                f"model.preset={preset} is a {fills['flavor']}-flavor preset (RMSNorm, rotary positions, SwiGLU), "
                f"but model.flavor={short_repr(flavor)} is set; drop model.flavor (or set "
                f"model.flavor={fills['flavor']}), or "
                f"use a preset that fits either flavor ({any_flavor}), or give the sizes without a preset ({sizes})")
        return {**fills, **values}

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise LMForgeError(message)

        check(self.flavor in FLAVORS, f"unknown model.flavor {self.flavor!r}; use one of: {', '.join(FLAVORS)}")
        check(self.preset in ("", *PRESETS),
              f"unknown model.preset {self.preset!r}; use one of: {', '.join(PRESETS)} (or leave it empty)")
        check(self.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from the tokenizer), got {self.vocab_size}")
        for key in ("n_positions", "n_embd", "n_layer", "n_head"):
            check(getattr(self, key) > 0, f"model.{key} must be > 0, got {getattr(self, key)}")
        check(self.n_embd % self.n_head == 0,
              f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head}); "
              "change one of them so every head gets n_embd / n_head dimensions")
        check(self.n_kv_head >= 0, f"model.n_kv_head must be >= 0 (0 = n_head), got {self.n_kv_head}")
        if self.flavor == "gpt2":
            check(self.n_kv_head in (0, self.n_head),
                  f"model.n_kv_head={self.n_kv_head} needs model.flavor=llama (gpt2 has no grouped-query "
                  "attention); remove it or set it to 0")
        check(self.n_head % self.kv_heads == 0,
              f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.n_kv_head})")
        if self.flavor == "llama":
            check(self.head_dim % 2 == 0,
                  f"rotary embeddings need an even head size, but model.n_embd / model.n_head = {self.head_dim}")
        check(self.n_inner >= 0, f"model.n_inner must be >= 0 (0 = default width), got {self.n_inner}")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # vocab_size 0: the trainer fills it in
            check(0 <= getattr(self, key) < (self.vocab_size or 2**62),
                  f"model.{key}={getattr(self, key)} is not a token of the model's vocabulary of {self.vocab_size}")
        check(self.activation_function in ACTIVATIONS,
              f"unknown model.activation_function {self.activation_function!r}; use one of: {', '.join(ACTIVATIONS)}")
        for key in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            check(0.0 <= getattr(self, key) < 1.0, f"model.{key} must be in [0, 1), got {getattr(self, key)}")
        check(self.layer_norm_epsilon > 0, f"model.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}")
        check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        check(self.initializer_range >= 0, f"model.initializer_range must be >= 0, got {self.initializer_range}")
        check(self.mhc_flows >= 1, f"model.mhc_flows must be >= 1 (4 is the paper's setting), got {self.mhc_flows}")
        check(self.mhc_sinkhorn_iters >= 1,
              f"model.mhc_sinkhorn_iters must be >= 1 (20 is the paper's setting), got {self.mhc_sinkhorn_iters}")
        check(self.mhc_stream_dtype in ("fp32", "autocast"),
              "model.mhc_stream_dtype must be fp32 or autocast (the training precision), "
              f"got {self.mhc_stream_dtype!r}")
        check(self.mhc_kernels in MHC_KERNELS,
              f"model.mhc_kernels must be one of {', '.join(MHC_KERNELS)} (auto: PyTorch ops, the fastest measured), "
              f"got {self.mhc_kernels!r}")
        check(lm_loss_problem(self.lm_loss) is None, lm_loss_problem(self.lm_loss) or "")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def inner_size(self) -> int:
        if self.n_inner:
            return self.n_inner
        if self.flavor == "gpt2":
            return 4 * self.n_embd
        # SwiGLU has three matrices, so 2/3 of 4*n_embd keeps the MLP at ~8*n_embd^2 parameters;
        # rounding up to a multiple of 64 keeps matmuls tile-friendly.
        return -(-(8 * self.n_embd) // (3 * 64)) * 64


# The RLM-mHC guide's (seed 002) model keys and ours. Its `head_dim` is checked, not stored: here it is
# always n_embd / n_head. (Its `gradient_checkpointing` is a training switch: see lmforge.config.)
SEED_NAMES = {"hidden_dim": "n_embd", "num_layers": "n_layer", "num_heads": "n_head", "ffn_dim": "n_inner",
              "max_seq_len": "n_positions", "num_kv_heads": "n_kv_head"}


def _seed_names(values: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in values.items() if k not in SEED_NAMES and k != "head_dim"}
    for seed_key, key in SEED_NAMES.items():
        if seed_key not in values:
            continue
        if key in values and values[key] != values[seed_key]:
            raise LMForgeError(f"model.{seed_key}={values[seed_key]} and model.{key}={values[key]} are both "
                               f"given and differ (they are the same setting); keep one")
        out[key] = values[seed_key]
    head_dim = values.get("head_dim")
    if head_dim is not None:
        width, heads = out.get("n_embd"), out.get("n_head")
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise LMForgeError(f"model.head_dim must be a positive integer, got {head_dim!r}")
        if width is None or heads is None:
            raise LMForgeError("model.head_dim needs model.hidden_dim and model.num_heads beside it "
                               "(head_dim must equal hidden_dim / num_heads)")
        if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width != heads * head_dim:
            raise LMForgeError(f"model.head_dim={head_dim} but hidden_dim / num_heads = {width} / {heads}; "
                               f"set model.head_dim={width // heads if width % heads == 0 else '?'} or change "
                               "hidden_dim / num_heads so that hidden_dim = num_heads x head_dim")
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 mean-of-squares loses precision), scale in the input dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(c: GPTConfig) -> nn.Module:
    if c.flavor == "gpt2":
        return nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
    return RMSNorm(c.n_embd, c.layer_norm_epsilon)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` on the halves of ``x``'s last dimension,
    with half-width ``cos``/``sin`` (the same products and sums, so the same values in any dtype)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KVCache:
    """Keys and values of past positions for incremental decoding of one batch in lockstep.

    One preallocated ``[batch, n_kv_head, n_positions, head_dim]`` pair per layer; ``pos`` is the
    number of positions filled. Layers write at ``pos``; the model advances ``pos`` after a forward.
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.pos = 0

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """Positions of ``T`` new tokens: ``[T]``, the same for every row."""
        return torch.arange(self.pos, self.pos + T, device=device)

    def length_after(self, T: int) -> int:
        return self.pos + T

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store this block's new k/v; return k/v of all positions so far and the attention mask
        (None: plain causal)."""
        T = k.size(2)
        end = self.pos + T
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        mask = None
        if T > 1 and end > T:
            # A block of queries after cached positions: query i sees keys 0 .. pos + i.
            # (SDPA's is_causal aligns the triangle top-left, which is only right without a past.)
            mask = torch.ones(T, end, dtype=torch.bool, device=k.device).tril(diagonal=self.pos)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], mask

    def advance(self, T: int) -> None:
        self.pos += T


class PackedPrefill:
    """Several prompts prefilled in one forward: their tokens packed in one row ``[1, sum(lengths)]``,
    each attending causally to its own tokens only (``PackedDocuments``), so the weights are read once
    for all of them instead of once per prompt (a burst of short prompts, a batch of scored ones).
    After the forward, ``split`` gives each prompt its own ``KVCache`` to continue from."""

    def __init__(self, lengths: list[int], n_layer: int, device: torch.device | str):
        self.lengths = list(lengths)
        document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        self.docs = PackedDocuments.from_ids(document_ids.to(device))
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(n, device=device) for n in self.lengths])

    def length_after(self, T: int) -> int:
        return max(self.lengths)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.k[layer], self.v[layer] = k, v
        return k, v, self.docs.mask

    def advance(self, T: int) -> None:
        pass

    def split(self, max_lens: list[int]) -> list[KVCache]:
        """One single-row ``KVCache`` per prompt (room for ``max_lens[i]`` positions), holding its keys
        and values."""
        k0 = self.k[0]
        caches, start = [], 0
        for n, max_len in zip(self.lengths, max_lens):
            cache = KVCache(len(self.k), 1, k0.size(1), max_len, k0.size(3), device=k0.device, dtype=k0.dtype)
            for layer in range(len(self.k)):
                cache.k[layer][:, :, :n] = self.k[layer][:, :, start:start + n]
                cache.v[layer][:, :, :n] = self.v[layer][:, :, start:start + n]
            cache.pos = n
            caches.append(cache)
            start += n
        return caches


class BatchedKVCache:
    """A cache whose rows are independent sequences, each at its own length: continuous batching.

    Rows ``0 .. active-1`` are in use; a decode step feeds one new token for each of them at its
    own position, attending to its own past only. A sequence joins by copying its prefilled
    single-row ``KVCache`` into row ``active`` (``add_row``) and leaves by ``remove_row``, which moves
    the last row into the gap, so the rows in use stay contiguous and a step is one batched forward.
    """

    def __init__(self, n_layer: int, capacity: int, n_kv_head: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shape = (capacity, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.capacity, self.max_len, self.device = capacity, max_len, self.k[0].device
        self.lengths: list[int] = []  # per row in use: positions filled
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None = None  # rows, lengths, mask, span

    @property
    def active(self) -> int:
        return len(self.lengths)

    def add_row(self, prefilled: KVCache) -> int:
        """Copy a one-row cache's filled positions into a new row; returns the row index."""
        if self.active >= self.capacity:
            raise LMForgeError(f"the batch is full ({self.capacity} sequences)")
        row, n = self.active, prefilled.pos
        for layer in range(len(self.k)):
            self.k[layer][row, :, :n] = prefilled.k[layer][0, :, :n]
            self.v[layer][row, :, :n] = prefilled.v[layer][0, :, :n]
        self.lengths.append(n)
        return row

    def remove_row(self, row: int) -> None:
        """Free ``row``; the last row moves into its place (callers reorder their own state the same way)."""
        last = self.active - 1
        if row != last:
            n = self.lengths[last]
            for layer in range(len(self.k)):
                self.k[layer][row, :, :n] = self.k[layer][last, :, :n]
                self.v[layer][row, :, :n] = self.v[layer][last, :, :n]
            self.lengths[row] = n
        self.lengths.pop()

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """Positions of one new token per row in use: ``[active, 1]``."""
        if T != 1:
            raise LMForgeError("a BatchedKVCache decodes one token per row at a time; prefill with a KVCache")
        lengths = torch.tensor(self.lengths, device=device)
        span = max(self.lengths) + 1
        # Row r sees its own keys 0 .. lengths[r] (the new one included), none of the other rows'
        # unused tail; rows of equal length need no mask at all.
        mask = None
        if min(self.lengths) + 1 < span:
            mask = (torch.arange(span, device=device) <= lengths[:, None])[:, None, None, :]
        self._step = (torch.arange(self.active, device=device), lengths, mask, span)
        return lengths[:, None]

    def length_after(self, T: int) -> int:
        return max(self.lengths) + T

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows, lengths, mask, span = self._step
        self.k[layer][rows, :, lengths] = k[:, :, 0]
        self.v[layer][rows, :, lengths] = v[:, :, 0]
        return self.k[layer][:self.active, :, :span], self.v[layer][:self.active, :, :span], mask

    def advance(self, T: int) -> None:
        self.lengths = [n + T for n in self.lengths]
        self._step = None


@dataclass(frozen=True)
class PackedDocuments:
    """Where the documents of packed training rows begin and end, in the form attention uses.

    Each token attends causally to the tokens of its own document only, and, when the document has a
    *prefix* (another document of the same row, e.g. a prompt shared by the completions sampled from
    it), to every token of that prefix as well: the completions of one prompt are scored against one
    copy of it instead of one copy each. On CPUs the documents' lengths (row after row) are kept and
    each document gets its own SDPA call: no work on the blocks a mask would hide (measured ~40% less
    attention time than the masked call at rows of 512 holding two or three conversations each,
    ``benchmarks/RESULTS.md``). Elsewhere a ``[B, 1, T, T]`` mask goes to one SDPA call: reading the
    lengths there would make the host wait for the device every step.
    """

    lengths: list[int] | None = None
    prefixes: list[int] | None = None  # split form: each document's prefix as an index into lengths, -1 none
    mask: torch.Tensor | None = None
    # split form, for a model's last block: how many of each document's last positions need an output
    # (the others' keys and values are still used); None = all of every document
    tails: list[int] | None = None

    def with_tails(self, keep: torch.Tensor) -> PackedDocuments | None:
        """This split form with ``tails`` from ``keep`` (``[B, T]`` bool, the positions whose outputs are
        wanted), when the kept positions of every document are its last ones; else None."""
        if self.lengths is None:
            return None
        lengths = torch.tensor(self.lengths)
        ends = lengths.cumsum(0)
        flat = keep.reshape(-1).cpu()
        counts = torch.zeros(len(self.lengths), dtype=torch.long).index_add_(
            0, torch.repeat_interleave(torch.arange(len(self.lengths)), lengths), flat.long())
        tail_start = torch.repeat_interleave(ends - counts, lengths)
        if not torch.equal(flat, torch.arange(flat.numel()) >= tail_start):
            return None
        return dataclasses.replace(self, tails=counts.tolist())

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> PackedDocuments:
        """``document_ids`` ``[B, T]``: each token's document number within its row (padding has its
        own); ``prefix_ids`` ``[B, T]`` (optional): the number of the document of the same row each
        token also sees in full, ``-1`` for none. Returns the form for the device they are on."""
        if document_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            return cls.split(document_ids, prefix_ids)
        return cls.masked(document_ids, prefix_ids)

    @classmethod
    def split(cls, document_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> PackedDocuments:
        """The documents' lengths, row after row (a document never runs across a row's end), and
        each one's prefix document."""
        B, T = document_ids.shape
        starts = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        first = starts.view(-1).nonzero().view(-1)
        lengths = torch.diff(first, append=first.new_tensor([B * T])).tolist()
        if prefix_ids is None or not bool((prefix_ids >= 0).any()):
            return cls(lengths=lengths)
        rows = (first // T).tolist()
        docs = document_ids.view(-1)[first].tolist()
        index = {(row, doc): i for i, (row, doc) in enumerate(zip(rows, docs))}
        wanted = prefix_ids.view(-1)[first].tolist()
        prefixes = []
        for row, doc, prefix in zip(rows, docs, wanted):
            if prefix >= 0 and (row, prefix) not in index:
                raise ValueError(f"row {row}: document {doc} has prefix document {prefix}, which is not in the row")
            prefixes.append(index[(row, prefix)] if prefix >= 0 else -1)
        return cls(lengths=lengths, prefixes=prefixes)

    @classmethod
    def masked(cls, document_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> PackedDocuments:
        """The block-diagonal causal mask (with each document's prefix columns open), ``[B, 1, T, T]``."""
        T = document_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
        mask = (document_ids[:, :, None] == document_ids[:, None, :]) & causal
        if prefix_ids is not None:
            mask = mask | ((prefix_ids[:, :, None] >= 0) & (prefix_ids[:, :, None] == document_ids[:, None, :]))
        return cls(mask=mask[:, None])


# Attention whose shapes change from call to call runs without cuDNN's SDPA backend: PyTorch tries it first
# on Hopper and newer GPUs, and it builds a new execution plan, tens of milliseconds, for every shape it has
# not seen (pytorch/pytorch#155958; on an H200 bf16 decoding ran at ~21 tokens/s, against 290 in fp32, which
# cuDNN does not take). That is every forward with a KV cache or without gradients (generation, serving,
# scoring batches of any length; one context around all blocks, see GPT._trunk) and every layer of packed
# documents (their masks change with each batch; per layer, so that activation checkpointing recomputes
# with the same backend). Plain causal training keeps cuDNN: there it measured fastest (0.40 ms against
# flash's 0.64 at GPT-2 124M's shapes, benchmarks/gpu_micro.py). Training on batches padded to their
# longest row (HRGC, PPO) still meets a plan build once per new length.
_VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _varying_shape_attention(device_type: str):
    """The context for attention of varying shapes on ``device_type``: CUDA without cuDNN's backend."""
    return sdpa_kernel(_VARYING_SHAPE_BACKENDS) if device_type == "cuda" else contextlib.nullcontext()


def _attend_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments,
                         dropout_p: float) -> torch.Tensor:
    """Causal attention within each document of packed rows (and over its prefix document, if it has
    one): ``[B, H, T, D]`` in, ``[B, T, H * D]`` out; with ``docs.tails``, only the queries of each
    document's last ``tails[i]`` positions, ``[N, H * D]`` out (row after row). Tokens are laid out row
    after row and split by document (split's backward is one concatenation)."""
    B, H, T, D = q.shape
    q, k, v = ((t.transpose(1, 2).reshape(B * T, H, D).split(docs.lengths)) for t in (q, k, v))
    outs = []
    for i, (dq, dk, dv) in enumerate(zip(q, k, v)):
        p = docs.prefixes[i] if docs.prefixes is not None else -1
        length = dq.shape[0]
        n = length if docs.tails is None else docs.tails[i]
        if n == 0:
            continue
        if p < 0 and n == length:
            o = F.scaled_dot_product_attention(dq.transpose(0, 1)[None], dk.transpose(0, 1)[None],
                                               dv.transpose(0, 1)[None], is_causal=True, dropout_p=dropout_p)
        else:
            # The prefix's keys first (all visible), then the document's own, causally up to each query.
            m = k[p].shape[0] if p >= 0 else 0
            keys, values = (torch.cat([kv[p], own]) if p >= 0 else own for kv, own in ((k, dk), (v, dv)))
            allowed = torch.ones(n, m + length, dtype=torch.bool, device=dq.device).tril(diagonal=m + length - n)
            o = F.scaled_dot_product_attention(dq[length - n:].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                               values.transpose(0, 1)[None], attn_mask=allowed, dropout_p=dropout_p)
        outs.append(o[0].transpose(0, 1))
    if docs.tails is not None:
        return torch.cat(outs).reshape(-1, H * D) if outs else q[0].new_zeros(0, H * D)
    return torch.cat(outs).view(B, T, H * D)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.kv_heads, c.head_dim
        bias = c.flavor == "gpt2"
        # q, k and v in one matmul: rows [q heads | k heads | v heads].
        self.qkv = nn.Linear(c.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=bias)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=bias)
        self.attn_pdrop = c.attn_pdrop
        self.resid_drop = nn.Dropout(c.resid_pdrop)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | BatchedKVCache | None, layer: int,
                docs: PackedDocuments | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        if rope is not None:
            # Rotated in the projection's own layout, [B, T, heads, D]: the kernel reads and writes in the
            # same order. After the transpose to SDPA's [B, heads, T, D], a compiled kernel read rows of one
            # layout and wrote the other (the H200 profile of a 125M Llama model: 0.6 ms a layer, ~12x what
            # its bytes need).
            q, k = _rotary(q, *rope), _rotary(k, *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        mask = docs.mask if docs is not None else None
        if cache is not None:
            k, v, mask = cache.update(layer, k, v)
        if self.n_kv_head != self.n_head:
            # Query head h reads kv head h // group, the grouping HF's repeat_kv uses.
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dropout_p = self.attn_pdrop if self.training else 0.0
        # packed documents in training (with a cache, GPT._trunk has set this for all the blocks)
        varying = docs is not None and cache is None
        with _varying_shape_attention(q.device.type) if varying else contextlib.nullcontext():
            if docs is not None and docs.lengths is not None:
                y = _attend_per_document(q, k, v, docs, dropout_p)  # [N, H * D] when docs.tails picks queries
            else:
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, dropout_p=dropout_p)
                y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama); ``proj`` is the residual output projection in both."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.swiglu = c.flavor == "llama"
        width = c.inner_size
        if self.swiglu:
            self.gate_up = nn.Linear(c.n_embd, 2 * width, bias=False)  # rows [gate | up]
        else:
            self.fc = nn.Linear(c.n_embd, width)
            self.approximate = ACTIVATIONS[c.activation_function]
        self.proj = nn.Linear(width, c.n_embd, bias=not self.swiglu)
        self.drop = nn.Dropout(c.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(self.fc(x), approximate=self.approximate)
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-norm attention and MLP sub-layers, on a plain residual stream ``[B, T, C]`` or, with mHC,
    on ``n`` flows ``[B, T, n, C]`` mixed around each sub-layer (``lmforge.models.mhc``)."""

    # Methods besides forward that run the block's weights: under FSDP they gather them too.
    forward_methods = ("forward_kept",)

    def __init__(self, c: GPTConfig, index: int):
        super().__init__()
        self.norm_1 = _norm(c)
        self.attn = Attention(c)
        self.norm_2 = _norm(c)
        self.mlp = MLP(c)
        self.hc_attn = self.hc_mlp = None
        if c.mhc_enabled:
            self.hc_attn = MHCLayer(c.n_embd, c.mhc_flows, c.mhc_sinkhorn_iters, index=2 * index, kernels=c.mhc_kernels)
            self.hc_mlp = MHCLayer(c.n_embd, c.mhc_flows, c.mhc_sinkhorn_iters, index=2 * index + 1,
                                   kernels=c.mhc_kernels)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None, layer: int, docs: PackedDocuments | None = None) -> tuple[torch.Tensor, tuple]:
        """Returns the new stream and, with mHC, each sub-layer's coefficients for the first sequence."""
        if self.hc_attn is None:
            x = x + self.attn(self.norm_1(x), rope, cache, layer, docs)
            return x + self.mlp(self.norm_2(x)), ()
        x, attn_coeffs = self.hc_attn(x, lambda h: self.attn(self.norm_1(h), rope, cache, layer, docs))
        x, mlp_coeffs = self.hc_mlp(x, lambda h: self.mlp(self.norm_2(h)))
        return x, (attn_coeffs, mlp_coeffs)

    def forward_kept(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                     docs: PackedDocuments, kept: torch.Tensor) -> torch.Tensor:
        """The block's output at the flat positions ``kept`` only (``[N, C]``; ``docs.tails`` says which
        they are per document): every position's keys and values still feed attention, nothing else of
        the others is computed. Plain residual stream only (no mHC)."""
        x = x.reshape(-1, x.shape[-1]).index_select(0, kept) + self.attn(self.norm_1(x), rope, None, 0, docs)
        return x + self.mlp(self.norm_2(x))


class GPT(LMForgeModel):
    family = "gpt"
    config_class = GPTConfig
    metric_sections = ("mhc",)

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        c = config
        if c.vocab_size <= 0:
            raise LMForgeError(
                "model.vocab_size is 0, so the model cannot be built: set model.vocab_size to the "
                "tokenizer's vocabulary size (the trainer does this from data.tokenizer)")
        self.tok_embed = nn.Embedding(c.vocab_size, c.n_embd)  # registered before lm_head: see is_tied_key
        self.pos_embed = nn.Embedding(c.n_positions, c.n_embd) if c.flavor == "gpt2" else None
        self.drop = nn.Dropout(c.embd_pdrop)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.n_layer))
        self.norm_f = _norm(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self._init_weights()
        self.tie_weights()
        self._checkpointing = False
        self._mhc_gains: torch.Tensor | None = None  # from the last forward that collected them
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        # Each block adds two outputs to the residual stream; scaling their projections keeps the
        # stream's variance roughly independent of depth (GPT-2 paper, section 2.3).
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * self.config.n_layer))

    # ---- training interface -------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        # The LM head and the loss are fused (lmforge.models.losses): no [tokens, vocab] logits are kept.
        # Packed rows of several documents (SFT) carry each token's position in its own document and
        # its document's number: attention then stays inside a document, as if each were alone.
        # The Amax metrics only on the steps the loop logs (step_metrics): other steps collect nothing.
        collect = self.config.mhc_enabled and self.step_metrics
        hidden, coeffs = self._trunk(batch["input_ids"], None, collect=collect,
                                     position_ids=batch.get("position_ids"), document_ids=batch.get("document_ids"),
                                     prefix_ids=batch.get("prefix_ids"))
        loss = linear_cross_entropy(hidden, self.lm_head.weight, batch["labels"], path=self.config.lm_loss)
        if not coeffs:
            return loss, {}
        gains = gain_tensors(coeffs)
        if not torch.compiler.is_compiling():
            self._mhc_gains = gains
        # Tensors, not floats: the loop reads them only at logging steps (no device sync per step).
        return loss, {"mhc/amax_pre": gains[:-1, 0].max(), "mhc/amax_post": gains[:-1, 2].max(),
                      "mhc/amax_res": gains[:-1, 4:6].max(), "mhc/amax_composite": gains[-1, :2].max()}

    def logits(self, input_ids: torch.Tensor, kv_cache: KVCache | BatchedKVCache | None = None,
               last_only: bool = False, extra_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, vocab]`` logits (``[B, 1, vocab]`` for the last position only
        with ``last_only``, what generation needs); with ``kv_cache`` the ids continue the cached ones."""
        hidden = self.hidden_states(input_ids, kv_cache, extra_embeds)
        return self.lm_head(hidden[:, -1:] if last_only else hidden)

    def hidden_states(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None,
                      extra_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, prefix_ids: torch.Tensor | None = None,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, n_embd]`` final-norm outputs, the LM head's input.
        ``extra_embeds`` (``[B, T, n_embd]``) is added to the token embeddings: how another module
        conditions this one (HRGC's planner states at the generator's plan positions).
        ``position_ids`` / ``document_ids`` / ``prefix_ids``: packed rows, as in ``forward``'s batch.
        ``keep`` (``[B, T]`` bool): only those positions' outputs, ``[N, n_embd]`` row after row —
        what post-training reads (a reply's positions after its prompt). On CPUs, when the kept
        positions of each packed document are its last ones, the last block computes only them
        (the others' keys and values are all it needs): a 4-layer model whose prompts are 80% of
        each row does ~17% less work."""
        return self._trunk(input_ids, kv_cache, extra_embeds=extra_embeds, position_ids=position_ids,
                           document_ids=document_ids, prefix_ids=prefix_ids, keep=keep)[0]

    def _trunk(self, input_ids: torch.Tensor, kv_cache: KVCache | None, collect: bool = False,
               extra_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None, prefix_ids: torch.Tensor | None = None,
               keep: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Final-norm hidden states and (``collect``, mHC only) every sub-layer's mixing coefficients
        for the first sequence of the batch. ``position_ids`` / ``document_ids`` (``[B, T]``, training
        only): packed documents, each attending causally to itself only (and to all of its prefix
        document, ``prefix_ids``; see ``PackedDocuments``). ``keep``: see ``hidden_states``."""
        c = self.config
        T = input_ids.size(1)
        length = kv_cache.length_after(T) if kv_cache is not None else T
        # Packed rows (position_ids given) may be longer than the context: each document restarts its
        # positions, and the loaders keep every document within n_positions.
        if length > c.n_positions and position_ids is None:
            raise LMForgeError(
                f"sequence of {length} tokens is longer than model.n_positions={c.n_positions}; "
                "use a shorter data.seq_len / prompt or a model with a longer context")
        if position_ids is not None:
            positions = position_ids
        elif kv_cache is not None:
            positions = kv_cache.positions(T, input_ids.device)
        else:
            positions = torch.arange(T, device=input_ids.device)
        docs = None
        if document_ids is not None:
            if kv_cache is not None:
                raise LMForgeError("document_ids (packed training rows) cannot be combined with a KV cache")
            docs = PackedDocuments.from_ids(document_ids, prefix_ids)
        elif isinstance(kv_cache, PackedPrefill):
            docs = kv_cache.docs
        trimmed = None  # the last block's form when it computes the kept positions only
        if keep is not None and docs is not None and docs.lengths is not None and not c.mhc_enabled:
            trimmed = docs.with_tails(keep)
        x = self.tok_embed(input_ids)
        if extra_embeds is not None:
            x = x + extra_embeds.to(x.dtype)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = self._rope(positions, x.dtype)
        x = self.drop(x)
        if c.mhc_enabled:
            if c.mhc_stream_dtype == "autocast" and torch.is_autocast_enabled(x.device.type):
                x = x.to(torch.get_autocast_dtype(x.device.type))
            x = x.unsqueeze(-2).expand(*x.shape[:-1], c.mhc_flows, c.n_embd)  # n copies of the embedding
        use_checkpoint = self._checkpointing and self.training and torch.is_grad_enabled() and kv_cache is None
        coeffs: list[tuple[torch.Tensor, ...]] = []
        varying = kv_cache is not None or not torch.is_grad_enabled()  # see _VARYING_SHAPE_BACKENDS
        with _varying_shape_attention(x.device.type) if varying else contextlib.nullcontext():
            for i, block in enumerate(self.blocks):
                if trimmed is not None and i == len(self.blocks) - 1:
                    x = block.forward_kept(x, rope, trimmed, keep.reshape(-1).nonzero().view(-1))
                    break
                if use_checkpoint:
                    # The checkpoint keeps only the block's input stream (n flows wide with mHC) and
                    # recomputes everything inside, the mixing coefficients included.
                    x, block_coeffs = checkpoint(block, x, rope, None, i, docs, use_reentrant=False)
                else:
                    x, block_coeffs = block(x, rope, kv_cache, i, docs)
                if collect:
                    coeffs.extend(block_coeffs)
        if kv_cache is not None:
            kv_cache.advance(T)
        if c.mhc_enabled:
            x = x.mean(-2)  # the flows' average: at initialisation, the plain residual stream
        if keep is not None and trimmed is None:
            x = x.reshape(-1, x.shape[-1])[keep.reshape(-1)]
        return self.norm_f(x), coeffs

    def _rope_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # The cos/sin table is built once per device in fp32 and kept outside the module's buffers,
        # so model.to(bf16) cannot round it; rows are picked per call (one gather, cheap when decoding).
        table = self._rope_tables.get(device)
        if table is None:
            hd = self.config.head_dim
            inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
            freqs = torch.arange(self.config.n_positions, device=device, dtype=torch.float32)[:, None] * inv_freq
            table = self._rope_tables[device] = (freqs.cos(), freqs.sin())  # half width: see _rotary
        return table

    def before_compile(self, device: torch.device) -> None:
        if self.pos_embed is None:  # rotary positions
            self._rope_table(torch.device(device))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope_table(positions.device)
        # [T, 1, D/2], or [B, T, 1, D/2] for per-row positions (BatchedKVCache): broadcast over [B, T, heads, D/2]
        return table[0][positions].to(dtype).unsqueeze(-2), table[1][positions].to(dtype).unsqueeze(-2)

    def new_kv_cache(self, batch_size: int, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None, max_len: int | None = None) -> KVCache:
        """An empty cache for ``logits(..., kv_cache=)`` of up to ``max_len`` positions (default: the
        context); device/dtype default to the model's."""
        c = self.config
        p = self.tok_embed.weight
        return KVCache(c.n_layer, batch_size, c.kv_heads, min(max_len or c.n_positions, c.n_positions), c.head_dim,
                       device=device or p.device, dtype=dtype or p.dtype)

    def new_packed_prefill(self, lengths: list[int]) -> PackedPrefill:
        """A cache for prefilling prompts of ``lengths`` packed in one row (``PackedPrefill``)."""
        return PackedPrefill(lengths, self.config.n_layer, self.tok_embed.weight.device)

    def new_batched_kv_cache(self, capacity: int, max_len: int | None = None) -> BatchedKVCache:
        """An empty cache for up to ``capacity`` sequences decoded together (``lmforge.infer.engine``),
        each up to ``max_len`` tokens long (default and at most: the model's context)."""
        c = self.config
        p = self.tok_embed.weight
        length = min(max_len or c.n_positions, c.n_positions)
        return BatchedKVCache(c.n_layer, capacity, c.kv_heads, length, c.head_dim, device=p.device, dtype=p.dtype)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B style::

            6 * N + 12 * n_layer * n_embd * seq_len + 6 * n_embd * vocab_size

        N = parameters of the blocks and final norm (each weight: 2 FLOPs forward, 4 backward per
        token); the middle term is the attention score and value matmuls (no causal discount);
        the last is the LM head (counted once, tied or not). Embedding lookups cost nothing.
        """
        c = self.config
        n_body = sum(p.numel() for p in self.blocks.parameters()) + sum(p.numel() for p in self.norm_f.parameters())
        flops = 6.0 * n_body + 12.0 * c.n_layer * c.n_embd * seq_len + 6.0 * c.n_embd * c.vocab_size
        if c.mhc_enabled:  # per sub-layer: read the mix (n x C), H_res (n^2 x C), write back (n x C)
            n = c.mhc_flows
            flops += 2 * c.n_layer * 6.0 * (n * n + 2 * n) * c.n_embd
        return flops

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self._checkpointing = bool(enabled)

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def decays(self, name: str, param: torch.Tensor) -> bool:
        # H_res's static logits are a matrix but a bias: decaying them would pull the mixing to uniform.
        return param.dim() >= 2 and not name.endswith(".b_res")

    # ---- mHC ----------------------------------------------------------------------------
    def mhc_layers(self) -> list[MHCLayer]:
        """Every sub-layer's mHC module in order (attention, MLP, attention, ...); empty without mHC."""
        return [m for block in self.blocks for m in (block.hc_attn, block.hc_mlp) if m is not None]

    @torch.no_grad()
    def get_mhc_metrics(self, input_ids: torch.Tensor | None = None) -> MHCMetrics:
        """Amax gains of every sub-layer's mixing matrices and of their composite, averaged over the
        tokens of one sequence: of ``input_ids[0]`` when given, else of the last training or evaluation
        forward pass. ``for i, (pre, post) in enumerate(model.get_mhc_metrics())`` as in the guide."""
        if not self.config.mhc_enabled:
            raise LMForgeError("get_mhc_metrics() needs a model with model.mhc_enabled=true")
        if input_ids is not None:
            gains = gain_tensors(self._trunk(input_ids[:1], None, collect=True)[1])
        elif self._mhc_gains is not None:
            gains = self._mhc_gains
        else:
            raise LMForgeError("no forward pass has run yet: call get_mhc_metrics(input_ids) with a batch of "
                               "token ids, or after a training/evaluation step")
        kinds = [(kind, b) for b in range(self.config.n_layer) for kind in ("attn", "mlp")]
        return metrics_from_gains(gains, kinds)

    def metric_warnings(self, row: dict[str, float]) -> dict[str, str]:
        return {k: f"{k} = {v:.3f} exceeds {UNHEALTHY_GAIN}: the residual mixing amplifies the signal; watch for "
                   "loss spikes (lower training.lr, or raise model.mhc_sinkhorn_iters)"
                for k, v in row.items() if k.startswith("mhc/amax") and v > UNHEALTHY_GAIN}

    # ---- tied weights -------------------------------------------------------------------
    def is_tied_key(self, key: str) -> bool:
        return self.config.tie_word_embeddings and key == "lm_head.weight"

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.tok_embed.weight


# The RLM-mHC guide's (seed 002) class name: `RLMModel.from_pretrained(dir)` / `save_pretrained(dir)`.
# An RLM-mHC model is a llama-flavor GPT with model.mhc_enabled=true.
RLMModel = GPT
