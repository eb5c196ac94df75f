"""What the pickle-free training state costs: save/load time and size against ``torch.save`` / ``torch.load``.

    python benchmarks/checkpoint_format.py                 # GPT-2 124M with AdamW state
    python benchmarks/checkpoint_format.py --n-layer 2     # smaller, quicker

It builds the model, takes one AdamW step (so the optimizer holds both moments), then writes the
``optimizer.safetensors`` content (optimizer + scaler + model training state) with lmforge's
``save_state`` and, for comparison, the same dict with ``torch.save`` as lmforge 0.1 did, each
``--repeats`` times into a temporary directory, and reads each back (summing every tensor, so that
memory-mapped data is really read). Prints the median seconds and the file sizes. The files are written to --dir (default: a temporary directory, removed after).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.safe_state import load_state, save_state


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch(state: dict) -> float:
    return sum(float(v.sum()) for s in state["optimizer"]["state"].values() for v in s.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab_size, n_positions=1024, n_embd=args.n_embd, n_layer=args.n_layer,
                          n_head=max(1, args.n_embd // 64)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = {"optimizer": opt.state_dict(), "scaler": {}, "model_state": {}}
    params = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        new, old = Path(tmp) / "optimizer.safetensors", Path(tmp) / "optimizer.pt"
        save_new = timed(lambda: save_state(new, state), args.repeats)
        save_old = timed(lambda: torch.save(state, old), args.repeats)
        # Each tensor is summed after loading, so that memory-mapped data is really read: same work for both.
        load_new = timed(lambda: touch(load_state(new, "optimizer state")), args.repeats)
        load_old = timed(lambda: touch(torch.load(old, map_location="cpu", weights_only=True)), args.repeats)
        sizes = new.stat().st_size, old.stat().st_size
        back = load_state(new, "optimizer state")
        exact = all(torch.equal(back["optimizer"]["state"][i][k], v)
                    for i, s in state["optimizer"]["state"].items() for k, v in s.items())
    print(f"model: {params / 1e6:.1f}M parameters; optimizer state {sizes[0] / 2**20:.0f} MiB; "
          f"torch {torch.__version__}; median of {args.repeats}")
    print(f"{'':24}{'save s':>10}{'load s':>10}{'MiB':>10}")
    print(f"{'save_state (safetensors)':24}{save_new:>10.2f}{load_new:>10.2f}{sizes[0] / 2**20:>10.1f}")
    print(f"{'torch.save (pickle)':24}{save_old:>10.2f}{load_old:>10.2f}{sizes[1] / 2**20:>10.1f}")
    print(f"round trip bit-exact: {exact}")


if __name__ == "__main__":
    main()
