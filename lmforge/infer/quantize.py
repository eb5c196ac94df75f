"""int8 weight-only inference on CPUs (``--quantize int8``): ``quantize_int8(model, dtype)``.

Decoding one sequence reads every weight once per token, so it is bound by memory traffic: int8
weights are half of bf16's bytes and a quarter of fp32's. Every ``nn.Linear`` of the blocks and the LM
head get a symmetric per-output-channel int8 copy of their weight: ``w[n, k] ~ q[n, k] * scale[n]``
with ``|q| <= 127`` and ``scale[n]`` the row's largest magnitude / 127, rounded *up* to bf16 before
``q`` is rounded against it, so the bf16 scale the kernel takes is the scale the weights were
quantized with (nothing is rounded twice). The token embedding is quantized per row the same way:
a tied model (GPT-2's layout) keeps one int8 table that both the lookup and the head read, at half of
a bf16 embedding's memory. Everything else (norms, biases, position embeddings, attention, the KV
cache) stays in ``dtype``, the activations' precision (bf16 or fp32).

The matmul (``Int8Linear``): PyTorch's CPU ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations,
int8 weights, bf16 scales), the fastest of the candidates at one sequence's decode shapes of GPT-2
124M on an AVX512-BF16 CPU (benchmarks/RESULTS.md): ~2.2x bf16 ``F.linear`` over the model's 49
matrices, the same as torchao's ``Int8WeightOnlyConfig`` under ``torch.compile`` (whose eager form is
slower than bf16) without a compile step or a dependency. The op is private and its x86 kernels use
aligned 32-byte loads in steps of 16 along K with no tail: an input row that is not 32-byte aligned
crashes the process and a K that is not a multiple of 16 reads past the row. ``kernel_fits`` guards
it (bf16 contiguous input, K % 16 == 0, 64-byte aligned data, at most ``KERNEL_ROWS`` rows); anything
else takes ``F.linear`` over the dequantized weight in the activations' dtype, exact and slower. Its
fp32 form is scalar code, so fp32 activations are rounded to bf16 for the kernel only (the error that
adds is below the int8 weights' own). The kernel re-reads the weights for every 4 input rows, so above
``KERNEL_ROWS`` rows (prefills, large decode batches) a dequantized matmul is faster: tile by tile
(``dequantized_linear``), ``TILE_BYTES`` of dequantized weight at a time, so each tile is used while
it is still in cache and the weights cross memory once, as int8. Dequantizing the whole matrix first
(the first fallback) wrote and re-read the full-precision weights every step and made batch 32 slower
than plain bf16 / fp32; tiled, it is faster than both (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import LMForgeError

QUANTIZE = ("none", "int8")
KERNEL_ROWS = 8  # input rows (tokens x sequences) up to which the kernel is used: the measured crossover
TILE_BYTES = 2 << 20  # dequantized weight per tile of the fallback: a few tiles fit the cache (measured 2-4 MB)
KERNEL_K = 16  # the kernel's step along K (AVX512: 16 bf16 per 32-byte load; AVX2: 8)
ALIGN = 64  # bytes; the kernel's loads need 32 (AVX512) or 16 (AVX2); PyTorch's CPU allocator gives 64
_KERNEL = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q [N, K] int8, scale [N] bf16)`` with ``weight ~ q * scale[:, None]``.
    The scale is rounded up to bf16 first and ``q`` rounded against it, so ``|q| <= 127`` and the
    error is at most half a step of the bf16 scale actually used."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    rounded = scale.to(torch.bfloat16)
    up = rounded.float() < scale  # round to nearest may go down: take the next bf16 value up
    rounded = torch.where(up, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)
    q = torch.round(w / rounded.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), rounded


def kernel_fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``_weight_int8pack_mm`` can take ``x`` (``[M, K]``, bf16) and ``qweight`` (``[N, K]``)
    safely and faster than the dequantized matmul (see the module docstring)."""
    return (_KERNEL is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
            and 0 < x.shape[0] <= KERNEL_ROWS and x.shape[1] % KERNEL_K == 0 and x.is_contiguous()
            and qweight.is_contiguous() and x.data_ptr() % ALIGN == 0 and qweight.data_ptr() % ALIGN == 0)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, q * scale[:, None], bias)`` for ``x`` of any leading shape, in ``x``'s dtype."""
    shape, K = x.shape, x.shape[-1]
    flat = x.reshape(-1, K)
    y = None
    if flat.shape[0] <= KERNEL_ROWS and K % KERNEL_K == 0:
        rows = flat if flat.dtype == torch.bfloat16 else flat.to(torch.bfloat16)
        if rows.data_ptr() % ALIGN and rows.is_contiguous():
            rows = rows.clone()  # a view that starts mid-allocation: an aligned copy (a few KB)
        if kernel_fits(rows, qweight):
            y = _KERNEL(rows, qweight, scale if scale.dtype == torch.bfloat16 else scale.to(torch.bfloat16))
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
    if y is None:
        y = dequantized_linear(flat, qweight, scale)
    if bias is not None:
        y += bias  # y is this call's own
    return y.view(*shape[:-1], qweight.shape[0])


def dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T`` for ``x`` ``[M, K]``, in ``x``'s dtype, a tile of output channels
    at a time (``q`` -> dtype is exact: ``|q| <= 127``); the result is ``[M, N]`` and contiguous."""
    N, K = qweight.shape
    dtype = x.dtype
    rows = max(1, TILE_BYTES // (K * x.element_size()))
    if rows >= N:
        return F.linear(x, qweight.to(dtype)) * scale.to(dtype)
    out = torch.empty(N, x.shape[0], dtype=dtype, device=x.device)  # transposed: each tile's rows contiguous
    xt = x.t()
    for start in range(0, N, rows):
        torch.mm(qweight[start:start + rows].to(dtype), xt, out=out[start:start + rows])
    return out.mul_(scale.to(dtype)[:, None]).t().contiguous()


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is int8 with one scale per output channel (``int8_linear``)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # kernel_fits's checks of the weight, which stay true (int8 tensors keep their dtype under .to()):
        self._k_fits = (_KERNEL is not None and qweight.device.type == "cpu" and self.in_features % KERNEL_K == 0
                        and qweight.is_contiguous() and qweight.data_ptr() % ALIGN == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decoding's case first, with the row checks of kernel_fits in line (a buffer is a slow attribute
        # of a module, so each is read once): microseconds per call are a few percent of a 124M step.
        qweight, scale, bias = self.qweight, self.scale, self.bias
        if (self._k_fits and x.dtype == torch.bfloat16 and scale.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.is_contiguous() and x.data_ptr() % ALIGN == 0 and 0 < x.numel() <= KERNEL_ROWS * self.in_features):
            y = _KERNEL(x.view(-1, self.in_features), qweight, scale)
            if bias is not None:
                y += bias
            return y.view(*x.shape[:-1], self.out_features)
        return int8_linear(x, qweight, scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int8Embedding(nn.Module):
    """A token embedding stored as int8 rows with one scale each; the lookup returns ``dtype``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """An empty tensor with the lookup's dtype and device, for code that reads an embedding's weight
        for them (``GPT.new_kv_cache`` makes its cache in that dtype); the table is ``qweight`` and
        ``scale``, so code that would read the weight's values gets an error instead of a wrong answer."""
        return torch.empty(0, dtype=self.dtype, device=self.qweight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qweight).to(self.dtype) * self.scale[ids].to(self.dtype).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 -> {str(self.dtype).replace('torch.', '')}"


def check_quantize(quantize: str, device: str, precision: str) -> str:
    """The errors of ``--quantize`` that need no model (an unknown value, a device or a precision it
    cannot run with); returns the device to load on: with int8, ``auto`` is the CPU."""
    if quantize not in QUANTIZE:
        raise LMForgeError(f"unknown --quantize {quantize!r}; use one of: {', '.join(QUANTIZE)}")
    if quantize == "none":
        return device
    try:
        kind = "cpu" if device == "auto" else torch.device(device).type
    except RuntimeError:
        return device  # not a device: pick_device says so
    if kind != "cpu":
        raise LMForgeError(f"--quantize {quantize} runs on CPUs only (its kernel is PyTorch's CPU int8 matmul), but "
                           f"--device is {device}; use --device cpu, or drop --quantize and use --precision bf16 "
                           "(or fp16) on this device")
    if precision == "fp16":
        raise LMForgeError(f"--quantize {quantize} computes in bf16 or fp32 on CPUs, not fp16: use --precision auto, "
                           "bf16 or fp32 with it")
    return "cpu"


def quantize_int8(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Quantize a gpt-family model for inference on the CPU, in place (see the module docstring);
    returns it in eval mode. ``dtype``: the activations' precision, bf16 or fp32 (default: that of
    the model's weights now). Quantize from the fp32 weights a checkpoint holds: converting them to
    bf16 first would round them twice. The result generates (KV caches, ``BatchedKVCache``, ``logits``,
    ``hidden_states``) but does not train and is not saved."""
    from lmforge.models.gpt import GPT

    if not isinstance(model, GPT):
        family = getattr(model, "family", type(model).__name__)
        raise LMForgeError(f"--quantize int8 is for gpt-family models (text generators); this is a {family!r} model")
    if getattr(model, "quantization", None):
        raise LMForgeError(f"this model is already quantized ({model.quantization})")
    device = model.tok_embed.weight.device
    if device.type != "cpu":
        raise LMForgeError(f"int8 quantization runs on CPUs only; the model is on {device}")
    dtype = dtype or model.tok_embed.weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise LMForgeError(f"int8 quantization computes in bf16 or fp32, not {dtype}")
    model.eval().requires_grad_(False)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # one int8 table per weight tensor: tied ones share

    def table(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(weight)
        if key not in tables:
            tables[key] = quantize_rows(weight)
        return tables[key]

    targets = [(name, m) for name, m in model.blocks.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        setattr(model.blocks.get_submodule(parent), attr, Int8Linear(*table(linear.weight), bias))
    head, embed = model.lm_head.weight, model.tok_embed.weight
    model.lm_head = Int8Linear(*table(head), None)
    model.tok_embed = Int8Embedding(*table(embed), dtype)
    del head, embed, tables
    for module in model.modules():  # what is left (norms, biases, position embeddings): the activations' dtype
        if not isinstance(module, (Int8Linear, Int8Embedding)):  # (their biases were made in dtype)
            for p in module.parameters(recurse=False):
                p.data = p.data.to(dtype)
    model.quantization = "int8"
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, shared tensors counted once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
