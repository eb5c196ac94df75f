"""The LM-head cross-entropy: both paths (fused chunks; whole logits and the cross-entropy operator) equal
the plain F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from lmforge.models.losses import _LinearCrossEntropy, chunk_rows, linear_cross_entropy
from tests.train_helpers import check_under_triton_interpreter


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


def test_logits_path_under_torch_compile_and_bf16_matches_the_chunked_path():
    """What CUDA runs inside a compiled model: the logits path in one graph (fullgraph: the cross-entropy
    operator is a single node), matmuls in bf16; the loss and both gradients agree with the chunked path at
    bf16's precision."""
    hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _case(96, 32, 200, seed=5))
    torch._dynamo.reset()
    traced = []

    def inductor_recording(gm, example_inputs):
        traced.extend(node.target for node in gm.graph.nodes)
        return torch._inductor.compile(gm, example_inputs)

    logits_path = torch.compile(lambda h, w: linear_cross_entropy(h, w, labels, path="logits"), fullgraph=True,
                                backend=inductor_recording)
    results = []
    for fn in (lambda h, w: linear_cross_entropy(h, w, labels, path="chunked"), logits_path):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(h, w)
        out.backward()
        results.append((out.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert traced.count(torch.ops.lmforge.cross_entropy_rows.default) == 1


def test_cross_entropy_operator_passes_torch_library_opcheck():
    """Both operators' fake kernels, autograd and schemas agree with what they do (torch.library.opcheck),
    for row-major and transposed logits."""
    from lmforge.models.losses import cross_entropy_rows, cross_entropy_rows_backward

    torch.manual_seed(0)
    labels = torch.tensor([0, 3, -100, 9, 8, -100])
    for logits in (torch.randn(6, 16, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64).t()):
        torch.library.opcheck(cross_entropy_rows, (logits.requires_grad_(), labels, 10))
        _, lse = cross_entropy_rows(logits.detach(), labels, 10)
        torch.library.opcheck(cross_entropy_rows_backward, (torch.randn(6, dtype=torch.float64), logits.detach(),
                                                            labels, lse, 10))
    loss, lse = cross_entropy_rows(logits, labels, 10)
    assert not lse.requires_grad and loss.requires_grad
    torch.testing.assert_close(lse, torch.logsumexp(logits[:, :10].detach(), -1))
    with pytest.raises(ValueError, match="vocab must be in 1..16"):
        cross_entropy_rows(logits.detach(), labels, 17)


def test_a_label_outside_the_vocabulary_gives_nan_not_a_clamped_token():
    """A label past the vocabulary, or negative other than -100 (a tokenizer that does not match the model),
    must not be read as token 0 or a padded column: its loss and gradient row are NaN, which the training
    loop's non-finite check stops on before the update; the other rows are unaffected."""
    from lmforge.models.losses import cross_entropy_rows

    torch.manual_seed(0)
    logits = torch.randn(4, 16, requires_grad=True)
    labels = torch.tensor([2, 12, -1, -100])  # 12 is a padded column (vocab 10)
    loss, _ = cross_entropy_rows(logits, labels, 10)
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0
    torch.testing.assert_close(loss[0], F.cross_entropy(logits[:1, :10], labels[:1]))
    loss.sum().backward()
    assert torch.isnan(logits.grad[1:3, :10]).all() and torch.isfinite(logits.grad[[0, 3]]).all()


def test_triton_cross_entropy_kernels_match_the_pytorch_implementation(tmp_path):
    """The CUDA kernels (run by Triton's interpreter on CPU tensors): per-token loss, log-sum-exp and the
    gradient against the PyTorch implementation, across the kernel's vocabulary blocks, with ignored tokens,
    a label in the last real column, extreme logits, and padded columns that must get exactly 0."""
    check_under_triton_interpreter(
        tmp_path,
        "import torch\n"
        "_empty = torch.empty  # fresh outputs start as NaN: a column the kernels fail to write shows\n"
        "torch.empty = lambda *a, **k: _empty(*a, **k).fill_(float('nan'))\n"
        "from lmforge.models import losses_triton\n"
        "from lmforge.models.losses import _rows_in_torch, _rows_backward_in_torch\n"
        "torch.manual_seed(0)\n"
        "for n, vocab, padded, dtype in [(7, 5000, 5120, torch.bfloat16), (5, 300, 384, torch.float32),\n"
        "                                (3, 4096, 4096, torch.float16)]:\n"
        "    x = (4 * torch.randn(n, padded)).to(dtype)\n"
        "    x[0, :vocab] = 0; x[1, 17] = 60.0  # all equal; one dominant logit\n"
        "    x[:, vocab:] = 1e4 if dtype != torch.float16 else 6e4  # padding must not count, however large\n"
        "    labels = torch.randint(0, vocab, (n,)); labels[2] = -100; labels[1] = vocab - 1\n"
        "    loss, lse = losses_triton.cross_entropy_rows(x, labels, vocab)\n"
        "    ref_loss, ref_lse = _rows_in_torch(x, labels, vocab)\n"
        "    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)\n"
        "    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)\n"
        "    assert loss[2] == 0\n"
        "    g = torch.randn(n)\n"
        "    grad = losses_triton.cross_entropy_rows_backward(g, x, labels, lse, vocab)\n"
        "    ref = _rows_backward_in_torch(g, x, labels, ref_lse, vocab)\n"
        "    assert grad.dtype == dtype and grad.shape == x.shape\n"
        "    torch.testing.assert_close(grad.float(), ref.float(), atol=2e-3, rtol=1e-2)\n"
        "    assert torch.count_nonzero(grad[:, vocab:]) == 0 and torch.count_nonzero(grad[2]) == 0\n"
        "x = torch.randn(3, 8192); x[:, :4096] = float('-inf')  # a first block of -inf: no NaN\n"
        "labels = torch.tensor([5000, 8000, -3])  # 8000: a padded column; -3: not the ignore index\n"
        "loss, lse = losses_triton.cross_entropy_rows(x, labels, 8000)\n"
        "ref_loss, ref_lse = _rows_in_torch(x, labels, 8000)\n"
        "torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)\n"
        "torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5, equal_nan=True)\n"
        "assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()\n"
        "grad = losses_triton.cross_entropy_rows_backward(torch.ones(3), x, labels, lse, 8000)\n"
        "assert torch.isfinite(grad[0]).all() and torch.isnan(grad[1:, :8000]).all()\n"
        "print('kernels match')\n")


def test_triton_cross_entropy_kernels_build_for_hopper_with_vector_loads():
    """Triton compiles both kernels for an H100/H200 (sm_90) here, without a GPU (the interpreter above does not
    catch what only the compiler checks), and the rows are read and written 16 bytes at a time: with
    16-byte-aligned rows (what Triton's launcher sees for lmforge's padded logits), the masks on the padded
    width keep the loads vectorised where a mask on GPT-2's odd vocabulary (50257) would make them 2-byte."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmforge.models import losses_triton

    aligned = [["tt.divisibility", 16]]
    kernels = {
        losses_triton._forward_kernel: ["*bf16", "*i64", "*fp32", "*fp32", "i32", "i32", "i32"],
        losses_triton._backward_kernel: ["*fp32", "*bf16", "*i64", "*fp32", "*bf16", "i32", "i32", "i32", "i32"],
    }
    for kernel, types in kernels.items():
        names = kernel.arg_names
        signature = dict(zip(names, types + ["constexpr", "constexpr"], strict=True))
        # what the launcher specialises: pointers and the padded width / strides divisible by 16, not vocab
        attrs = {(i,): aligned for i, name in enumerate(names) if name not in ("vocab", "IGNORE", "BLOCK")}
        source = ASTSource(fn=kernel, signature=signature, constexprs={"IGNORE": -100, "BLOCK": losses_triton.BLOCK_V},
                           attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, kernel.fn.__name__  # the row, 8 bf16 values per load
    assert re.search(r"st\.global\.v4\.b32", ptx)  # the backward writes the gradient 8 values at a time


def test_lm_loss_auto_picks_logits_only_for_bf16_on_cuda_where_it_can_be_built(monkeypatch):
    from lmforge.models import losses
    from lmforge.models.losses import lm_loss_path

    monkeypatch.setattr(losses, "can_build_triton_kernels", lambda: True)
    assert lm_loss_path("auto", "cuda", torch.bfloat16) == "logits"
    assert lm_loss_path("auto", "cuda", torch.float16) == "chunked"  # not measured; fp16 gradients underflow
    assert lm_loss_path("auto", "cuda", torch.float32) == "chunked"
    assert lm_loss_path("auto", "cpu", torch.bfloat16) == "chunked"
    assert lm_loss_path("auto", "mps", torch.bfloat16) == "chunked"
    assert lm_loss_path("chunked", "cuda", torch.bfloat16) == "chunked"
    assert lm_loss_path("logits", "cpu", torch.float32) == "logits"
    with pytest.raises(ValueError, match="lm_loss must be one of"):
        lm_loss_path("fast", "cpu", torch.float32)
    monkeypatch.setattr(losses, "can_build_triton_kernels", lambda: False)  # no Triton or no C compiler
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


def test_the_triton_kernels_need_triton_and_a_c_compiler(monkeypatch):
    from lmforge.models import triton_support

    def check(cc_env, on_path, triton):
        triton_support._toolchain_present.cache_clear()
        monkeypatch.delenv("CC", raising=False)
        if cc_env:
            monkeypatch.setenv("CC", cc_env)
        monkeypatch.setattr(triton_support.shutil, "which",
                            lambda name: f"/usr/bin/{name}" if name in on_path else None)
        monkeypatch.setattr(triton_support.importlib.util, "find_spec", lambda name: object() if triton else None)
        return triton_support.can_build_triton_kernels()

    try:
        assert check("", {"gcc"}, triton=True)
        assert check("/opt/clang", set(), triton=True)
        assert not check("", set(), triton=True)  # no C compiler
        assert not check("", {"cc"}, triton=False)  # no Triton
    finally:
        triton_support._toolchain_present.cache_clear()


def test_a_triton_kernel_that_fails_on_the_gpu_names_the_setting_that_avoids_it(monkeypatch):
    """A Triton failure inside the CUDA implementations of lmforge's operators (its compiler, ptxas, a kernel
    needing more shared memory than the GPU has) is an LMForgeError naming the kernels and the setting that avoids
    them; any other error (CUDA out of memory, a bad input) passes through as it was. The CUDA implementations are
    called directly on CPU tensors with kernels that fail."""
    from types import SimpleNamespace

    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from lmforge.errors import LMForgeError
    from lmforge.models import losses, mhc

    def failing(error):
        def kernel(*args, **kwargs):
            raise error
        return kernel

    logits, labels = torch.randn(4, 128), torch.tensor([1, 2, -100, 3])
    for error in (OutOfResources(300000, 232448, "shared memory"), CompilationError("", None, "unsupported")):
        kernels = SimpleNamespace(supports=lambda x: True, cross_entropy_rows=failing(error),
                                  cross_entropy_rows_backward=failing(error))
        monkeypatch.setattr(losses, "_kernels", lambda: kernels)
        with pytest.raises(LMForgeError, match=f"The logits loss's Triton kernels failed on this GPU \\("
                                               f"{type(error).__name__}.*model.lm_loss=chunked"):
            losses._rows_cuda(logits, labels, 100)
        with pytest.raises(LMForgeError, match="model.lm_loss=chunked"):
            losses._rows_backward_cuda(torch.ones(4), logits, labels, torch.zeros(4), 100)
    stream, y = torch.randn(3, 4, 8), torch.randn(3, 8)
    h_res, h_post = torch.rand(3, 4, 4), torch.rand(3, 4)
    statics = (torch.zeros(24, 32), torch.ones(3), torch.zeros(4), torch.zeros(4), torch.zeros(4, 4))
    error = OutOfResources(300000, 232448, "shared memory")
    kernels = SimpleNamespace(mix_out=failing(error), mix_out_backward=failing(error), projection=failing(error),
                              mix_in_grad_h=failing(error))
    monkeypatch.setattr(mhc, "_mix_kernels", lambda stream: kernels)
    for call in (lambda: mhc._mix_out_cuda(h_res, stream, h_post, y),
                 lambda: mhc._mix_out_backward_cuda(torch.randn(3, 4, 8), h_res, stream, h_post, y),
                 lambda: mhc._pre_cuda(stream, *statics, 5, 1e-6),
                 lambda: mhc._pre_backward_cuda(y, torch.rand(3, 4), h_post, h_res, None, stream, *statics,
                                                torch.zeros(3, 24), torch.ones(3, 1), torch.rand(3, 4), 5)):
        with pytest.raises(LMForgeError, match="mHC's Triton kernels failed.*model.mhc_kernels=torch"):
            call()
    kernels.mix_out = failing(RuntimeError("CUDA out of memory"))  # not Triton's: unchanged
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        mhc._mix_out_cuda(h_res, stream, h_post, y)


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
