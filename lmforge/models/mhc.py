"""Manifold-constrained hyper-connections (mHC, DeepSeek arXiv 2512.24880), for the ``gpt`` family.

The residual stream is widened into ``n`` flows, ``x_l`` of shape ``[..., n, C]``. Every sub-layer F
(attention or MLP) reads one C-wide mix of the flows and writes its output back into all of them::

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)

with per-token coefficients, dynamic (from the token's stream) plus static::

    r = 1 / RMS(flatten(x_l))                       (RMSNorm without a scale: phi absorbs it)
    H_pre  = sigmoid(a_pre * r * (x phi_pre) + b_pre)                  in (0, 1)^n
    H_post = 2 * sigmoid(a_post * r * (x phi_post) + b_post)           in (0, 2)^n
    H_res  = SinkhornKnopp(a_res * r * (x phi_res) + b_res)            doubly stochastic n x n

``r`` multiplies after the projection (the same value as normalising first, without an nC-wide
normalised copy of the stream). Coefficients are computed in fp32 with autocast off (a 16-bit stream's
projection takes 16-bit operands and accumulates in fp32), and the mixing runs at the stream's precision.
By default (``model.mhc_stream_dtype=fp32``) the stream keeps the plain model's residual dtype (fp32 under
bf16 autocast), so mHC on and off differ only in the connections; ``autocast`` stores it in the training
precision (bf16), as the paper does to halve its memory traffic.
Sinkhorn runs in the log domain, alternately normalising columns and rows, as one operator
(``torch.ops.lmforge.sinkhorn``, a Triton kernel on CUDA). The mixing is PyTorch ops: a batched matmul in eager
mode and a broadcast product that Inductor fuses under ``torch.compile`` (``mix_in`` / ``mix_out``). With
``model.mhc_kernels=triton`` a sub-layer's mHC work on CUDA is two operators instead,
``torch.ops.lmforge.mhc_pre`` (the coefficients and ``H_pre x``) and ``mhc_mix_out``, with Triton kernels
(``mhc_triton``) that read the stream once per product and sum the coefficients' gradients in the same passes;
on an H200 they measured slower than Inductor's fusion (``MHC_KERNELS``), so they are not the default.

Initialisation (``phi = 0``, ``a = 0.01``): the block starts as the plain residual network. Every
flow starts as a copy of the embedding and ``H_post = 1`` adds F's output to each, so the flows stay
equal and any doubly stochastic ``H_res`` maps them to themselves; ``H_pre`` sums to exactly 1, so F
reads the plain residual. ``H_pre`` puts 0.7 on flow ``l mod n`` (0.1 on each of the others for
n = 4): if every sub-layer read all flows alike the flows would get identical gradients and never
become different. ``b_res`` starts identity-like: diagonal 0, off-diagonal -2, so each flow keeps ~70% of itself (n = 4).
Closer to the identity (-4: ~95%) makes Sinkhorn converge far slower once training perturbs the
logits (near-decomposable matrices): with noise of std 0.3, 20 rounds leave column sums off by up
to 1e-2 at -4 and 4e-5 at -2.

Stability metric ("Amax gain magnitude"): for a mixing matrix M acting on the flows, the forward gain
is the largest absolute row sum, the backward gain the largest absolute column sum, each averaged over
the tokens of one sequence. ``H_pre`` acts as a 1 x n matrix (forward gain = sum of its entries),
``H_post`` as the n x 1 matrix ``H_post^T`` (forward gain = its largest entry). The composite gain is
that of the product of every sub-layer's ``H_res`` through depth, per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.triton_support import can_build_triton_kernels, naming_triton_failures

PRE_MAIN_SHARE = 0.7  # share of H_pre on a sub-layer's own flow at initialisation (n > 1)
RES_OFF_DIAGONAL = -2.0  # initial static logit of H_res off the diagonal (diagonal 0): see the docstring
ALPHA_INIT = 0.01
UNHEALTHY_GAIN = 2.0  # the seed's threshold: gains above it are logged with a warning


def sinkhorn_log(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """``[..., n, n]`` logits -> doubly stochastic matrices (fp32), by ``iters`` Sinkhorn-Knopp rounds.

    ``exp(logits)`` normalised alternately over columns and rows, in the log domain so that extreme
    (finite) logits neither overflow nor underflow. Every batch entry is normalised at once (no loop
    over tokens); rows sum to 1 to rounding, columns to within the convergence of ``iters`` rounds.
    One operator (``torch.ops.lmforge.sinkhorn``): ``torch.compile`` sees a single node, and the
    gradient, exact for the ``iters`` rounds, recomputes the rounds from the logits.
    """
    return sinkhorn(logits, iters)


def _lse(x: torch.Tensor, dim: int) -> torch.Tensor:
    # logsumexp for finite inputs: fewer kernels than torch.logsumexp (it also handles infinities).
    m = x.amax(dim, keepdim=True)
    return m + (x - m).exp_().sum(dim, keepdim=True).log_()


def _rounds(logits: torch.Tensor, iters: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The vectorised rounds: ``[..., n, n]`` logits -> the final log-matrix and each round's column and
    row normalisers, all token-last (``[n, n, tokens]``): a reduction over one of the first two dims is
    then an elementwise pass over contiguous token vectors, ~4x faster on CPUs than reducing a last
    dim of 4."""
    n = logits.shape[-1]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32  # fp64 for gradcheck
    y = logits.reshape(-1, n, n).permute(1, 2, 0).contiguous().to(dtype)
    col_norms, row_norms = [], []
    for _ in range(iters):
        c = _lse(y, 0)
        y = y - c
        r = _lse(y, 1)
        y = y - r
        col_norms.append(c)
        row_norms.append(r)
    return y, col_norms, row_norms


