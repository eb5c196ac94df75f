"""LM head + cross-entropy, forward and backward: the plain path against lmforge's fused, chunked one.

Plain: ``F.cross_entropy(h @ W.T, labels)`` with autograd. Fused: ``lmforge.models.losses.linear_cross_entropy``.
Prints the best of several timings of each, and the matmul floor (3 matmuls of 2*N*d*V FLOPs at the
measured matmul peak). Usage:

    python benchmarks/lm_head_loss.py [--tokens 2048] [--width 384] [--vocab 8192 50257] [--repeats 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmforge.device import measure_matmul_flops, setup_device
from lmforge.models.losses import linear_cross_entropy


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 50257])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    dev = setup_device("cpu", "fp32", 1.0)  # as in training: applies the CPU allocator setting
    peak = measure_matmul_flops(dev.device, "fp32")
    print(f"{'vocab':>7}{'plain ms':>11}{'fused ms':>11}{'floor ms':>11}  (fp32 matmul peak {peak / 1e9:.0f} GFLOP/s)")
    g = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        h = torch.randn(args.tokens, args.width, generator=g, requires_grad=True)
        w = (torch.randn(vocab, args.width, generator=g) * 0.02).requires_grad_()
        labels = torch.randint(0, vocab, (args.tokens,), generator=g)
        plain = best_ms(lambda: F.cross_entropy(h @ w.t(), labels).backward(), args.repeats)
        fused = best_ms(lambda: linear_cross_entropy(h, w, labels).backward(), args.repeats)
        floor = 1000 * 3 * 2 * args.tokens * args.width * vocab / peak
        print(f"{vocab:>7}{plain:>11.0f}{fused:>11.0f}{floor:>11.0f}")


if __name__ == "__main__":
    main()
