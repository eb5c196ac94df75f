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

On CUDA GPUs a second path is faster (``lm_loss="logits"``, what ``auto`` picks there under bf16): the
whole ``[tokens, vocab]`` logits in bf16 from one matmul, and the cross-entropy as one operator
(``torch.ops.lmforge.cross_entropy_rows``: Triton kernels on CUDA, ``losses_triton``) that reads each row
once forward and once backward, upcasting as it reads, with no fp32 copy; inside a compiled model it is
one node. The vocabulary is padded to a multiple of 128 for the three matmuls (the padded columns take no
probability and get no gradient). Measured on an H200 (``benchmarks/RESULTS.md``): alone, at GPT-2 124M's
shapes, this chunked path 19.6 ms and the plain compiled loss 7.9-9.7 ms, an unpadded vocabulary's
matmuls 95-151 TFLOP/s against 690 padded; in the whole compiled 124M step, the logits path with
Inductor's cross-entropy (before the operator) 35.4 ms against the chunked path's 35.9, its cross-entropy
kernels ~4 ms of it. The operator's kernels are not measured on a GPU yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.models.triton_support import can_build_triton_kernels, naming_triton_failures

IGNORE_INDEX = -100
LM_LOSS_PATHS = ("auto", "chunked", "logits")
VOCAB_MULTIPLE = 128  # the logits path pads the vocabulary of its matmuls to this multiple
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
        dtype = _matmul_dtype(hidden, weight)  # softmax in fp32
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


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: the autocast dtype when autocast is on, as nn.Linear would."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def lm_loss_problem(value: str) -> str | None:
    """The config error for ``model.lm_loss=value``, or None when it is one of LM_LOSS_PATHS."""
    if value in LM_LOSS_PATHS:
        return None
    return (f"model.lm_loss must be one of {', '.join(LM_LOSS_PATHS)} (auto: logits on CUDA under bf16, chunked "
            f"elsewhere), got {value!r}")


def lm_loss_path(setting: str, device_type: str, dtype: torch.dtype) -> str:
    """``chunked`` or ``logits`` for ``setting`` (one of LM_LOSS_PATHS), on ``device_type`` with matmuls in
    ``dtype``. ``auto`` takes the logits path on CUDA with bf16 matmuls, when its kernels can be built there
    (``can_build_triton_kernels``); everywhere else the chunked one: CPUs, where it measured best; MPS, fp16
    (its gradients would need the loss scale to stay out of fp16's underflow) and fp32, not measured."""
    if setting not in LM_LOSS_PATHS:
        raise ValueError(f"lm_loss must be one of {', '.join(LM_LOSS_PATHS)}, got {setting!r}")
    if setting != "auto":
        return setting
    if device_type == "cuda" and dtype == torch.bfloat16 and can_build_triton_kernels():
        return "logits"
    return "chunked"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def _check_vocab(logits: torch.Tensor, vocab: int) -> None:
    if not 0 < vocab <= logits.shape[-1]:
        raise ValueError(f"vocab must be in 1..{logits.shape[-1]} (the logits' width), got {vocab}")