def _from_token_last(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1).reshape(like.shape).contiguous()


def _vectorised_forward(logits: torch.Tensor, iters: int) -> torch.Tensor:
    return _from_token_last(_rounds(logits, iters)[0].exp(), logits)


def _vectorised_backward(grad: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    y, col_norms, row_norms = _rounds(logits, iters)
    n = logits.shape[-1]
    p = y.exp()
    g = grad.reshape(-1, n, n).permute(1, 2, 0).to(y.dtype) * p  # d loss / d y (p = exp(y))
    for k in range(iters - 1, -1, -1):
        g = g - p * g.sum(1, keepdim=True)  # through the row step
        p = p * row_norms[k].exp()  # exp(y before the row step): row normalisers are <= log n
        g = g - p * g.sum(0, keepdim=True)  # through the column step
        if k > 0:  # the first column normaliser can be huge (raw logits); that exp is never needed
            p = p * col_norms[k].exp()
    return _from_token_last(g, logits).to(logits.dtype)


@torch.library.custom_op("lmforge::sinkhorn", mutates_args=())
def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """``sinkhorn_log`` as one operator. The vectorised implementation serves every device; on CUDA
    the Triton kernel of ``lmforge.models.mhc_triton`` runs instead when Triton is installed."""
    return _vectorised_forward(logits, iters)


@torch.library.custom_op("lmforge::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(grad: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Gradient of ``sinkhorn(logits, iters)``. Only the logits are kept from the forward (64 bytes per
    token at n = 4, fp32; keeping every round's normalisers took 704): the rounds are recomputed, then
    run backwards. Each half-round ``y' = y - lse(y)`` back-propagates as
    ``dy = dy' - softmax(y) * sum(dy')`` with ``softmax(y) = exp(y')``, and each step's ``exp(y)`` is
    the next one's times ``exp(normaliser)``: the way back takes exponentials of the normalisers only."""
    return _vectorised_backward(grad, logits, iters)


@sinkhorn.register_fake
def _(logits: torch.Tensor, iters: int) -> torch.Tensor:
    return torch.empty_like(logits, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)


@sinkhorn_backward.register_fake
def _(grad: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.iters = inputs[1]


def _backward(ctx, grad: torch.Tensor):
    return sinkhorn_backward(grad, ctx.saved_tensors[0], ctx.iters), None


sinkhorn.register_autograd(_backward, setup_context=_setup_context)


def _triton():
    """The Triton kernels' module, or None where Triton is not installed (the vectorised path runs)."""
    try:
        from lmforge.models import mhc_triton
    except ImportError:
        return None
    return mhc_triton


@sinkhorn.register_kernel("cuda")
def _(logits: torch.Tensor, iters: int) -> torch.Tensor:
    kernels = _triton()
    if kernels is None or not kernels.supports(logits):
        return _vectorised_forward(logits, iters)
    return kernels.sinkhorn_forward(logits, iters)


@sinkhorn_backward.register_kernel("cuda")
def _(grad: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor:
    kernels = _triton()
    if kernels is None or not kernels.supports(logits):
        return _vectorised_backward(grad, logits, iters)
    return kernels.sinkhorn_backward(grad, logits, iters)


def amax_gains(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (largest absolute row sum) and backward (largest absolute column sum) gain of
    ``[..., r, c]`` matrices, each of shape ``[...]``."""
    a = m.abs()
    return a.sum(-1).amax(-1), a.sum(-2).amax(-1)


# auto: the fastest measured, which is PyTorch ops (Inductor fuses them under torch.compile) on CPUs and on CUDA
# alike: on an H200 (2026-11-26, rlm_mhc_125m compiled, bf16 stream) a step took 91.2 ms with them and 123.2 ms
# with the Triton operators (triton), whose backward kernels ran at 400-1,000 GB/s (benchmarks/RESULTS.md).
MHC_KERNELS = ("auto", "torch", "triton")


def mix_in(h_pre: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """``H_pre x``: ``[..., n]`` weights, ``[..., n, C]`` stream -> ``[..., C]``, in PyTorch ops.

    Compiled, a broadcast product summed over the n flows: Inductor fuses it into one pass over the
    stream (its backward too), where a batched matmul of width n is an opaque kernel per token. Eager,
    the matmul: the product would first write an n x C temporary. (On CUDA the layer uses the operator
    ``mhc_pre`` instead, see ``MHCLayer``.)"""
    if torch.compiler.is_compiling():
        return (h_pre.unsqueeze(-1) * stream).sum(-2)
    return (h_pre.unsqueeze(-2) @ stream).squeeze(-2)


def mix_out(h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``H_res x + H_post^T y``: ``[..., n, n]``, ``[..., n, C]``, ``[..., n]``, ``[..., C]`` -> ``[..., n, C]``
    (compiled: one fused pass, see ``mix_in``)."""
    if torch.compiler.is_compiling():
        return (h_res.unsqueeze(-1) * stream.unsqueeze(-3)).sum(-2) + h_post.unsqueeze(-1) * y.unsqueeze(-2)
    # eager: the outer product added inside the batched matmul (baddbmm), one pass fewer over the stream
    n, width = stream.shape[-2:]
    out = torch.baddbmm((h_post.unsqueeze(-1) * y.unsqueeze(-2)).reshape(-1, n, width), h_res.reshape(-1, n, n),
                        stream.reshape(-1, n, width))
    return out.reshape(stream.shape)


# The sub-layer as two operators (CUDA): ``mhc_pre`` (the coefficients and H_pre x) and ``mhc_mix_out``, each
# with Triton kernels (``mhc_triton``) that take the fp32 coefficients as they are and the stream in its own
# dtype. The PyTorch implementations serve other devices and what the kernels do not take (fp64, n not a power
# of two); the mixing's compute in fp32 (fp64 for fp64).


def _acc(stream: torch.Tensor) -> torch.dtype:
    return torch.promote_types(stream.dtype, torch.float32)


def _mix_out_torch(h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor
                   ) -> torch.Tensor:
    acc = _acc(stream)
    with torch.autocast(stream.device.type, enabled=False):  # an eager operator still sees autocast
        out = h_res.to(acc) @ stream.to(acc) + h_post.to(acc).unsqueeze(-1) * y.to(acc).unsqueeze(-2)
    return out.to(stream.dtype).contiguous()


def _mix_out_backward_torch(grad: torch.Tensor, h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor,
                            y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _acc(stream)
    g, x = grad.to(acc), stream.to(acc)
    with torch.autocast(stream.device.type, enabled=False):
        d_h_res = g @ x.transpose(-1, -2)
        d_x = h_res.to(acc).transpose(-1, -2) @ g
        d_h_post = (g @ y.to(acc).unsqueeze(-1)).squeeze(-1)
        d_y = (h_post.to(acc).unsqueeze(-2) @ g).squeeze(-2)
    return (d_h_res.to(h_res.dtype).contiguous(), d_x.to(stream.dtype).contiguous(),
            d_h_post.to(h_post.dtype).contiguous(), d_y.to(y.dtype).contiguous())


@torch.library.custom_op("lmforge::mhc_mix_out", mutates_args=())
def mhc_mix_out(h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``H_res x + H_post^T y`` (``mix_out``) as one operator, in the stream's dtype."""
    return _mix_out_torch(h_res, stream, h_post, y)


@torch.library.custom_op("lmforge::mhc_mix_out_backward", mutates_args=())
def mhc_mix_out_backward(grad: torch.Tensor, h_res: torch.Tensor, stream: torch.Tensor, h_post: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``mhc_mix_out`` for ``h_res``, the stream, ``h_post`` and ``y``, each in its input's dtype."""
    return _mix_out_backward_torch(grad, h_res, stream, h_post, y)


def _like(t: torch.Tensor, dtype: torch.dtype | None = None, shape=None) -> torch.Tensor:
    return torch.empty(t.shape if shape is None else shape, dtype=t.dtype if dtype is None else dtype, device=t.device)


@mhc_mix_out.register_fake
def _(h_res, stream, h_post, y):
    return _like(stream)


@mhc_mix_out_backward.register_fake
def _(grad, h_res, stream, h_post, y):
    return _like(h_res), _like(stream), _like(h_post), _like(y)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


mhc_mix_out.register_autograd(lambda ctx, grad: mhc_mix_out_backward(grad, *ctx.saved_tensors),
                              setup_context=_save_inputs)


def _mix_kernels(stream: torch.Tensor):
    """The Triton kernels' module when they take this stream (else None: the PyTorch implementation runs)."""
    kernels = _triton()
    return kernels if kernels is not None and kernels.mix_supported(stream) else None


def _named_failures():
    return naming_triton_failures("mHC", "Set model.mhc_kernels=torch to run it on PyTorch ops")


@mhc_mix_out.register_kernel("cuda")
def _mix_out_cuda(h_res, stream, h_post, y):
    kernels = _mix_kernels(stream)
    if kernels is None:
        return _mix_out_torch(h_res, stream, h_post, y)
    with _named_failures():
        return kernels.mix_out(h_res, stream, h_post, y)


@mhc_mix_out_backward.register_kernel("cuda")
def _mix_out_backward_cuda(grad, h_res, stream, h_post, y):
    kernels = _mix_kernels(stream)
    if kernels is None:
        return _mix_out_backward_torch(grad, h_res, stream, h_post, y)
    with _named_failures():
        return kernels.mix_out_backward(grad, h_res, stream, h_post, y)


def _normed_projection(flat: torch.Tensor, phi: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat @ phi.T`` and ``1 / RMS(flat)``, both fp32 (fp64 for an fp64 stream; see ``_NormedProjection``)."""
    if flat.dtype in (torch.bfloat16, torch.float16):  # vector_norm upcasts as it reads: no fp32 copy
        norm = torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float32)
        inv_rms = torch.rsqrt(norm.square() / flat.shape[-1] + eps)
    else:  # fp32: the form the compiled model was measured with (the vector_norm form compiled slower in one run)
        inv_rms = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return F.linear(flat, phi.to(flat.dtype)).to(torch.promote_types(flat.dtype, torch.float32)), inv_rms


class _NormedProjection(torch.autograd.Function):
    """``(flat @ phi.T) / RMS(flat)`` in fp32, for the ``[..., n*C]`` flattened stream: the dynamic part of
    the coefficients, with a backward written out for eager mode (the norm's gradient is one pass over the
    stream, where autograd's takes five: the mean's expand and divide, the square's two products, the sum;
    on one CPU thread at ``rlm_mhc_tiny`` the mHC step's overhead went from 31.6% to 22.1% with the eager
    ``mix_out`` below). Under ``torch.compile`` the plain ops run instead: Inductor fuses their derived
    backward, which measured faster than this one traced (12.4% against 15.7% of the step in overhead).

    A 16-bit stream (``mhc_stream_dtype=autocast``) is read as it is: its norm accumulates in fp32
    (``vector_norm`` upcasts as it reads), and the projection's matmul accumulates in fp32; only the
    ``n*n + 2n`` outputs are rounded to 16 bits before the upcast. An fp32 copy of the ``n*C``-wide stream
    (and of its gradient) would cost more memory traffic than the projection itself."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, phi: torch.Tensor, eps: float) -> torch.Tensor:
        proj, inv_rms = _normed_projection(flat, phi, eps)
        ctx.save_for_backward(flat, phi.to(flat.dtype), inv_rms, proj)
        ctx.phi_dtype = phi.dtype
        return proj * inv_rms

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, w, inv_rms, proj = ctx.saved_tensors
        grad = grad.to(proj.dtype)
        grad_proj = (grad * inv_rms).to(flat.dtype)
        # d inv_rms = sum(grad * proj); inv_rms = (sum(x^2) / width + eps)^(-1/2), so
        # d x = d inv_rms * (-inv_rms^3 / width) * x
        coef = (grad * proj).sum(-1, keepdim=True).mul_(inv_rms.pow(3)).div_(-flat.shape[-1])
        grad_flat = grad_proj @ w
        grad_flat.addcmul_(flat, coef.to(flat.dtype))
        grad_phi = grad_proj.reshape(-1, grad_proj.shape[-1]).t() @ flat.reshape(-1, flat.shape[-1])
        return grad_flat, grad_phi.to(ctx.phi_dtype), None


def _coefficients_from(dynamic: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor, b_post: torch.Tensor,
                       b_res: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``H_pre``, ``H_post``, ``H_res`` from the dynamic part ``[..., n*n + 2n]`` and the static terms."""
    n, acc = b_pre.shape[0], torch.promote_types(dynamic.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    d_pre, d_post, d_res = dynamic.split([n, n, n * n], dim=-1)
    alpha = alpha.to(acc)
    h_pre = torch.sigmoid(alpha[0] * d_pre + b_pre.to(acc))
    h_post = 2.0 * torch.sigmoid(alpha[1] * d_post + b_post.to(acc))
    h_res = sinkhorn_log(alpha[2] * d_res.unflatten(-1, (n, n)) + b_res.to(acc), iters)
    return h_pre, h_post, h_res


def _coefficients_backward(dynamic: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor, b_post: torch.Tensor,
                           b_res: torch.Tensor, iters: int, d_h_pre: torch.Tensor, d_h_post: torch.Tensor,
                           d_h_res: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients of ``_coefficients_from`` for ``dynamic``, ``alpha``, ``b_pre``, ``b_post``, ``b_res`` (each in its
    input's dtype), written out."""
    n, acc = b_pre.shape[0], torch.promote_types(dynamic.dtype, torch.float32)
    d_pre, d_post, d_res = dynamic.split([n, n, n * n], dim=-1)
    a = alpha.to(acc)
    s_pre = torch.sigmoid(a[0] * d_pre + b_pre.to(acc))
    s_post = torch.sigmoid(a[1] * d_post + b_post.to(acc))
    z_pre = d_h_pre * s_pre * (1 - s_pre)  # through the sigmoids (H_post = 2 sigmoid)
    z_post = d_h_post * 2 * s_post * (1 - s_post)
    z_res = sinkhorn_backward(d_h_res.contiguous(), (a[2] * d_res.unflatten(-1, (n, n)) + b_res.to(acc)).contiguous(),
                              iters).flatten(-2)
    d_alpha = torch.stack([(z_pre * d_pre).sum(), (z_post * d_post).sum(), (z_res * d_res).sum()])
    d_dynamic = torch.cat([a[0] * z_pre, a[1] * z_post, a[2] * z_res], dim=-1)
    d_b_pre, d_b_post, d_b_res = (z.reshape(-1, z.shape[-1]).sum(0) for z in (z_pre, z_post, z_res))  # over tokens
    return (d_dynamic.to(dynamic.dtype), d_alpha.to(alpha.dtype), d_b_pre.to(b_pre.dtype), d_b_post.to(b_post.dtype),
            d_b_res.unflatten(-1, (n, n)).to(b_res.dtype))


def _flat(stream: torch.Tensor) -> torch.Tensor:
    """The ``[..., n*C]`` stream the coefficients read: a 16-bit stream as it is, others in fp32 (fp64 stays)."""
    flat = stream.flatten(-2)
    return flat if flat.dtype in (torch.bfloat16, torch.float16, torch.float64) else flat.float()


@torch.library.custom_op("lmforge::mhc_pre", mutates_args=())
def mhc_pre(stream: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, b_pre: torch.Tensor, b_post: torch.Tensor,
            b_res: torch.Tensor, iters: int, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of an mHC sub-layer as one operator: the coefficients (``MHCLayer.coefficients``) and
    ``H_pre x``. Returns ``H_pre x`` (the stream's dtype), ``H_pre``, ``H_post``, ``H_res`` (fp32), and the
    projection and ``1 / RMS`` its backward reuses. On CUDA one Triton pass reads the stream for the projection
    and its RMS, one more for ``H_pre x``; the backward reads it twice (``H_pre``'s gradient, then the stream's
    and phi's together), where separate operators would also write, and then add, a second gradient of it.
    ``MHCLayer`` calls it through ``_PreAndStream``, whose backward also adds ``mhc_mix_out``'s gradient of the
    stream in that same pass."""
    return _pre(stream, phi, alpha, b_pre, b_post, b_res, iters, eps, None)


def _pre(stream, phi, alpha, b_pre, b_post, b_res, iters, eps, kernels):
    with torch.autocast(stream.device.type, enabled=False):
        if kernels is None:
            proj, inv_rms = _normed_projection(_flat(stream), phi, eps)
        else:
            proj, inv_rms = kernels.projection(stream, phi, eps)
        h_pre, h_post, h_res = _coefficients_from(proj * inv_rms, alpha, b_pre, b_post, b_res, iters)
        if kernels is None:
            acc = _acc(stream)
            x_in = (h_pre.to(acc).unsqueeze(-2) @ stream.to(acc)).squeeze(-2).to(stream.dtype)
        else:
            x_in = kernels.mix_in(h_pre, stream)
    return x_in.contiguous(), h_pre, h_post, h_res, proj, inv_rms


@torch.library.custom_op("lmforge::mhc_pre_backward", mutates_args=())
def mhc_pre_backward(d_x_in: torch.Tensor, d_h_pre: torch.Tensor, d_h_post: torch.Tensor, d_h_res: torch.Tensor,
                     d_stream: torch.Tensor | None, stream: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor,
                     b_pre: torch.Tensor, b_post: torch.Tensor, b_res: torch.Tensor, proj: torch.Tensor,
                     inv_rms: torch.Tensor, h_pre: torch.Tensor, iters: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``mhc_pre`` for the stream, phi, alpha, b_pre, b_post and b_res (each in its dtype); the
    stream's plus ``d_stream`` (its gradient from elsewhere, or None)."""
    return _pre_backward(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, stream, phi, alpha, b_pre, b_post, b_res,
                         proj, inv_rms, h_pre, iters, None)


def _pre_backward(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, stream, phi, alpha, b_pre, b_post, b_res, proj,
                  inv_rms, h_pre, iters, kernels):
    with torch.autocast(stream.device.type, enabled=False):
        # H_pre's gradient through H_pre x (one read of the stream), then back through the coefficients'
        # small graph ([tokens, n*n + 2n] tensors; autograd cannot run inside an operator's implementation)
        if kernels is None:
            acc = _acc(stream)
            d_h = (stream.to(acc) @ d_x_in.to(acc).unsqueeze(-1)).squeeze(-1)
        else:
            d_h = kernels.mix_in_grad_h(d_x_in, h_pre, stream)
        d_dynamic, *d_statics = _coefficients_backward(proj * inv_rms, alpha, b_pre, b_post, b_res, iters,
                                                       d_h.to(h_pre.dtype) + d_h_pre, d_h_post, d_h_res)
        # through (flat @ phi.T) * inv_rms, inv_rms = (sum(flat^2) / width + eps)^(-1/2): see _NormedProjection
        d_proj = d_dynamic * inv_rms
        coef = (d_dynamic * proj).sum(-1, keepdim=True) * inv_rms.pow(3) / -(stream.shape[-2] * stream.shape[-1])
        if kernels is None:
            flat = _flat(stream)
            d_proj_16 = d_proj.to(flat.dtype)
            d_flat = d_proj_16 @ phi.to(flat.dtype) + coef.to(flat.dtype) * flat
            d_x = d_flat.unflatten(-1, stream.shape[-2:]) + h_pre.to(flat.dtype).unsqueeze(-1) * d_x_in.to(
                flat.dtype).unsqueeze(-2)
            if d_stream is not None:
                d_x = d_x + d_stream
            d_phi = d_proj_16.reshape(-1, d_proj.shape[-1]).t() @ flat.reshape(-1, flat.shape[-1])
        else:
            d_x, d_phi = kernels.pre_backward(d_x_in, stream, h_pre, d_proj, coef, phi, d_stream)
    return (d_x.to(stream.dtype).contiguous(), d_phi.to(phi.dtype), *(g.to(t.dtype) for g, t in
                                                                      zip(d_statics, (alpha, b_pre, b_post, b_res))))


@mhc_pre.register_fake
def _(stream, phi, alpha, b_pre, b_post, b_res, iters, eps):
    lead, n, acc = stream.shape[:-2], stream.shape[-2], _acc(stream)
    return (_like(stream, shape=lead + stream.shape[-1:]), _like(stream, acc, lead + (n,)),
            _like(stream, acc, lead + (n,)), _like(stream, acc, lead + (n, n)),
            _like(stream, acc, lead + (phi.shape[0],)), _like(stream, acc, lead + (1,)))


@mhc_pre_backward.register_fake
def _(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, stream, phi, alpha, b_pre, b_post, b_res, proj, inv_rms, h_pre,
      iters):
    return _like(stream), _like(phi), _like(alpha), _like(b_pre), _like(b_post), _like(b_res)


def _pre_setup_context(ctx, inputs, output) -> None:
    stream, phi, alpha, b_pre, b_post, b_res, iters, _ = inputs
    _, h_pre, _, _, proj, inv_rms = output
    ctx.save_for_backward(stream, phi, alpha, b_pre, b_post, b_res, proj, inv_rms, h_pre)
    ctx.iters = iters
    ctx.mark_non_differentiable(proj, inv_rms)


def _pre_autograd(ctx, d_x_in, d_h_pre, d_h_post, d_h_res, _d_proj, _d_inv_rms):
    grads = mhc_pre_backward(d_x_in, d_h_pre, d_h_post, d_h_res, None, *ctx.saved_tensors, ctx.iters)
    return (*grads, None, None)


mhc_pre.register_autograd(_pre_autograd, setup_context=_pre_setup_context)


class _PreAndStream(torch.autograd.Function):
    """``mhc_pre`` that also hands the stream on (a view), for ``mhc_mix_out``: the stream then has one consumer
    in the autograd graph, and ``mhc_mix_out``'s gradient of it reaches ``mhc_pre_backward``, which adds it in
    the pass that writes the stream's gradient (one read of it), where autograd would add the two gradients in a
    pass of its own (two reads and a write of the stream's size)."""

    @staticmethod
    def forward(ctx, stream, phi, alpha, b_pre, b_post, b_res, iters: int, eps: float):
        x_in, h_pre, h_post, h_res, proj, inv_rms = mhc_pre(stream, phi, alpha, b_pre, b_post, b_res, iters, eps)
        ctx.save_for_backward(stream, phi, alpha, b_pre, b_post, b_res, proj, inv_rms, h_pre)
        ctx.iters = iters
        return x_in, h_pre, h_post, h_res, stream.view_as(stream)

    @staticmethod
    def backward(ctx, d_x_in, d_h_pre, d_h_post, d_h_res, d_stream):
        grads = mhc_pre_backward(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, *ctx.saved_tensors, ctx.iters)
        return (*grads, None, None)


@mhc_pre.register_kernel("cuda")
def _pre_cuda(stream, phi, alpha, b_pre, b_post, b_res, iters, eps):
    with _named_failures():
        return _pre(stream, phi, alpha, b_pre, b_post, b_res, iters, eps, _mix_kernels(stream))


@mhc_pre_backward.register_kernel("cuda")
def _pre_backward_cuda(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, stream, phi, alpha, b_pre, b_post, b_res, proj,
                       inv_rms, h_pre, iters):
    with _named_failures():
        return _pre_backward(d_x_in, d_h_pre, d_h_post, d_h_res, d_stream, stream, phi, alpha, b_pre, b_post, b_res,
                             proj, inv_rms, h_pre, iters, _mix_kernels(stream))


class MHCLayer(nn.Module):
    """The mHC coefficients and stream update around one sub-layer (attention or MLP).

    ``index`` is the sub-layer's position in the model (it picks the flow ``H_pre`` favours at
    initialisation). The seed's ``mHCLayer(hidden_dim=2048, num_flows=4)`` is this class.
    """

    def __init__(self, hidden_dim: int, num_flows: int = 4, sinkhorn_iters: int = 20, index: int = 0,
                 eps: float = 1e-6, kernels: str = "auto"):
        super().__init__()
        if num_flows < 1 or sinkhorn_iters < 1:
            raise ValueError(f"num_flows ({num_flows}) and sinkhorn_iters ({sinkhorn_iters}) must be >= 1")
        if kernels not in MHC_KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(MHC_KERNELS)}, got {kernels!r}")
        n = num_flows
        self.flows, self.sinkhorn_iters, self.eps, self.kernels = n, sinkhorn_iters, eps, kernels
        self.phi = nn.Parameter(torch.zeros(n * n + 2 * n, n * hidden_dim))  # rows [pre | post | res]
        self.alpha = nn.Parameter(torch.full((3,), ALPHA_INIT))  # pre, post, res
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.index = index
        self.reset_static()

    def reset_static(self) -> None:
        """The documented initial values of the static terms (see the module docstring)."""
        n = self.flows
        with torch.no_grad():
            if n == 1:
                self.b_pre.fill_(0.0)  # 0.5: the sub-layer's input norm removes the scale
            else:
                self.b_pre.fill_(math.log((1 - PRE_MAIN_SHARE) / (n - 1) / (1 - (1 - PRE_MAIN_SHARE) / (n - 1))))
                self.b_pre[self.index % n] = math.log(PRE_MAIN_SHARE / (1 - PRE_MAIN_SHARE))
            self.b_post.zero_()
            self.b_res.fill_(RES_OFF_DIAGONAL).fill_diagonal_(0.0)
            self.phi.zero_()
            self.alpha.fill_(ALPHA_INIT)

    def coefficients(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., n, C]`` stream -> ``H_pre [..., n]``, ``H_post [..., n]``, ``H_res [..., n, n]`` (fp32)."""
        with torch.autocast(stream.device.type, enabled=False):
            flat = _flat(stream)
            if torch.compiler.is_compiling():  # Inductor derives the backward and fuses it (measured faster)
                proj, inv_rms = _normed_projection(flat, self.phi, self.eps)
                dynamic = proj * inv_rms
            else:
                dynamic = _NormedProjection.apply(flat, self.phi, self.eps)
            return _coefficients_from(dynamic, self.alpha, self.b_pre, self.b_post, self.b_res, self.sinkhorn_iters)

    def forward(self, stream: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Run ``sublayer`` on the mixed stream; return the new stream and the first sequence's
        detached coefficients (for the Amax metrics; views, free when unused)."""
        if self.uses_mixing_operators(stream):  # fp32 coefficients, the stream's dtype in and out
            x_in, h_pre, h_post, h_res, stream = _PreAndStream.apply(stream, self.phi, self.alpha, self.b_pre,
                                                                     self.b_post, self.b_res, self.sinkhorn_iters,
                                                                     self.eps)
            out = mhc_mix_out(h_res, stream, h_post, sublayer(x_in))
            return out, (h_pre[0].detach(), h_post[0].detach(), h_res[0].detach())
        h_pre, h_post, h_res = self.coefficients(stream)
        dtype, device = stream.dtype, stream.device.type
        with torch.autocast(device, enabled=False):  # mix at the stream's precision, not autocast's
            x_in = mix_in(h_pre.to(dtype), stream)
        y = sublayer(x_in)
        with torch.autocast(device, enabled=False):
            out = mix_out(h_res.to(dtype), stream, h_post.to(dtype), y.to(dtype))
        return out, (h_pre[0].detach(), h_post[0].detach(), h_res[0].detach())

    def uses_mixing_operators(self, stream: torch.Tensor) -> bool:
        """Whether the sub-layer runs on the operators ``mhc_pre`` / ``mhc_mix_out`` (Triton kernels): only when
        asked (``kernels="triton"``), on CUDA where Triton can build them. Otherwise PyTorch ops mix it, which
        Inductor fuses under ``torch.compile``: what measured fastest on CPUs and on an H200 (``MHC_KERNELS``)."""
        return self.kernels == "triton" and stream.device.type == "cuda" and can_build_triton_kernels()

    @torch.no_grad()
    def get_connection_matrix(self, stream: torch.Tensor | None = None) -> torch.Tensor:
        """The n x n residual mixing matrix ``H_res``: its static part (no ``stream``), or for each
        token of a ``[..., n, C]`` stream. Rows and columns sum to ~1."""
        if stream is None:
            return sinkhorn_log(self.b_res.float(), self.sinkhorn_iters)
        return self.coefficients(stream)[2]


@dataclass
class LayerAmax:
    """Gains of one sub-layer's mixing matrices (token means). Iterating yields the seed's
    ``(pre, post)`` pair: the forward gains of ``H_pre`` and ``H_post``."""

    kind: str  # attn | mlp
    block: int
    pre_fwd: float
    pre_bwd: float
    post_fwd: float
    post_bwd: float
    res_fwd: float
    res_bwd: float

    def __iter__(self):
        return iter((self.pre_fwd, self.post_fwd))


@dataclass
class MHCMetrics:
    """``model.get_mhc_metrics()``: per sub-layer gains and the composite gain of all ``H_res``.

    Iterating or indexing goes over ``layers`` (so ``for i, (pre, post) in enumerate(metrics)``
    works as in the seed's guide)."""

    layers: list[LayerAmax] = field(default_factory=list)
    composite_fwd: float = float("nan")
    composite_bwd: float = float("nan")

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerAmax:
        return self.layers[i]

    def summary(self) -> dict[str, float]:
        """The logged scalars: worst layer of each kind, and the composite (max of both directions)."""
        return {
            "mhc/amax_pre": max(layer.pre_fwd for layer in self.layers),
            "mhc/amax_post": max(layer.post_fwd for layer in self.layers),
            "mhc/amax_res": max(max(layer.res_fwd, layer.res_bwd) for layer in self.layers),
            "mhc/amax_composite": max(self.composite_fwd, self.composite_bwd),
        }


def gain_tensors(coeffs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per sub-layer coefficients of one sequence (``H_pre [T, n]``, ``H_post [T, n]``,
    ``H_res [T, n, n]``) -> ``[layers + 1, 6]`` token-mean gains: rows are (pre, post, res) x (fwd,
    bwd) per sub-layer, then the composite (fwd, bwd) padded with zeros. One tensor, no host sync."""
    with torch.autocast(coeffs[0][0].device.type, enabled=False):  # fp32 products, even under autocast
        return _gain_rows(coeffs)


def _gain_rows(coeffs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    rows = []
    composite = None
    for h_pre, h_post, h_res in coeffs:
        pre_f, pre_b = amax_gains(h_pre.unsqueeze(-2))  # 1 x n
        post_f, post_b = amax_gains(h_post.unsqueeze(-1))  # n x 1 (H_post transposed)
        res_f, res_b = amax_gains(h_res)
        rows.append(torch.stack([pre_f, pre_b, post_f, post_b, res_f, res_b]).mean(-1))
        composite = h_res if composite is None else h_res @ composite  # later layers act last
    comp_f, comp_b = amax_gains(composite)
    zero = torch.zeros((), device=comp_f.device)
    rows.append(torch.stack([comp_f.mean(), comp_b.mean(), zero, zero, zero, zero]))
    return torch.stack(rows)


def metrics_from_gains(gains: torch.Tensor, kinds: list[tuple[str, int]]) -> MHCMetrics:
    values = gains.detach().float().cpu().tolist()
    layers = [LayerAmax(kind, block, *row) for (kind, block), row in zip(kinds, values[:-1], strict=True)]
    return MHCMetrics(layers, composite_fwd=values[-1][0], composite_bwd=values[-1][1])
