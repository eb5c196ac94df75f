"""Triton kernels of mHC (``lmforge.models.mhc``) for CUDA: the Sinkhorn projection and the stream's mixing.

**Sinkhorn** (``torch.ops.lmforge.sinkhorn``). One program normalises ``BLOCK`` tokens; each token's n x n
log-matrix stays in registers through all the rounds, so the forward reads the logits once and writes the
matrix once. The backward recomputes the rounds from the logits, parks each round's normalisers (``2 n``
floats per round and token) in a scratch buffer that lives for that one call, and runs back through the
rounds with the same formulas as the vectorised implementation.

**A sub-layer's mHC work** (``torch.ops.lmforge.mhc_pre`` / ``mhc_mix_out`` and their backwards). The n-flow
stream ``[tokens, n, C]`` is read in tiles of tokens x flows x channels, in its own dtype, and mixed in fp32
registers with the fp32 coefficients; the small products over the channels (the dynamic coefficients'
projection, the coefficients' gradients) run on tensor cores with ``tl.dot``. Counting passes over the stream
(S: 201 MB at ``rlm_mhc_125m``'s 32 x 1024 tokens, bf16): forward, the projection with the stream's RMS (S),
``H_pre x`` (S), ``H_res x + H_post^T y`` (2 S: read and write); backward, ``mix_out``'s (3 S: its gradient and
the stream read, the stream's gradient written, with ``H_res``'s, ``H_post``'s and ``y``'s), ``H_pre``'s
gradient (S), and the stream's gradient through ``H_pre x`` and the projection plus ``mix_out``'s, with phi's
(3 S: the stream and ``mix_out``'s gradient read, the sum written; autograd would have added the two gradients
in a pass of 3 S more). 11 S per sub-layer, ~53 GB per 125M step, ~11 ms at an H200's 4.8 TB/s; Inductor's
fusion of the PyTorch ops took ~31 ms of elementwise work on top of the plain model's
(``benchmarks/RESULTS.md``), not counting the projection's narrow matmuls.

Importing this module needs Triton; where it is missing ``lmforge.models.mhc`` uses the PyTorch
implementations. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (how the tests check them without a
GPU).
"""

from __future__ import annotations

import contextlib
import os

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


# The mixing kernels. A tile is [BLOCK_T tokens, n flows, BLOCK_C channels]; the stream's flows and tokens
# may have any strides (the first layer's stream is one embedding expanded n times: flow stride 0), its
# channels stride 1. BLOCK_C = 128 bf16 channels is 256 bytes per flow row: 16-byte loads.
# Register use compiled for sm_90 (ptxas -v, 4 warps, n = 4, bf16): 48 / 64 / 85 / 96 a thread for mix_in, H_pre's
# gradient, mix_out and mix_out's backward, no spills; mix_out's backward takes 16 // n tokens, the rows tl.dot
# needs.
MIX_BLOCK_T, MIX_BLOCK_C = 8, 128


MAX_FLOWS = 8  # the projection's and its backward's tiles hold all n*n + 2n rows: 16 flows need ~300 KB of
MAX_FLOWS_BEFORE_AMPERE = 4  # shared memory on sm_90 (227 KB there), 8 flows ~80 KB on sm_75 (64 KB there)


def mix_supported(stream: torch.Tensor) -> bool:
    """n a power of two (Triton's block shapes) of at most MAX_FLOWS, channels contiguous, at most fp32 (fp64:
    PyTorch); before Ampere (compute capability 8), fp16 or fp32 (tl.dot takes no bf16 there) and at most
    MAX_FLOWS_BEFORE_AMPERE flows (less shared memory)."""
    n = stream.shape[-2]
    most = MAX_FLOWS
    if stream.is_cuda and torch.cuda.get_device_capability(stream.device)[0] < 8:
        if stream.dtype == torch.bfloat16:
            return False
        most = MAX_FLOWS_BEFORE_AMPERE
    return (n & (n - 1) == 0 and n <= most and stream.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and stream.stride(-1) == 1 and _token_stride(stream) is not None)


