"""Which model presets (and a 7B shape) fit one GPU's memory for training, under DDP and under FSDP (computed).

Per parameter, AdamW training holds fp32 weights (4 bytes), fp32 gradients (4) and two fp32 moments
(8): 16 bytes. DDP keeps all of them on every GPU. FSDP over N GPUs keeps 16 / N, and gathers in
bf16 the weights of the block that runs and of the next one (prefetched), plus their fp32
gradients while it reduces them. Activations are counted with activation checkpointing at
micro-batch 1:

- one bf16 block input per layer (seq x width x 2 bytes);
- one block's internals while it is recomputed, 34sbh bytes (Korthikanti et al. 2022, bf16; their
  5as²b term for the stored attention scores does not apply: lmforge's SDPA kernels keep no s x s scores);
- the fp32 logits of the sequence.

FSDP's figure is the larger of a training step and an evaluation. lmforge evaluates (and runs a kind's
probe) on the whole model gathered in bf16: 2 bytes per parameter on top of the shards. Not counted
here: resuming reads the full checkpoint into each process's CPU memory (about 12 bytes per
parameter, per process).

A 10% margin is kept for the allocator and CUDA's own context. The parameter counts come from
lmforge's models built on the meta device. Usage:

    python benchmarks/fsdp_memory.py [--seq-len 2048] [--vocab 50257] [--gpus 8] [--memory 24,40,80,141]
"""

from __future__ import annotations

import argparse

from lmforge.models import count_parameters
from lmforge.models.gpt import PRESETS, GPTConfig

GB = 1e9
# lmforge's presets, and the 7B shape seed 004 names (Llama-2 7B's: 32 x 4096, d_ff 11008)
SHAPES = {**PRESETS, "7B": {"flavor": "llama", "n_layer": 32, "n_embd": 4096, "n_head": 32, "n_inner": 11008}}


def footprint(preset: str, seq: int, vocab: int, gpus: int) -> tuple[int, float, float]:
    """(parameters, DDP bytes per GPU, FSDP bytes per GPU) for training ``preset``."""
    cfg = GPTConfig(**{**SHAPES[preset], "vocab_size": vocab, "n_positions": seq})
    params = count_parameters(cfg)
    embed = vocab * cfg.n_embd
    block = (params - embed) / cfg.n_layer
    width, layers = cfg.n_embd, cfg.n_layer
    activations = layers * seq * width * 2 + seq * width * 34 + seq * vocab * 4
    ddp = 16 * params + activations
    training = 16 * params / gpus + 2 * block * (2 + 4) + activations
    # Evaluation and probes run on the whole model gathered in bf16 (lmforge.train.fsdp.gathered).
    evaluation = 16 * params / gpus + 2 * params + seq * vocab * 4
    fsdp = max(training, evaluation)
    return params, ddp / 0.9, fsdp / 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--memory", default="24,40,80,141", help="GPU memory sizes (GB) of the largest-fit table")
    args = parser.parse_args()
    rows = [(p, *footprint(p, args.seq_len, args.vocab, args.gpus)) for p in SHAPES]
    rows.sort(key=lambda r: r[1])
    print(f"training memory per GPU, AdamW, bf16 compute, activation checkpointing, micro-batch 1, context "
          f"{args.seq_len}, vocabulary {args.vocab}; FSDP over {args.gpus} GPUs")
    print("| preset | parameters | DDP (GB per GPU) | FSDP (GB per GPU) |")
    print("| --- | --- | --- | --- |")
    for name, params, ddp, fsdp in rows:
        print(f"| {name} | {params / 1e6:,.0f}M | {ddp / GB:,.1f} | {fsdp / GB:,.1f} |")
    print(f"\nlargest preset that fits (FSDP over {args.gpus} GPUs)")
    print("| GPU memory | DDP | FSDP |")
    print("| --- | --- | --- |")
    for memory in (float(m) for m in args.memory.split(",")):
        fit = {k: [r for r in rows if r[i] <= memory * GB] for k, i in (("ddp", 2), ("fsdp", 3))}
        shown = {k: f"{v[-1][0]} ({v[-1][1] / 1e6:,.0f}M)" if v else "none" for k, v in fit.items()}
        print(f"| {memory:g} GB | {shown['ddp']} | {shown['fsdp']} |")


if __name__ == "__main__":
    main()