def _rows_in_torch(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_vocab(logits, vocab)
    x = logits[:, :vocab].to(_accumulation_dtype(logits.dtype))
    lse = torch.logsumexp(x, dim=-1)
    # A label outside the vocabulary (other than -100) gives a NaN loss, which the training loop's check
    # stops on before the update: no host read here, and no silent clamp to a real token.
    in_range = (labels >= 0) & (labels < vocab)
    picked = x.gather(1, torch.where(in_range, labels, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(in_range, lse - picked, torch.where(labels == IGNORE_INDEX, 0.0, float("nan")))
    return loss.to(lse.dtype), lse


def _rows_backward_in_torch(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                            vocab: int) -> torch.Tensor:
    _check_vocab(logits, vocab)
    x = logits[:, :vocab].to(lse.dtype)
    in_range = (labels >= 0) & (labels < vocab)
    g = torch.where(labels == IGNORE_INDEX, 0.0, torch.where(in_range, grad.to(lse.dtype), float("nan"))).unsqueeze(1)
    d = torch.exp(x - lse.unsqueeze(1))
    d.scatter_add_(1, torch.where(in_range, labels, 0).unsqueeze(1), torch.full_like(g, -1.0))
    return F.pad(d * g, (0, logits.shape[1] - vocab)).to(logits.dtype)


@torch.library.custom_op("lmforge::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy of ``[N, padded]`` logits whose columns from ``vocab`` on are padding (they
    take no probability): the loss (0 where the label is ``-100``, NaN where it is outside the vocabulary)
    and the log-sum-exp, both ``[N]`` in fp32
    (fp64 for fp64 logits). The log-sum-exp is kept for the backward and has no gradient of its own. This
    implementation serves every device; on CUDA the Triton kernels of ``lmforge.models.losses_triton`` run
    instead, which never make a 32-bit copy of the logits."""
    return _rows_in_torch(logits, labels, vocab)


@torch.library.custom_op("lmforge::cross_entropy_rows_backward", mutates_args=())
def cross_entropy_rows_backward(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                vocab: int) -> torch.Tensor:
    """Gradient of ``sum(grad * loss)`` for ``cross_entropy_rows``: ``(softmax - one_hot) * grad`` per token,
    0 on ignored tokens and in the padded columns, in the logits' dtype."""
    return _rows_backward_in_torch(grad, logits, labels, lse, vocab)


@cross_entropy_rows.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _accumulation_dtype(logits.dtype)
    return logits.new_empty(logits.shape[0], dtype=acc), logits.new_empty(logits.shape[0], dtype=acc)


@cross_entropy_rows_backward.register_fake
def _(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, vocab: int) -> torch.Tensor:
    return logits.new_empty(logits.shape)  # row-major, as both implementations return it


def _kernels():
    """The Triton kernels' module, or None where Triton is not installed (the PyTorch implementation runs)."""
    try:
        from lmforge.models import losses_triton
    except ImportError:
        return None
    return losses_triton


_LOGITS_FIX = "Set model.lm_loss=chunked to use the chunked loss (no Triton)"


@cross_entropy_rows.register_kernel("cuda")
def _rows_cuda(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_vocab(logits, vocab)
    kernels = _kernels()
    if kernels is None or not kernels.supports(logits):
        return _rows_in_torch(logits, labels, vocab)
    with naming_triton_failures("The logits loss", _LOGITS_FIX):
        return kernels.cross_entropy_rows(logits, labels, vocab)


@cross_entropy_rows_backward.register_kernel("cuda")
def _rows_backward_cuda(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                        vocab: int) -> torch.Tensor:
    _check_vocab(logits, vocab)
    kernels = _kernels()
    if kernels is None or not kernels.supports(logits):
        return _rows_backward_in_torch(grad, logits, labels, lse, vocab)
    with naming_triton_failures("The logits loss", _LOGITS_FIX):
        return kernels.cross_entropy_rows_backward(grad, logits, labels, lse, vocab)


def _setup_context(ctx, inputs, output) -> None:
    logits, labels, vocab = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.vocab = vocab


def _backward(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor | None):
    logits, labels, lse = ctx.saved_tensors
    return cross_entropy_rows_backward(grad_loss, logits, labels, lse, ctx.vocab), None, None


cross_entropy_rows.register_autograd(_backward, setup_context=_setup_context)


def _logits_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The logits path: the whole ``[tokens, vocab]`` logits in the matmuls' dtype, the vocabulary padded to a
    multiple of VOCAB_MULTIPLE for the three matmuls (the padded weight rows are zeros, their columns take no
    probability, and the pad's backward drops their gradient), and ``cross_entropy_rows``."""
    dtype = _matmul_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        vocab = weight.shape[0]
        w = weight.to(dtype)
        pad = -vocab % VOCAB_MULTIPLE
        if pad:
            w = F.pad(w, (0, 0, 0, pad))
        logits = hidden.to(dtype) @ w.t()
        losses, _ = cross_entropy_rows(logits, labels, vocab)
        return losses.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)  # mean over valid labels, 0 if none


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         rows: int | None = None, path: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` = ignored).

    ``hidden`` is ``[N, d]`` (or ``[B, T, d]``), ``weight`` ``[vocab, d]``, ``labels`` ``[N]`` (or
    ``[B, T]``); ``rows`` overrides the chunk size in tokens; ``path`` is one of LM_LOSS_PATHS (see the
    module's docstring).
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if lm_loss_path(path, hidden.device.type, _matmul_dtype(hidden, weight)) == "logits":
        return _logits_cross_entropy(hidden, weight, labels)
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
