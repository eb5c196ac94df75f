"""Cross-entropy of a linear LM head, fused and chunked.

``linear_cross_entropy(hidden, weight, labels)`` equals
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100)`` (mean over valid labels, 0 when
there are none) without ever holding the ``[tokens, vocab]`` logits: it walks the tokens in chunks,
and for each chunk computes the logits, the loss and — when gradients are wanted — the gradients of
that chunk right away, so only one chunk of logits exists at a time and ``exp`` runs once per logit.

Why: at GPT-2's vocabulary the logits are the largest tensors of a step (2048 tokens x 50257 x 4 bytes
= 411 MB, held three times over by the plain path: logits, log-softmax, their gradient). On CPUs the
plain path also pays for touching that fresh memory every step. Measured in ``benchmarks/RESULTS.md``.

The gradients are computed in the forward pass and only scaled by the incoming gradient in the
backward pass, so this suits a loss that is backpropagated once per forward (training, or no_grad
evaluation, where no gradient is computed at all).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# Logit elements per chunk (32 MB of fp32 on CPUs; accelerators take bigger chunks, fewer launches),
# and at least MIN_ROWS tokens per chunk: the weight gradient is a matmul over the chunk's tokens,
# which runs far below peak when that inner dimension is short (measured on CPU: 128 rows was 20%
# slower than 512-1024 at vocab 50257).
_CHUNK_ELEMENTS = {"cpu": 1 << 23}
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 27
MIN_ROWS = 512


def chunk_rows(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Tokens per chunk for ``num_rows`` tokens and a ``vocab_size``-wide head on ``device``."""
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_ACCELERATOR)
    rows = max(MIN_ROWS, budget // max(vocab_size, 1) // 64 * 64)
    return max(1, min(num_rows, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int):
        device_type = hidden.device.type
        # Matmuls run in the autocast dtype when autocast is on (as nn.Linear would), softmax in fp32.
        dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                 else weight.dtype)
        acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: fp32, or fp64 for fp64 inputs
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype)
            h_all = hidden.to(dtype)
            valid = labels != IGNORE_INDEX
            scale = 1.0 / valid.sum().clamp(min=1).to(acc)  # mean over valid labels
            total = torch.zeros((), dtype=acc, device=hidden.device)
            grad_h = torch.empty_like(hidden) if want_grad else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_grad else None
            # Each chunk works on logits laid out [vocab, rows] (w @ h.T): on CPUs that matmul and the
            # two gradient matmuls run closer to peak than in the [rows, vocab] layout (~15% at vocab
            # 50257), and the softmax reductions run down columns, vectorised across tokens.
            for start in range(0, hidden.shape[0], rows):
                h = h_all[start:start + rows]
                ok = valid[start:start + rows]
                target = labels[start:start + rows].clamp(min=0)[None, :]
                logits = (w @ h.t()).to(acc)
                picked = logits.gather(0, target).squeeze(0)
                top = logits.amax(dim=0, keepdim=True)
                probs = logits.sub_(top).exp_()  # in place: the chunk's logits become exp(l - max)
                norm = probs.sum(dim=0, keepdim=True)
                # per-token loss = logsumexp - target logit = log(norm) + max - target
                total += ((norm.log() + top).squeeze(0) - picked).mul_(ok).sum()
                if want_grad:
                    # d loss / d logits = (softmax - one_hot(target)) * scale on valid tokens, 0 elsewhere.
                    # The 1/count scale is applied after the matmuls, in fp32: folded in here, bf16/fp16
                    # gradients of large batches would underflow.
                    mask = ok.to(acc)[None, :]
                    grad_logits = probs.mul_(mask / norm)
                    grad_logits.scatter_add_(0, target, -mask)
                    grad_logits = grad_logits.to(dtype)
                    grad_h[start:start + rows] = grad_logits.t() @ w
                    if dtype == acc:
                        grad_w.addmm_(grad_logits, h)
                    else:  # bf16/fp16 matmul, accumulated across chunks in fp32
                        grad_w += (grad_logits @ h).to(acc)
        if want_grad:
            ctx.save_for_backward(grad_h.mul_(scale), grad_w.mul_(scale).to(weight.dtype))
        return total * scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_output, grad_w * grad_output, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` = ignored).

    ``hidden`` is ``[N, d]`` (or ``[B, T, d]``), ``weight`` ``[vocab, d]``, ``labels`` ``[N]`` (or
    ``[B, T]``); ``rows`` overrides the chunk size in tokens.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
        hidden, labels = _drop_unlabelled_on_cpu(hidden, labels)
    if rows is None:
        rows = chunk_rows(hidden.shape[0], weight.shape[0], hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, labels, rows)


def _drop_unlabelled_on_cpu(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens without a label (SFT prompts: ~90% of a tool-calling row) need no logits at all; on CPUs
    they are dropped before the head. On accelerators finding them would make the host wait for the
    device every step, so there their chunks run and are masked (this is not called there)."""
    keep = labels != IGNORE_INDEX
    if bool(keep.all()):
        return hidden, labels
    return hidden[keep], labels[keep]
