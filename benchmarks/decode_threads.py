"""Single-stream decoding with 1 and 2 intra-op threads, alternating in one process: does a second thread help
batch-1 generation here, and what happens to it when other programs want the cores?

    python benchmarks/decode_threads.py CKPT [--rounds 4] [--new-tokens 128]

Greedy ``generate_tokens`` (what ``lmforge generate`` / ``chat`` run), eos ignored, after a 32-token prompt; one
warm-up call per setting, then ``--rounds`` rounds of each, alternating. Prints tokens/s per round and the median.
"""

from __future__ import annotations

import argparse
import time

import torch

from lmforge.infer.generate import generate_tokens
from lmforge.infer.loading import load_for_inference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint or run directory")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    loaded = load_for_inference(args.checkpoint, device="cpu")
    model = loaded[0] if isinstance(loaded, tuple) else getattr(loaded, "model", loaded)
    prompt = list(range(5, 37))

    def tokens_per_s(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        n = sum(1 for _ in generate_tokens(model, prompt, args.new_tokens, temperature=0.0, stop_at_eos=False))
        return n / (time.perf_counter() - start)

    settings = (1, 2)
    for threads in settings:
        tokens_per_s(threads)
    runs: dict[int, list[float]] = {t: [] for t in settings}
    for _ in range(args.rounds):
        for threads in settings:
            runs[threads].append(tokens_per_s(threads))
    params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}, {params / 1e6:.1f}M parameters, {args.new_tokens} new tokens, batch 1")
    for threads, values in runs.items():
        print(f"{threads} thread(s): tokens/s {' '.join(f'{v:.0f}' for v in values)}; "
              f"median {sorted(values)[len(values) // 2]:.1f}")


if __name__ == "__main__":
    main()
