"""Which model presets (and a 7B shape) fit one GPU's memory for training, under DDP and under FSDP (computed).

Per parameter, AdamW training holds fp32 weights (4 bytes), fp32 gradients (4) and two fp32 moments
(8): 16 bytes. DDP keeps all of them on every GPU. FSDP over N GPUs keeps 16 / N, and gathers in
bf16 the weights of the block that runs and of the next one (prefetched), plus their fp32
gradients while it reduces them, and the root's own weights (embeddings, final norm, head), which stay
gathered from its forward to its backward. Activations are counted with activation checkpointing at
micro-batch 1:

- one bf16 block input per layer (seq x width x 2 bytes);
- one block's internals while it is recomputed, 34sbh bytes (Korthikanti et al. 2022, bf16; their
  5as²b term for the stored attention scores does not apply: lmforge's SDPA kernels keep no s x s scores);
- the fp32 logits of the sequence.

FSDP's figure is that of a training step: lmforge's evaluation runs the sharded model block by block as
the step's forward does (every process in step), with no activations kept, so it holds less. (Before,
it gathered the whole model in bf16 on top of the shards: 2 bytes per parameter, which was the larger
figure for every kind without rollouts.) Not counted here: resuming reads the full checkpoint into
each process's CPU memory (about 12 bytes per parameter, per process).

The post-training kinds hold more (``KINDS``): a frozen reference (dpo, grpo, ppo) and reward model
(ppo), a second trained model (ppo's value model), and while a rollout is drawn the decoding's KV cache.
Under DDP the frozen models are whole on every GPU in fp32; under FSDP they are sharded like the trained
ones (fp32 shards, 4 / N bytes per parameter). A rollout (grpo, ppo) gathers one model at a time in bf16:
the policy while it decodes, then each scorer. dpo's live reference, called in the training step,
gathers one block at a time there, as the trained model does; before training it is gathered whole in
bf16 once, to fill the held-out pairs' reference log-probs. dpo's precompute scores with the reference
whole in bf16 (not sharded), freed before training. The third table gives the largest preset per kind.

The last two tables are for one GPU with ``training.fsdp_offload`` (a torchrun job of one process): the
weights, gradients and AdamW state (16 bytes per parameter) and the frozen models' fp32 weights stay in
CPU memory, and the GPU holds what a step gathers (two blocks and the root, with their gradients), the
activations, and whatever is gathered whole: a rollout's model and KV cache, dpo's reference while it
scores before training.

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


# What each training kind holds beyond one trained model, per GPU: (trained models, frozen models kept
# for the run, frozen models held whole before training only, whether it decodes rollouts). Frozen models
# are stored in fp32 (4 bytes per parameter): whole under DDP, sharded under FSDP (lmforge.train.fsdp.
# shard_frozen); a rollout gathers one model at a time in bf16 (lmforge.train.fsdp.Gatherer).
KINDS = {
    "lm": (1, 0, 0, False),        # pretraining; sft and reward (a trunk + a scalar head) hold the same
    "dpo": (1, 0, 1, False),       # recipe.reference=precompute: the reference scores every pair, then is freed
    "dpo-live": (1, 1, 0, False),  # recipe.reference=live: the reference runs beside the policy on every batch
    "grpo": (1, 1, 0, True),       # the KL reference (recipe.beta > 0); a reward_model:PATH reward adds one more
    # policy + value model trained, reference + reward model frozen: the value and reward models taken
    # as the policy's size (they have the reward checkpoint's)
    "ppo": (2, 2, 0, True),
}


def footprint(preset: str, seq: int, vocab: int, gpus: int, kind: str = "lm", decode_batch: int = 64,
              decode_tokens: int = 512, offload: bool = False) -> tuple[int, float, float, float]:
    """(parameters, DDP bytes per GPU, FSDP bytes per GPU, FSDP bytes of CPU memory per process) for training
    ``preset`` with ``kind``. A rollout decodes ``decode_batch`` sequences at once (recipe.generation_batch_size),
    each up to ``decode_tokens`` long (its longest prompt + recipe.max_new_tokens). ``offload``
    (training.fsdp_offload): the shards (weights, gradients, AdamW state, frozen models) are in CPU memory,
    and the GPU holds what a step, a rollout or a scoring pass gathers."""
    cfg = GPTConfig(**{**SHAPES[preset], "vocab_size": vocab, "n_positions": seq})
    params = count_parameters(cfg)
    embed = vocab * cfg.n_embd
    block = (params - embed) / cfg.n_layer
    width, layers = cfg.n_embd, cfg.n_layer
    trained, frozen, before, rollouts = KINDS[kind]
    activations = layers * seq * width * 2 + seq * width * 34 + seq * vocab * 4
    frozen_bytes = 4 * params * frozen
    # The decoding's KV cache: keys and values of every layer for the rollout's longest sequence
    # (lmforge.posttrain.rollout.sample sizes it so; at most the model's context), in the weights'
    # dtype: bf16 for FSDP's gathered weights, fp32 for DDP's; and one step's fp32 logits.
    kv_width = width * (cfg.n_kv_head or cfg.n_head) // cfg.n_head
    cached = min(decode_tokens + 2, seq)

    def decoding(dtype_bytes: int) -> float:
        return decode_batch * (cached * 2 * layers * kv_width * dtype_bytes + vocab * 4) if rollouts else 0

    ddp = trained * (16 * params + activations) + frozen_bytes  # dpo's precompute (8 bytes) comes in under this
    ddp = max(ddp, trained * 16 * params + frozen_bytes + decoding(4))
    frozen_shards = frozen_bytes / gpus
    # dpo's live reference in the step: two blocks gathered in bf16 (one running, one prefetched), its root
    # (embeddings, head) gathered until the step ends, and its fp32 logits (no activations kept: no grad)
    in_step = 2 * block * 2 + 2 * embed * 2 + seq * vocab * 4 if frozen and not rollouts else 0
    shards = trained * 16 * params / gpus + frozen_shards
    on_gpu = 0 if offload else shards  # training.fsdp_offload keeps the shards in CPU memory
    nonblock = params - block * layers  # the root's own weights: embeddings, final norm, head
    # in a step: two blocks (the one running, the next prefetched) and the root, gathered in bf16 with
    # their gradients reduced in fp32 (the root keeps its weights gathered from its forward to its backward)
    training = on_gpu + trained * ((2 * block + nonblock) * (2 + 4) + activations) + in_step
    if rollouts:
        # A rollout, and the held-out replies, gather one model at a time in bf16 (ModelHost.gathered): the
        # policy with its root (which also holds a second trained model's embeddings and head: ppo's value
        # model) while it decodes, then each scorer over the rollout, one sequence's fp32 logits at a time.
        gathered = on_gpu + 2 * (params + (trained - 1) * nonblock) + max(seq * vocab * 4, decoding(2))
    else:
        # Evaluation runs block by block, as the training step's forward: it holds less than the step.
        gathered = 0
    # Before training (AdamW's state comes with the first step), beside the policy's fp32 weight shards:
    # dpo's precompute holds the reference whole in bf16 (ModelHost.scoring) while it scores every pair;
    # dpo's live reference, its fp32 shards and, gathered whole in bf16, itself, to score the held-out pairs.
    whole_reference = before or (frozen and not rollouts)
    before_training = 0 if offload else 4 * params / gpus + frozen_shards
    precompute = (before_training + 2 * params + seq * vocab * 4) if whole_reference else 0
    fsdp = max(training, gathered, precompute)
    return params, ddp / 0.9, fsdp / 0.9, (shards if offload else 0) / 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--memory", default="24,40,80,141", help="GPU memory sizes (GB) of the largest-fit table")
    parser.add_argument("--decode-batch", type=int, default=64,
                        help="grpo / ppo: sequences a rollout decodes at once (recipe.generation_batch_size)")
    parser.add_argument("--decode-tokens", type=int, default=512,
                        help="grpo / ppo: a rollout's longest prompt + recipe.max_new_tokens")
    args = parser.parse_args()
    rows = [(p, *footprint(p, args.seq_len, args.vocab, args.gpus)) for p in SHAPES]
    rows.sort(key=lambda r: r[1])
    print(f"training memory per GPU, AdamW, bf16 compute, activation checkpointing, micro-batch 1, context "
          f"{args.seq_len}, vocabulary {args.vocab}; FSDP over {args.gpus} GPUs")
    print("| preset | parameters | DDP (GB per GPU) | FSDP (GB per GPU) |")
    print("| --- | --- | --- | --- |")
    for name, params, ddp, fsdp, _ in rows:
        print(f"| {name} | {params / 1e6:,.0f}M | {ddp / GB:,.1f} | {fsdp / GB:,.1f} |")
    memories = [float(m) for m in args.memory.split(",")]

    def largest(fits) -> str:
        fitting = [r for r in rows if fits(r)]
        return f"{fitting[-1][0]} ({fitting[-1][1] / 1e6:,.0f}M)" if fitting else "none"

    print(f"\nlargest preset that fits (FSDP over {args.gpus} GPUs)")
    print("| GPU memory | DDP | FSDP |")
    print("| --- | --- | --- |")
    for memory in memories:
        print(f"| {memory:g} GB | {largest(lambda r: r[2] <= memory * GB)} | {largest(lambda r: r[3] <= memory * GB)} |")
    kinds = list(KINDS)
    by_kind = {k: {p: footprint(p, args.seq_len, args.vocab, args.gpus, k, args.decode_batch, args.decode_tokens)
                   for p, *_ in rows} for k in kinds}
    print(f"\nlargest preset that fits per training kind, FSDP over {args.gpus} GPUs (frozen models sharded too; "
          f"rollouts decode {args.decode_batch} sequences of up to {args.decode_tokens} tokens at once)")
    print("| GPU memory | " + " | ".join(kinds) + " |")
    print("| --- |" + " --- |" * len(kinds))
    for memory in memories:
        cells = [largest(lambda r, k=k: by_kind[k][r[0]][2] <= memory * GB) for k in kinds]
        print(f"| {memory:g} GB | " + " | ".join(cells) + " |")
    # One GPU, training.fsdp_offload (torchrun --nproc_per_node=1): the GPU holds what is gathered, the CPU the rest
    offloaded = {k: {p: footprint(p, args.seq_len, args.vocab, 1, k, args.decode_batch, args.decode_tokens,
                                  offload=True) for p, *_ in rows} for k in kinds}
    print("\none GPU with training.fsdp_offload (torchrun --nproc_per_node=1): GPU memory / CPU memory per preset")
    print("| preset | " + " | ".join(kinds) + " |")
    print("| --- |" + " --- |" * len(kinds))
    for name, *_ in rows:
        cells = [f"{offloaded[k][name][2] / GB:,.1f} / {offloaded[k][name][3] / GB:,.0f}" for k in kinds]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nlargest preset that fits one GPU with training.fsdp_offload, per training kind")
    print("| GPU memory | " + " | ".join(kinds) + " |")
    print("| --- |" + " --- |" * len(kinds))
    for memory in memories:
        cells = [largest(lambda r, k=k: offloaded[k][r[0]][2] <= memory * GB) for k in kinds]
        print(f"| {memory:g} GB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
