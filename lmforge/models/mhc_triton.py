"""Triton kernels of ``torch.ops.lmforge.sinkhorn`` (``lmforge.models.mhc``) for CUDA.

One program normalises ``BLOCK`` tokens; each token's n x n log-matrix stays in registers through
all the rounds, so the forward reads the logits once and writes the matrix once. The backward
recomputes the rounds from the logits, parks each round's normalisers (``2 n`` floats per round and
token) in a scratch buffer that lives for that one call, and runs back through the rounds with the
same formulas as the vectorised implementation. Importing this module needs Triton; where it is
missing ``lmforge.models.mhc`` uses the vectorised implementation. ``TRITON_INTERPRET=1`` runs the
kernels on CPU tensors (how the tests check them without a GPU).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 64  # tokens per program: 64 x 16 fp32 values of y, g and p fit in registers at n = 4


def supports(logits: torch.Tensor) -> bool:
    """n a power of two (Triton's block shapes) and at most fp32 (gradcheck's fp64 takes the vectorised path)."""
    n = logits.shape[-1]
    return n & (n - 1) == 0 and logits.dtype != torch.float64


@triton.jit
def _lse_shift(y, axis: tl.constexpr):
    # logsumexp along axis, kept as a broadcastable normaliser.
    m = tl.max(y, axis=axis)
    m = tl.expand_dims(m, axis)
    return m + tl.expand_dims(tl.log(tl.sum(tl.exp(y - m), axis=axis)), axis)


@triton.jit
def _load_logits(x_ptr, tokens, N: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, N)
    offs = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (t < tokens)[:, None, None]
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask, t


@triton.jit
def _forward_kernel(x_ptr, p_ptr, tokens, ITERS: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr):
    y, offs, mask, t = _load_logits(x_ptr, tokens, N, BLOCK_T)
    for _ in range(ITERS):
        y = y - _lse_shift(y, 1)  # columns
        y = y - _lse_shift(y, 2)  # rows
    tl.store(p_ptr + offs, tl.exp(y), mask=mask)


@triton.jit
def _backward_kernel(g_ptr, x_ptr, out_ptr, norms_ptr, tokens, ITERS: tl.constexpr, N: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    y, offs, mask, t = _load_logits(x_ptr, tokens, N, BLOCK_T)
    i = tl.arange(0, N)
    # norms[t, k, 0, :] = round k's column normaliser, norms[t, k, 1, :] its row normaliser
    norm_offs = t[:, None] * (ITERS * 2 * N) + i[None, :]
    norm_mask = (t < tokens)[:, None]
    for k in range(ITERS):
        c = _lse_shift(y, 1)
        y = y - c
        r = _lse_shift(y, 2)
        y = y - r
        tl.store(norms_ptr + norm_offs + (2 * k) * N, tl.sum(c, axis=1), mask=norm_mask)
        tl.store(norms_ptr + norm_offs + (2 * k + 1) * N, tl.sum(r, axis=2), mask=norm_mask)
    p = tl.exp(y)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * p
    for j in range(ITERS):
        k = ITERS - 1 - j
        g = g - p * tl.expand_dims(tl.sum(g, axis=2), 2)  # through the row step
        r = tl.load(norms_ptr + norm_offs + (2 * k + 1) * N, mask=norm_mask, other=0.0)
        p = p * tl.expand_dims(tl.exp(r), 2)
        g = g - p * tl.expand_dims(tl.sum(g, axis=1), 1)  # through the column step
        c = tl.load(norms_ptr + norm_offs + (2 * k) * N, mask=norm_mask, other=0.0)
        # round 0's column normaliser may be huge (raw logits): p is not needed after it
        p = p * tl.expand_dims(tl.exp(tl.where(k > 0, c, 0.0)), 1)
    tl.store(out_ptr + offs, g, mask=mask)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' (cuda:1 from a process on cuda:0).
    Under ``TRITON_INTERPRET=1`` the tensors are on the CPU and nothing changes."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sinkhorn_forward(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """fp32 (or fp16/bf16) ``[..., n, n]`` logits -> fp32 doubly stochastic matrices."""
    x = logits.contiguous()
    tokens = x.numel() // (x.shape[-1] ** 2)
    p = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    with _on(x.device):
        _forward_kernel[(triton.cdiv(tokens, BLOCK),)](x, p, tokens, ITERS=iters, N=x.shape[-1], BLOCK_T=BLOCK)
    return p


def sinkhorn_backward(grad: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Gradient with respect to the logits (their dtype) of ``sum(grad * sinkhorn_forward(logits))``."""
    x, g = logits.contiguous(), grad.contiguous()
    n = x.shape[-1]
    tokens = x.numel() // (n * n)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    norms = torch.empty(tokens, iters, 2, n, dtype=torch.float32, device=x.device)
    with _on(x.device):
        _backward_kernel[(triton.cdiv(tokens, BLOCK),)](g, x, out, norms, tokens, ITERS=iters, N=n, BLOCK_T=BLOCK)
    return out.to(logits.dtype)
