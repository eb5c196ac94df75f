"""Triton kernels of ``torch.ops.lmforge.cross_entropy_rows`` (``lmforge.models.losses``) for CUDA.

The cross-entropy of one ``[tokens, padded vocab]`` block of 16-bit logits, row by row: one program per
token. The forward reads the row once (an online log-sum-exp: a running maximum and a running sum of
exponentials) and writes two floats, the token's loss and its
log-sum-exp. The backward reads the row once more and writes its gradient, ``softmax - one_hot`` times the
token's incoming gradient, in the logits' dtype, with zeros in the padded columns. So the loss costs three
passes over the logits (the least without computing the gradient during the forward), and no fp32 copy of
them exists. On an H200 the compiled ``F.cross_entropy`` on the same logits took ~4 ms of a GPT-2 124M step
(``benchmarks/RESULTS.md``); the three passes over 16,384 x 50,304 bf16 values are ~5 GB, ~1.2 ms at that
GPU's memory bandwidth. Importing this module needs Triton; ``TRITON_INTERPRET=1`` runs the kernels on CPU
tensors (how the tests check them without a GPU).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

IGNORE_INDEX = -100
BLOCK_V = 4096  # vocabulary columns a program reads per iteration (8 KB of bf16)


def supports(logits: torch.Tensor) -> bool:
    """2-D logits of at most 32-bit floats (fp64, gradcheck's, takes the PyTorch implementation)."""
    return logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_row_block(base, c, vocab, padded):
    # The memory mask is on the padded width (a multiple of 128), so the loads are vectorised; a mask at the
    # vocabulary's own width (50257 for GPT-2) would make every load a 2-byte one. The padded columns are
    # set to -inf in registers: they take no probability.
    x = tl.load(base + c, mask=c < padded, other=0.0).to(tl.float32)
    return tl.where(c < vocab, x, float("-inf"))


@triton.jit
def _forward_kernel(x_ptr, labels_ptr, loss_ptr, lse_ptr, vocab, padded, row_stride, IGNORE: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    # A running maximum and sum of exp(x - maximum): one exponential per logit. While every logit seen is
    # -inf the maximum is too, and the shift uses 0 instead (exp(-inf - -inf) would be NaN).
    m = float("-inf")
    s = 0.0
    for start in range(0, padded, BLOCK):
        x = _load_row_block(base, start + cols, vocab, padded)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    in_range = (label >= 0) & (label < vocab)
    picked = tl.load(base + tl.where(in_range, label, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    # a label outside the vocabulary (other than IGNORE) gives NaN, which the training loop stops on
    tl.store(loss_ptr + row, tl.where(in_range, lse - picked, tl.where(label == IGNORE, 0.0, float("nan"))))


@triton.jit
def _backward_kernel(grad_ptr, x_ptr, labels_ptr, lse_ptr, out_ptr, vocab, padded, row_stride, out_stride,
                     IGNORE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    in_range = (label >= 0) & (label < vocab)
    g = tl.load(grad_ptr + row).to(tl.float32)
    g = tl.where(label == IGNORE, 0.0, tl.where(in_range, g, float("nan")))
    lse = tl.load(lse_ptr + row)
    base, out = x_ptr + row * row_stride, out_ptr + row * out_stride
    cols = tl.arange(0, BLOCK)
    for start in range(0, padded, BLOCK):
        c = start + cols
        x = _load_row_block(base, c, vocab, padded)
        d = (tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)) * g  # 0 in the padded columns
        tl.store(out + c, d.to(out_ptr.dtype.element_ty), mask=c < padded)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' (cuda:1 from a process on cuda:0).
    Under ``TRITON_INTERPRET=1`` the tensors are on the CPU and nothing changes."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, padded]`` logits (columns from ``vocab`` on ignored), ``[N]`` labels -> per-token loss and
    log-sum-exp, both fp32 ``[N]`` (loss 0 where the label is ``-100``)."""
    x, y = _rows_contiguous(logits), labels.contiguous()
    n = x.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        with _on(x.device):
            _forward_kernel[(n,)](x, y, loss, lse, vocab, x.shape[1], x.stride(0), IGNORE=IGNORE_INDEX, BLOCK=BLOCK_V,
                                  num_warps=8)
    return loss, lse


def cross_entropy_rows_backward(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                vocab: int) -> torch.Tensor:
    """Gradient of ``sum(grad * loss)`` with respect to the ``[N, padded]`` logits, in their dtype."""
    x, y, g = _rows_contiguous(logits), labels.contiguous(), grad.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        with _on(x.device):
            _backward_kernel[(x.shape[0],)](g, x, y, lse.contiguous(), out, vocab, x.shape[1], x.stride(0),
                                            out.stride(0), IGNORE=IGNORE_INDEX, BLOCK=BLOCK_V, num_warps=8)
    return out
