"""Training throughput: lmforge vs transformers.GPT2LMHeadModel + a plain AdamW loop, same config.

GPT-2 flavor, 6 layers x 384 wide x 6 heads, context 256, micro-batch 8, fp32, GPT-2's vocabulary
(50257; seed 001's Go tokenizer has 50000), 20 timed steps after 3 warm-up steps, on the same seeded
random token batches, each system in its own process, timed in alternating rounds (one process runs
at a time). transformers runs as a plain loop would, with the C allocator's defaults; lmforge with its
own setting (see lmforge.device.keep_freed_memory_for_reuse); --same-allocator gives transformers
lmforge's setting too, which isolates the model code. Prints tokens/s of each and the ratio. Usage:

    python benchmarks/train_vs_transformers.py [--vocab-size 50257] [--steps 20] [--same-allocator] [overrides ...]
"""

from __future__ import annotations

import argparse

from lmforge.bench import run_bench

CONFIG = ["model.flavor=gpt2", "model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.n_positions=256",
          "data.seq_len=256", "training.micro_batch_size=8", "training.grad_accum_steps=1",
          "training.precision=fp32", "model.embd_pdrop=0.0", "model.resid_pdrop=0.0", "model.attn_pdrop=0.0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--same-allocator", action="store_true",
                        help="give transformers lmforge's C-allocator setting too (isolates the model code)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_bench("go_coder_tiny", CONFIG + args.overrides, steps=args.steps, warmup=args.warmup,
              vocab_size=args.vocab_size, compare_transformers=True, same_allocator=args.same_allocator)


if __name__ == "__main__":
    main()
