"""The fused, chunked LM-head cross-entropy equals the plain logits + F.cross_entropy path."""

import pytest
import torch
import torch.nn.functional as F

from lmforge.models.losses import _LinearCrossEntropy, chunk_rows, linear_cross_entropy


def _case(n: int, d: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100  # ignored positions
    return hidden, weight, labels


@pytest.mark.parametrize("rows", [1, 5, 37, 64, None])  # chunks of one token, ragged chunks, one chunk
def test_loss_and_gradients_match_plain_cross_entropy(rows):
    hidden, weight, labels = _case(37, 16, 50)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h1 @ w1.t(), labels, ignore_index=-100)
    (ref * 2.5).backward()  # a scaled loss, as with gradient accumulation
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_cross_entropy(h2, w2, labels, rows)
    (out * 2.5).backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-10, atol=1e-12)


def test_ignored_tokens_dropped_before_the_head_or_masked_in_the_chunks_agree():
    """On CPUs tokens without a label are dropped before the head; accelerators mask them inside the
    chunks (no host sync). Both give the plain loss and gradients, and the dropped tokens get zero."""
    hidden, weight, labels = _case(40, 16, 50, seed=3)
    labels[:30] = -100  # mostly prompt, as in SFT
    results = []
    for fn in (lambda h, w: linear_cross_entropy(h, w, labels), lambda h, w: _LinearCrossEntropy.apply(h, w, labels, 7)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w)
        out.backward()
        results.append((out.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(results[0][1][:30]) == 0 and torch.count_nonzero(results[0][1][30:]) > 0


def test_batched_shapes_extreme_logits_and_no_valid_labels():
    hidden, weight, labels = _case(24, 8, 30, seed=1)
    hidden = hidden * 200  # logits in the thousands: must not overflow
    ref = F.cross_entropy((hidden @ weight.t()), labels, ignore_index=-100)
    out = linear_cross_entropy(hidden.view(4, 6, 8), weight, labels.view(4, 6), rows=5)
    assert torch.isfinite(out) and torch.allclose(out, ref)
    h = hidden.clone().requires_grad_()
    empty = linear_cross_entropy(h, weight, torch.full_like(labels, -100))
    empty.backward()
    assert float(empty) == 0.0 and torch.count_nonzero(h.grad) == 0


def test_no_grad_evaluation_and_bf16_autocast():
    hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(64, 32, 100, seed=2))
    ref = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100)
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(hidden, weight, labels, rows=16), ref, rtol=1e-5)
    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, weight, labels, rows=16)
    out.backward()
    assert out.dtype == torch.float32 and abs(float(out) - float(ref)) < 0.05
    assert torch.isfinite(h.grad).all() and h.grad.dtype == torch.float32


def test_chunk_rows_keeps_matmuls_large_and_memory_bounded():
    cpu = torch.device("cpu")
    assert chunk_rows(100, 50257, cpu) == 100  # never more rows than there are
    assert chunk_rows(8192, 50257, cpu) == 512  # big vocabularies: a minimum inner dimension
    assert chunk_rows(8192, 8192, cpu) * 8192 <= 1 << 23  # otherwise bounded to ~32 MB of fp32 logits
