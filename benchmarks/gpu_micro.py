"""The GPU choices of issue 19, item 2, measured one by one on a CUDA device (no training loop, no compile
of a whole model): what each costs at GPT-2 124M's shapes (16 x 1024 tokens, width 768, 12 heads of 64)
and at the 1.3B preset's (width 2048, 16 heads of 128).

1. **The LM head + loss**, forward and backward, bf16 autocast over an fp32 weight: lmforge's two paths
   (``linear_cross_entropy`` with ``path="chunked"`` and ``path="logits"``, the latter padding the
   vocabulary to a multiple of 128 inside the loss), the plain path (``F.cross_entropy`` on bf16 logits),
   and the plain path compiled; time and peak memory, at the real vocabulary (50257) and at a weight
   already padded to 50304 (128 x 393).
2. **The vocabulary matmul alone**, 50257 against 50304 columns.
3. **Attention** (``F.scaled_dot_product_attention``, causal, bf16) forward + backward under each SDPA
   backend the device offers: flash, cuDNN, memory-efficient.
4. **mHC's Sinkhorn operator** on the GPU (the Triton kernels): error against the unrolled reference
   in fp64, forward + backward, and its time against the unrolled eager rounds.
5. **mHC's sub-layer work** at ``rlm_mhc_125m``'s shapes (32 x 1024 tokens, 4 flows of 768, bf16 stream): each
   Triton kernel alone (time, and GB/s for the bytes it must move), and one sub-layer's mHC work (coefficients
   and mixing, around a cheap stand-in for attention) forward + backward through the operators
   (``model.mhc_kernels=triton``) against the PyTorch ops compiled by Inductor (``torch``), with the relative
   difference of the output and of every gradient.
6. **Rotary embeddings** at the Llama models' shapes (125M: 32 x 1024, 12 heads of 64; 1.3B: 8 x 2048, 16
   heads of 128): the attention's input work (split the q/k/v projection, rotate q and k, SDPA) compiled,
   forward + backward, with the rotation as lmforge does it now (in the projection's [B, T, heads, D] layout,
   half-width tables) against the way before (after the transpose to [B, heads, T, D], full-width tables),
   and SDPA alone on the same q, k, v as the floor.

Times are CUDA-event medians over ``--repeats`` after warm-up; a matmul peak is measured first
(``lmforge.device.measure_matmul_flops``). Usage:

    python benchmarks/gpu_micro.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from lmforge.device import measure_matmul_flops


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, by events, after three warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """Peak CUDA memory allocated during one ``fn()`` above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def loss_paths(tokens: int, width: int, vocabs: list[int], repeats: int) -> list[dict]:
    from lmforge.models.losses import linear_cross_entropy

    def plain(h, w, y):
        with torch.autocast("cuda", torch.bfloat16):
            logits = h @ w.t()
        return F.cross_entropy(logits.float(), y)

    compiled = torch.compile(plain, dynamic=False)
    rows = []
    for vocab in vocabs:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (0.02 * torch.randn(vocab, width, device="cuda", generator=g)).requires_grad_()  # fp32 master
        y = torch.randint(0, min(vocab, 50257), (tokens,), device="cuda", generator=g)

        def lmforge(path):
            def run():
                with torch.autocast("cuda", torch.bfloat16):
                    linear_cross_entropy(h, w, y, path=path).backward()
            return run

        ref = None
        for name, fn in (("lmforge chunked", lmforge("chunked")), ("lmforge logits", lmforge("logits")),
                         ("plain bf16 logits", lambda: plain(h, w, y).backward()),
                         ("plain, compiled", lambda: compiled(h, w, y).backward())):
            h.grad = w.grad = None
            fn()
            grads = (h.grad.float().clone(), w.grad.float().clone())
            if ref is None:
                ref = grads
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, ref))
            ms = time_ms(fn, repeats)
            mem = peak_mib(fn)
            flops = 3 * 2 * tokens * width * vocab
            rows.append({"what": "lm_head_loss", "vocab": vocab, "path": name, "ms": round(ms, 3),
                         "tflops": round(flops / (ms / 1e3) / 1e12, 1), "peak_mib": round(mem, 1),
                         "grad_rel_err_vs_chunked": float(f"{err:.2e}")})
    return rows


def vocab_matmul(tokens: int, width: int, vocabs: list[int], repeats: int) -> list[dict]:
    rows = []
    for vocab in vocabs:
        h = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("h @ W.T", lambda: h @ w.t()), ("g @ W", lambda: g @ w), ("g.T @ h", lambda: g.t() @ h)):
            ms = time_ms(fn, repeats)
            rows.append({"what": "vocab_matmul", "vocab": vocab, "op": name, "ms": round(ms, 3),
                         "tflops": round(2 * tokens * width * vocab / (ms / 1e3) / 1e12, 1)})
    return rows


