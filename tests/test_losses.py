"""The LM-head cross-entropy: both paths (fused chunks; whole logits, compiled) equal the plain F.cross_entropy."""

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


class _RecordMatmuls(torch.overrides.TorchFunctionMode):
    """Records the output shape of every matrix product run inside it."""

    def __init__(self, shapes: list):
        super().__init__()
        self.shapes = shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm):
            self.shapes.append(tuple(out.shape))
        return out


def test_logits_path_matches_plain_cross_entropy_with_a_padded_vocabulary():
    """lm_loss=logits (CUDA's path) pads the vocabulary to VOCAB_MULTIPLE for its matmuls: the padded
    columns must take no probability and give the real weight rows exactly the plain gradients."""
    hidden, weight, labels = _case(37, 16, 50, seed=4)  # 50 -> padded to 128
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h1 @ w1.t(), labels, ignore_index=-100)
    (ref * 2.5).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    shapes = []
    with _RecordMatmuls(shapes):
        out = linear_cross_entropy(h2, w2, labels, path="logits")
    assert shapes == [(37, 128)]  # the head's matmul ran on the padded vocabulary
    (out * 2.5).backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert w2.grad.shape == w1.grad.shape
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-10, atol=1e-12)
    h3 = hidden.clone().requires_grad_()
    empty = linear_cross_entropy(h3, weight, torch.full_like(labels, -100), path="logits")
    empty.backward()
    assert float(empty) == 0.0 and torch.count_nonzero(h3.grad) == 0


def test_logits_path_under_torch_compile_and_bf16_matches_the_chunked_path(monkeypatch):
    """What CUDA runs: the logits loss compiled on its own (here by Inductor's CPU backend: the device check
    is pointed at the CPU), matmuls in bf16; the loss and both gradients agree with the chunked path at
    bf16's precision."""
    from lmforge.models import losses

    monkeypatch.setattr(losses, "_COMPILE_ON", ("cpu",))
    monkeypatch.setattr(losses, "_compiled_logits_loss", None)
    hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(96, 32, 200, seed=5))
    results = []
    for fn in (lambda h, w: linear_cross_entropy(h, w, labels, path="chunked"),
               lambda h, w: linear_cross_entropy(h, w, labels, path="logits")):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(h, w)
        out.backward()
        results.append((out.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert losses._compiled_logits_loss is not None  # it went through the compiled function


def test_lm_loss_auto_picks_logits_only_for_bf16_on_cuda_where_it_can_be_built(monkeypatch):
    from lmforge.models import losses
    from lmforge.models.losses import lm_loss_path

    monkeypatch.setattr(losses, "can_compile_logits_loss", lambda: True)
    assert lm_loss_path("auto", "cuda", torch.bfloat16) == "logits"
    assert lm_loss_path("auto", "cuda", torch.float16) == "chunked"  # not measured; fp16 gradients underflow
    assert lm_loss_path("auto", "cuda", torch.float32) == "chunked"
    assert lm_loss_path("auto", "cpu", torch.bfloat16) == "chunked"
    assert lm_loss_path("auto", "mps", torch.bfloat16) == "chunked"
    assert lm_loss_path("chunked", "cuda", torch.bfloat16) == "chunked"
    assert lm_loss_path("logits", "cpu", torch.float32) == "logits"
    with pytest.raises(ValueError, match="lm_loss must be one of"):
        lm_loss_path("fast", "cpu", torch.float32)
    monkeypatch.setattr(losses, "can_compile_logits_loss", lambda: False)  # no Triton or no C compiler
    assert lm_loss_path("auto", "cuda", torch.bfloat16) == "chunked"


def test_the_loss_path_resolves_inside_one_compiled_graph():
    """On CUDA, auto's answer needs a look at the file system (Triton, a C compiler); inside the compiled
    model that lookup must not break the graph (fullgraph=True raises on a graph break)."""
    from lmforge.models.losses import lm_loss_path

    def pick(x):
        return x + 1 if lm_loss_path("auto", "cuda", torch.bfloat16) == "logits" else x - 1

    expected = pick(torch.zeros(2))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2)), expected)


def test_the_logits_kernels_need_triton_and_a_c_compiler(monkeypatch):
    from lmforge.models import losses

    def check(cc_env, on_path, triton):
        losses._logits_toolchain_present.cache_clear()
        monkeypatch.delenv("CC", raising=False)
        if cc_env:
            monkeypatch.setenv("CC", cc_env)
        monkeypatch.setattr(losses.shutil, "which", lambda name: f"/usr/bin/{name}" if name in on_path else None)
        monkeypatch.setattr(losses.importlib.util, "find_spec", lambda name: object() if triton else None)
        return losses.can_compile_logits_loss()

    try:
        assert check("", {"gcc"}, triton=True)
        assert check("/opt/clang", set(), triton=True)
        assert not check("", set(), triton=True)  # no C compiler
        assert not check("", {"cc"}, triton=False)  # no Triton
    finally:
        losses._logits_toolchain_present.cache_clear()


def test_gpt_model_takes_its_loss_path_from_model_lm_loss(monkeypatch):
    """model.lm_loss reaches the GPT's loss: the logits path runs only when asked for, and both paths give
    the same loss and gradients; a bad value is a config error naming the choices."""
    from lmforge.config import load_config
    from lmforge.errors import LMForgeError
    from lmforge.models import losses
    from lmforge.models.gpt import GPT, GPTConfig

    calls = []
    real = losses._logits_cross_entropy
    monkeypatch.setattr(losses, "_logits_cross_entropy", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (2, 16))}
    batch["labels"] = batch["input_ids"].clone()
    grads = []
    for path, expected_calls in (("chunked", 0), ("logits", 1)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=100, n_positions=16, n_embd=32, n_layer=1, n_head=2, lm_loss=path))
        loss, _ = model(batch)
        loss.backward()
        assert len(calls) == expected_calls
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(LMForgeError, match="model.lm_loss must be one of auto, chunked, logits"):
        load_config("go_coder_tiny", ["model.vocab_size=64", "model.lm_loss=fused"])