def _token_stride(stream: torch.Tensor) -> int | None:
    """The one stride that steps through every token of ``[..., n, C]`` (the leading dims flattened), or None
    when the leading dims do not flatten to one strided dim."""
    lead = stream.shape[:-2]
    if len(lead) == 0:
        return 0
    stride = None
    for size, step in zip(reversed(lead), reversed(stream.stride()[:-2])):
        if size == 1:
            continue
        if stride is None:
            stride, expected = step, step * size
        elif step != expected:
            return None
        else:
            expected = step * size
    return stride if stride is not None else 0


@triton.jit
def _stream_tile(x_ptr, t, c, tokens, C, stride_t, stride_f, N: tl.constexpr):
    f = tl.arange(0, N)
    offs = t.to(tl.int64)[:, None, None] * stride_t + f[None, :, None] * stride_f + c[None, None, :]
    mask = ((t < tokens)[:, None] & (c < C)[None, :])[:, None, :]
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _vector(h_ptr, t, tokens, N: tl.constexpr):
    f = tl.arange(0, N)
    return tl.load(h_ptr + t.to(tl.int64)[:, None] * N + f[None, :], mask=(t < tokens)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _mix_in_kernel(h_ptr, x_ptr, out_ptr, tokens, C, stride_t, stride_f, N: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    x = _stream_tile(x_ptr, t, c, tokens, C, stride_t, stride_f, N)
    out = tl.sum(_vector(h_ptr, t, tokens, N)[:, :, None] * x, axis=1)
    mask = (t < tokens)[:, None] & (c < C)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_in_grad_h_kernel(g_ptr, x_ptr, dh_ptr, tokens, C, stride_t, stride_f, N: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    # d h_pre[t, j] = sum_c g[t, c] * stream[t, j, c] (the stream's own gradient through H_pre x is written by
    # _pre_backward_kernel, with the coefficients' part, in one pass)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    f = tl.arange(0, N)
    dh = tl.zeros([BLOCK_T, N], dtype=tl.float32)
    rows = t.to(tl.int64)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = (t < tokens)[:, None] & (c < C)[None, :]
        g = tl.load(g_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _stream_tile(x_ptr, t, c, tokens, C, stride_t, stride_f, N)
        dh += tl.sum(x * g[:, None, :], axis=2)
    tl.store(dh_ptr + rows[:, None] * N + f[None, :], dh, mask=(t < tokens)[:, None])


@triton.jit
def _mix_out_kernel(h_res_ptr, x_ptr, h_post_ptr, y_ptr, out_ptr, tokens, C, stride_t, stride_f, N: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[t, i, c] = sum_j h_res[t, i, j] * stream[t, j, c] + h_post[t, i] * y[t, c]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    f = tl.arange(0, N)
    rows = t.to(tl.int64)
    mask = (t < tokens)[:, None] & (c < C)[None, :]
    y = tl.load(y_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
    out = _vector(h_post_ptr, t, tokens, N)[:, :, None] * y[:, None, :]
    for j in tl.static_range(N):  # column j of H_res times flow j
        x_j = tl.load(x_ptr + rows[:, None] * stride_t + j * stride_f + c[None, :], mask=mask, other=0.0)
        h_col = tl.load(h_res_ptr + rows[:, None] * (N * N) + f[None, :] * N + j, mask=(t < tokens)[:, None],
                        other=0.0).to(tl.float32)
        out += h_col[:, :, None] * x_j.to(tl.float32)[:, None, :]
    out_offs = rows[:, None, None] * (N * C) + f[None, :, None] * C + c[None, None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask[:, None, :])


@triton.jit
def _mix_out_backward_kernel(g_ptr, h_res_ptr, x_ptr, h_post_ptr, y_ptr, dh_res_ptr, dx_ptr, dh_post_ptr, dy_ptr,
                             tokens, C, stride_t, stride_f, N: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr, EXACT_DOT: tl.constexpr):
    # with g = d out:  d stream[t, j, c] = sum_i h_res[t, i, j] g[t, i, c];  d y[t, c] = sum_i h_post[t, i] g[t, i, c]
    #                  d h_res[t, i, j] = sum_c g[t, i, c] stream[t, j, c];  d h_post[t, i] = sum_c g[t, i, c] y[t, c]
    # d h_res is a tensor-core product of the tile's (token, flow) rows: [BLOCK_T * N, C] x [C, BLOCK_T * N], of
    # which the N x N blocks on the diagonal are wanted (the rest pairs different tokens and is dropped). It
    # accumulates in 16 registers per thread where per-token sums took ~60. EXACT_DOT (see _exact_dot): the
    # product in fp32 FMAs, else on tensor cores in the stream's 16-bit dtype, accumulating in fp32.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    f = tl.arange(0, N)
    rows = t.to(tl.int64)
    live = (t < tokens)[:, None]
    r = tl.arange(0, BLOCK_T * N)  # the tile's (token, flow) rows
    r_token = tl.program_id(0) * BLOCK_T + r // N
    r_live = (r_token < tokens)[:, None]
    h_post = _vector(h_post_ptr, t, tokens, N)
    dh_res = tl.zeros([BLOCK_T * N, BLOCK_T * N], dtype=tl.float32)
    dh_post = tl.zeros([BLOCK_T, N], dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = live & (c < C)[None, :]
        y = tl.load(y_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g_offs = rows[:, None, None] * (N * C) + f[None, :, None] * C + c[None, None, :]
        g = tl.load(g_ptr + g_offs, mask=mask[:, None, :], other=0.0)
        x_offs = rows[:, None, None] * stride_t + f[None, :, None] * stride_f + c[None, None, :]
        x_rows = tl.reshape(tl.load(x_ptr + x_offs, mask=mask[:, None, :], other=0.0), [BLOCK_T * N, BLOCK_C])
        g_rows = tl.reshape(g, [BLOCK_T * N, BLOCK_C])
        if EXACT_DOT:
            dh_res = tl.dot(g_rows.to(tl.float32), tl.trans(x_rows.to(tl.float32)), dh_res, input_precision="ieee")
        else:
            dh_res = tl.dot(g_rows.to(x_rows.dtype), tl.trans(x_rows), dh_res)
        g = g.to(tl.float32)
        dy = tl.sum(h_post[:, :, None] * g, axis=1)
        tl.store(dy_ptr + rows[:, None] * C + c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask)
        dh_post += tl.sum(g * y[:, None, :], axis=2)
        for j in tl.static_range(N):  # column j of H_res: flow j of the stream's gradient
            h_col = tl.load(h_res_ptr + rows[:, None] * (N * N) + f[None, :] * N + j, mask=live,
                            other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows[:, None] * (N * C) + j * C + c[None, :],
                     tl.sum(h_col[:, :, None] * g, axis=1).to(dx_ptr.dtype.element_ty), mask=mask)
    s = tl.arange(0, BLOCK_T * N)
    same_token = (r // N)[:, None] == (s // N)[None, :]
    dh_offs = r_token.to(tl.int64)[:, None] * (N * N) + (r % N)[:, None] * N + (s % N)[None, :]
    tl.store(dh_res_ptr + dh_offs, dh_res.to(dh_res_ptr.dtype.element_ty), mask=same_token & r_live)
    tl.store(dh_post_ptr + rows[:, None] * N + f[None, :], dh_post.to(dh_post_ptr.dtype.element_ty), mask=live)


def _exact_dot(stream: torch.Tensor) -> bool:
    """The kernels' products over the channels in fp32 FMAs rather than on tensor cores: for an fp32 stream (tensor
    cores would round it to tf32), and for a bf16 one under Triton's interpreter, whose bf16 tl.dot returns garbage
    (3.9; an fp16 stream takes the tensor-core code there, which is how the tests run it)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return stream.dtype == torch.float32 or (interpreting and stream.dtype == torch.bfloat16)


def _geometry(stream: torch.Tensor) -> tuple[int, int, int, int, int]:
    n, width = stream.shape[-2:]
    return stream.numel() // (n * width) if stream.numel() else 0, n, width, _token_stride(stream), stream.stride(-2)


def mix_in(h_pre: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` coefficients, ``[..., n, C]`` stream -> ``[..., C]`` in the stream's dtype."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    out = torch.empty(stream.shape[:-2] + (width,), dtype=stream.dtype, device=stream.device)
    if tokens:
        grid = (triton.cdiv(tokens, MIX_BLOCK_T), triton.cdiv(width, MIX_BLOCK_C))
        with _on(stream.device):
            _mix_in_kernel[grid](h_pre.contiguous(), stream, out, tokens, width, stride_t, stride_f, N=n,
                                 BLOCK_T=MIX_BLOCK_T, BLOCK_C=MIX_BLOCK_C)
    return out


def mix_in_grad_h(grad: torch.Tensor, h_pre: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """``H_pre``'s gradient (fp32) through ``H_pre x``, given that of ``H_pre x``: one read of the stream."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    d_h = torch.empty(h_pre.shape, dtype=torch.float32, device=h_pre.device)
    if tokens:
        with _on(stream.device):
            _mix_in_grad_h_kernel[(triton.cdiv(tokens, MIX_BLOCK_T),)](
                grad.contiguous(), stream, d_h, tokens, width, stride_t, stride_f, N=n, BLOCK_T=MIX_BLOCK_T,
                BLOCK_C=MIX_BLOCK_C)
    return d_h


def mix_out(h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``H_res x + H_post^T y`` -> ``[..., n, C]`` in the stream's dtype (contiguous)."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    out = torch.empty(stream.shape, dtype=stream.dtype, device=stream.device)
    if tokens:
        grid = (triton.cdiv(tokens, MIX_BLOCK_T), triton.cdiv(width, MIX_BLOCK_C))
        with _on(stream.device):
            _mix_out_kernel[grid](h_res.contiguous(), stream, h_post.contiguous(), y.contiguous(), out, tokens, width,
                                  stride_t, stride_f, N=n, BLOCK_T=MIX_BLOCK_T, BLOCK_C=MIX_BLOCK_C)
    return out


def mix_out_backward(grad: torch.Tensor, h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor,
                     y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``mix_out`` for ``h_res``, the stream, ``h_post`` and ``y``, each in its input's dtype."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    block_t = max(1, 16 // n)  # tl.dot takes 16 rows at least
    d_h_res = torch.empty(h_res.shape, dtype=h_res.dtype, device=h_res.device)
    d_x = torch.empty(stream.shape, dtype=stream.dtype, device=stream.device)
    d_h_post = torch.empty(h_post.shape, dtype=h_post.dtype, device=h_post.device)
    d_y = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if tokens:
        with _on(stream.device):
            _mix_out_backward_kernel[(triton.cdiv(tokens, block_t),)](
                grad.to(stream.dtype).contiguous(), h_res.contiguous(), stream, h_post.contiguous(), y.contiguous(),
                d_h_res, d_x, d_h_post, d_y, tokens, width, stride_t, stride_f, N=n, BLOCK_T=block_t,
                BLOCK_C=MIX_BLOCK_C, EXACT_DOT=_exact_dot(stream))
    return d_h_res, d_x, d_h_post, d_y


# mhc_pre: the dynamic coefficients' projection (with the stream's RMS) and the stream's gradient from the
# coefficients and from H_pre x, in one pass each.
# Compiled for sm_90 (n = 4, bf16, ptxas -v): the projection 64 registers a thread (8 warps; wgmma), the backward
# 98 (8 warps, 2 pipeline stages; 3 stages took 155), no spills.
PROJ_BLOCK_T, PROJ_BLOCK_C, PROJ_WARPS = 64, 64, 8
PRE_BACKWARD_BLOCK_T, PRE_BACKWARD_BLOCK_C, PRE_BACKWARD_WARPS, PRE_BACKWARD_STAGES = 16, 128, 8, 2
PRE_BACKWARD_GROUPS = 64  # token groups of the backward: partial sums of d phi, [groups, m, n C] fp32


def projection_width(rows: int) -> int:
    """The projection's ``n*n + 2n`` rows padded for tl.dot: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _projection_kernel(x_ptr, phi_ptr, proj_ptr, inv_rms_ptr, tokens, C, stride_t, stride_f, M, eps,
                       N: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       EXACT_DOT: tl.constexpr):
    # proj[t, m] = sum_k flat[t, k] phi[m, k] and inv_rms[t] = (sum_k flat[t, k]^2 / (N C) + eps)^(-1/2), where
    # flat[t, f C + c] = stream[t, f, c]: one read of the stream. The 16-bit path rounds phi to the stream's
    # dtype, as the PyTorch path's F.linear does, and accumulates in fp32.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = t.to(tl.int64)
    live = t < tokens
    m = tl.arange(0, MP)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for f in tl.static_range(N):
        for start in range(0, C, BLOCK_C):
            c = start + tl.arange(0, BLOCK_C)
            x = tl.load(x_ptr + rows[:, None] * stride_t + f * stride_f + c[None, :],
                        mask=live[:, None] & (c < C)[None, :], other=0.0)
            w = tl.load(phi_ptr + m[None, :] * (N * C) + f * C + c[:, None],
                        mask=(m < M)[None, :] & (c < C)[:, None], other=0.0)  # [BLOCK_C, MP]: phi transposed
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            if EXACT_DOT:
                acc = tl.dot(xf, w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
    tl.store(proj_ptr + rows[:, None] * M + m[None, :], acc, mask=live[:, None] & (m < M)[None, :])
    tl.store(inv_rms_ptr + rows, 1.0 / tl.sqrt(sumsq / (N * C) + eps), mask=live)


@triton.jit
def _pre_backward_kernel(g_ptr, x_ptr, h_ptr, dproj_ptr, coef_ptr, phi_ptr, acc_ptr, dx_ptr, dphi_ptr, tokens, C,
                         stride_t, stride_f, M, N: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr, EXACT_DOT: tl.constexpr, ACCUMULATE: tl.constexpr):
    # d stream[t, f, c] = h_pre[t, f] g[t, c] + sum_m dproj[t, m] phi[m, f C + c] + coef[t] stream[t, f, c]
    #                     (+ acc[t, f, c]: the stream's gradient from mix_out, when ACCUMULATE)
    # d phi[m, f C + c] = sum_t dproj[t, m] stream[t, f, c]
    # One program owns one flow's block of channels for the tokens of its group (every GROUPS-th block of
    # BLOCK_T tokens): phi's columns are read once, and d phi's partial sum stays in registers until the end.
    cblocks = tl.cdiv(C, BLOCK_C)
    f = tl.program_id(0) // cblocks
    c = (tl.program_id(0) % cblocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    group, groups = tl.program_id(1), tl.num_programs(1)
    m = tl.arange(0, MP)
    cmask = c < C
    w = tl.load(phi_ptr + m[:, None] * (N * C) + f * C + c[None, :], mask=(m < M)[:, None] & cmask[None, :],
                other=0.0)  # [MP, BLOCK_C], kept in the dtype its product takes
    w = w.to(tl.float32 if EXACT_DOT else dx_ptr.dtype.element_ty)
    dphi = tl.zeros([MP, BLOCK_C], dtype=tl.float32)
    for block in range(group, tl.cdiv(tokens, BLOCK_T), groups):
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = t.to(tl.int64)
        live = t < tokens
        mask = live[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_t + f * stride_f + c[None, :], mask=mask, other=0.0)
        g = tl.load(g_ptr + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dp = tl.load(dproj_ptr + rows[:, None] * M + m[None, :], mask=live[:, None] & (m < M)[None, :], other=0.0)
        h = tl.load(h_ptr + rows * N + f, mask=live, other=0.0)
        coef = tl.load(coef_ptr + rows, mask=live, other=0.0)
        if EXACT_DOT:
            through_phi = tl.dot(dp, w, input_precision="ieee")
            dphi = tl.dot(tl.trans(dp), x.to(tl.float32), dphi, input_precision="ieee")
        else:
            through_phi = tl.dot(dp.to(x.dtype), w)
            dphi = tl.dot(tl.trans(dp.to(x.dtype)), x, dphi)
        dx = h[:, None] * g + through_phi + coef[:, None] * x.to(tl.float32)
        out_offs = rows[:, None] * (N * C) + f * C + c[None, :]
        if ACCUMULATE:
            dx += tl.load(acc_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + out_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dphi_ptr + group.to(tl.int64) * (MP * N * C) + m[:, None] * (N * C) + f * C + c[None, :], dphi,
             mask=cmask[None, :])


def projection(stream: torch.Tensor, phi: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat @ phi.T`` and ``1 / RMS(flat)`` (fp32, ``[..., m]`` and ``[..., 1]``) for the flattened stream."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    rows = phi.shape[0]
    proj = torch.empty(stream.shape[:-2] + (rows,), dtype=torch.float32, device=stream.device)
    inv_rms = torch.empty(stream.shape[:-2] + (1,), dtype=torch.float32, device=stream.device)
    if tokens:
        with _on(stream.device):
            _projection_kernel[(triton.cdiv(tokens, PROJ_BLOCK_T),)](
                stream, phi.contiguous(), proj, inv_rms, tokens, width, stride_t, stride_f, rows, eps, N=n,
                MP=projection_width(rows), BLOCK_T=PROJ_BLOCK_T, BLOCK_C=PROJ_BLOCK_C,
                EXACT_DOT=_exact_dot(stream), num_warps=PROJ_WARPS)
    return proj, inv_rms


def pre_backward(grad: torch.Tensor, stream: torch.Tensor, h_pre: torch.Tensor, d_proj: torch.Tensor,
                 coef: torch.Tensor, phi: torch.Tensor, accumulate: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream's gradient (its dtype, contiguous) through ``H_pre x`` and the normed projection, given the
    gradient of ``H_pre x`` (``grad``), the projection's (``d_proj``, fp32, already times ``1 / RMS``) and the
    per-token factor of the stream's own term (``coef``), plus ``accumulate`` (the stream's gradient from
    elsewhere) when given; and phi's gradient (fp32)."""
    tokens, n, width, stride_t, stride_f = _geometry(stream)
    rows, mp = phi.shape[0], projection_width(phi.shape[0])
    d_x = torch.empty(stream.shape, dtype=stream.dtype, device=stream.device)
    groups = max(1, min(PRE_BACKWARD_GROUPS, triton.cdiv(tokens, PRE_BACKWARD_BLOCK_T)))
    partial = torch.empty(groups, mp, n * width, dtype=torch.float32, device=stream.device)
    if not tokens:
        return d_x, torch.zeros(phi.shape, dtype=torch.float32, device=phi.device)
    grid = (n * triton.cdiv(width, PRE_BACKWARD_BLOCK_C), groups)
    with _on(stream.device):
        _pre_backward_kernel[grid](
            grad.contiguous(), stream, h_pre.contiguous(), d_proj.contiguous(), coef.contiguous(), phi.contiguous(),
            d_x if accumulate is None else accumulate.contiguous(), d_x, partial, tokens, width, stride_t, stride_f,
            rows, N=n, MP=mp, BLOCK_T=PRE_BACKWARD_BLOCK_T, ACCUMULATE=accumulate is not None,
            BLOCK_C=PRE_BACKWARD_BLOCK_C, EXACT_DOT=_exact_dot(stream),
            num_warps=PRE_BACKWARD_WARPS, num_stages=PRE_BACKWARD_STAGES)
    return d_x, partial[:, :rows].sum(0)