def attention(batch: int, heads: int, seq: int, head_dim: int, repeats: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    rows, ref = [], None
    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for name, backend in backends:
        def run():
            q.grad = k.grad = v.grad = None
            if backend is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
            return out
        try:
            out = run().float()
        except RuntimeError as e:  # this backend does not take these shapes on this device
            rows.append({"what": "sdpa", "shape": [batch, heads, seq, head_dim], "backend": name,
                         "error": str(e).splitlines()[0][:160]})
            continue
        if ref is None:
            ref = out
        ms = time_ms(run, repeats)
        # causal: half of the 4 * B * H * T^2 * D forward FLOPs, and backward 2.5x the forward
        flops = 3.5 * 4 * batch * heads * seq * seq * head_dim / 2
        rows.append({"what": "sdpa", "shape": [batch, heads, seq, head_dim], "backend": name, "ms": round(ms, 3),
                     "tflops": round(flops / (ms / 1e3) / 1e12, 1),
                     "out_rel_err_vs_default": float(f"{((out - ref).norm() / ref.norm()).item():.2e}")})
    return rows


def rotary(batch: int, heads: int, seq: int, head_dim: int, repeats: int) -> list[dict]:
    from lmforge.models.gpt import _rotary

    g = torch.Generator(device="cuda").manual_seed(0)
    width = heads * head_dim
    qkv = torch.randn(batch, seq, 3 * width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim)
    freqs = torch.arange(seq, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    half = (freqs.cos(), freqs.sin())
    full = (torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin())
    positions = torch.arange(seq, device="cuda")

    def split(x):
        q, k, v = x.split(width, dim=-1)
        return (t.view(batch, seq, heads, head_dim) for t in (q, k, v))

    def now(x):  # lmforge.models.gpt.Attention: rotate, then transpose
        q, k, v = split(x)
        cos, sin = (t[positions].to(x.dtype).unsqueeze(-2) for t in half)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    def before(x):  # the code before: transpose, then rotate with full-width tables
        q, k, v = (t.transpose(1, 2) for t in split(x))
        cos, sin = (t[positions].to(x.dtype) for t in full)

        def rotate_half(t):
            t1, t2 = t.chunk(2, dim=-1)
            return torch.cat((-t2, t1), dim=-1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def floor(x):  # no rotation: what the attention's input work costs without it
        q, k, v = (t.transpose(1, 2) for t in split(x))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows, ref = [], None
    for name, fn in (("now", now), ("before", before), ("sdpa_only", floor)):
        compiled = torch.compile(fn)

        def run():
            qkv.grad = None
            out = compiled(qkv)
            out.backward(grad)
            return out
        out = run().float()
        if ref is None:
            ref = out
        rows.append({"what": "rotary", "shape": [batch, heads, seq, head_dim], "variant": name,
                     "ms": round(time_ms(run, repeats), 3),
                     "out_rel_err_vs_now": float(f"{((out - ref).norm() / ref.norm()).item():.2e}")})
    return rows


def sinkhorn(tokens: int, repeats: int) -> list[dict]:
    from lmforge.models.mhc import sinkhorn as op
    from lmforge.models.mhc import sinkhorn_log

    def unrolled(x, iters):  # the eager rounds in log space (columns, then rows, as lmforge's), unfused
        for _ in range(iters):
            x = x - torch.logsumexp(x, dim=-2, keepdim=True)
            x = x - torch.logsumexp(x, dim=-1, keepdim=True)
        return x.exp()

    rows = []
    x = torch.randn(tokens, 4, 4, device="cuda") * 3
    w = torch.randn(tokens, 4, 4, device="cuda")
    x64 = x.double().cpu().requires_grad_()
    ref_out = unrolled(x64, 20)
    ref_grad, = torch.autograd.grad((ref_out * w.double().cpu()).sum(), x64)
    xg = x.clone().requires_grad_()
    out = op(xg, 20)
    grad, = torch.autograd.grad((out * w).sum(), xg)
    def rel(a, b):
        return float(f"{((a.double().cpu() - b).norm() / b.norm()).item():.2e}")

    cpu_op = sinkhorn_log(x.double().cpu(), 20)  # the CPU's vectorised implementation of the operator, fp64
    rows.append({"what": "sinkhorn_check", "tokens": tokens, "via": "lmforge::sinkhorn (cuda)",
                 "out_rel_err_fp64": rel(out, ref_out), "grad_rel_err_fp64": rel(grad, ref_grad),
                 "max_abs_diff_vs_cpu_op": float(f"{(out.double().cpu() - cpu_op).abs().max():.2e}")})
    for name, fn in (("lmforge::sinkhorn", lambda: op(xg, 20)), ("unrolled eager", lambda: unrolled(xg, 20))):
        def fwd_bwd():
            torch.autograd.grad((fn() * w).sum(), xg)
        rows.append({"what": "sinkhorn_time", "tokens": tokens, "via": name,
                     "ms_fwd_bwd": round(time_ms(fwd_bwd, repeats), 3)})
    return rows


def mhc_sub_layer(tokens: int, flows: int, width: int, repeats: int) -> list[dict]:
    from lmforge.models import mhc_triton
    from lmforge.models.mhc import MHCLayer

    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(tokens, flows, width, device=dev, dtype=torch.bfloat16)
    phi = 0.02 * torch.randn(flows * flows + 2 * flows, flows * width, device=dev)
    h_pre = torch.rand(tokens, flows, device=dev)
    h_post = 2 * torch.rand(tokens, flows, device=dev)
    h_res = torch.softmax(torch.randn(tokens, flows, flows, device=dev), -1)
    y = torch.randn(tokens, width, device=dev, dtype=torch.bfloat16)
    g_out = torch.randn_like(x)
    g_in = torch.randn_like(y)
    d_proj = torch.randn(tokens, phi.shape[0], device=dev)
    coef = torch.randn(tokens, 1, device=dev)
    s, v = x.numel() * 2, y.numel() * 2  # bytes of the stream and of one C-wide tensor (bf16)
    rows = []
    # each kernel alone, with the bytes it has to read and write (coefficients and phi left out: small)
    for name, fn, moved in (
        ("projection", lambda: mhc_triton.projection(x, phi, 1e-6), s),
        ("mix_in", lambda: mhc_triton.mix_in(h_pre, x), s + v),
        ("mix_in_grad_h", lambda: mhc_triton.mix_in_grad_h(g_in, h_pre, x), s + v),
        ("pre_backward", lambda: mhc_triton.pre_backward(g_in, x, h_pre, d_proj, coef, phi, g_out), 3 * s + v),
        ("mix_out", lambda: mhc_triton.mix_out(h_res, x, h_post, y), 2 * s + v),
        ("mix_out_backward", lambda: mhc_triton.mix_out_backward(g_out, h_res, x, h_post, y), 3 * s + 2 * v),
    ):
        ms = time_ms(fn, repeats)
        rows.append({"what": "mhc_kernel", "kernel": name, "tokens": tokens, "ms": round(ms, 3),
                     "gb_per_s": round(moved / ms / 1e6, 1)})

    # one whole sub-layer's mHC work around a cheap stand-in for attention / MLP, forward + backward: the
    # operators (model.mhc_kernels=triton) against the PyTorch ops compiled by Inductor (mhc_kernels=torch)
    results = {}
    for kernels in ("triton", "torch"):
        torch.manual_seed(1)
        layer = MHCLayer(width, flows, index=1, kernels=kernels).to(dev)
        with torch.no_grad():
            layer.phi.normal_(0, 0.02)
            layer.alpha.fill_(1.0)
        stream = x.clone().requires_grad_()
        params = [stream, *layer.parameters()]

        def step(stream):
            out, _ = layer(stream, lambda t: t * 0.5 + y)
            return out

        fn = step if kernels == "triton" else torch.compile(step, fullgraph=True)

        def fwd_bwd():
            out = fn(stream)
            return out, torch.autograd.grad(out, params, g_out)

        results[kernels] = fwd_bwd()
        rows.append({"what": "mhc_sub_layer", "kernels": kernels, "tokens": tokens,
                     "ms_fwd_bwd": round(time_ms(fwd_bwd, repeats), 3)})
    (a_out, a_grads), (b_out, b_grads) = results.values()
    diffs = [((p.float() - q.float()).norm() / q.float().norm()).item()
             for p, q in zip((a_out, *a_grads), (b_out, *b_grads))]
    rows.append({"what": "mhc_sub_layer_check", "rel_diff_out_stream_phi_alpha_bpre_bpost_bres":
                 [float(f"{d:.2e}") for d in diffs]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_micro.py measures CUDA kernels: run it on a machine with a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    peak = measure_matmul_flops(torch.device("cuda"), "bf16")  # 8192^3, the best of its timings
    rows = [{"what": "matmul_peak_bf16_tflops", "value": round(peak / 1e12, 1)}]
    print(rows[0])
    sections = [
        lambda: loss_paths(16 * 1024, 768, [50257, 50304], args.repeats),
        lambda: loss_paths(8 * 2048, 2048, [50257, 50304], args.repeats),
        lambda: vocab_matmul(16 * 1024, 768, [50257, 50304], args.repeats),
        lambda: attention(16, 12, 1024, 64, args.repeats),
        lambda: attention(8, 16, 2048, 128, args.repeats),
        lambda: sinkhorn(16 * 1024 * 2, args.repeats),
        lambda: mhc_sub_layer(32 * 1024, 4, 768, args.repeats),
        lambda: rotary(32, 12, 1024, 64, args.repeats),
        lambda: rotary(8, 16, 2048, 128, args.repeats),
    ]
    for section in sections:
        try:
            new = section()
        except Exception as e:  # one section failing must not lose the others' figures
            new = [{"what": "error", "error": f"{type(e).__name__}: {e}"[:300]}]
        for row in new:
            print(row, flush=True)
        rows += new
        torch.cuda.empty_cache()
        if args.json:  # after every section: a run cut short by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
