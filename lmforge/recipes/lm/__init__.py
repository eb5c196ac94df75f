"""The ``lm`` kind: next-token pretraining of the gpt family (GPT-2 and llama flavors, with the mHC
option) on packed token shards. What seeds 001 and 002 train, and what `lmforge quickstart` runs."""

from __future__ import annotations

from typing import Any

import torch

from lmforge.models.gpt import GPT
from lmforge.recipes import CLIOptions, Counts, RecipeSpec, flops_per_token, register
from lmforge.recipes.lm import cli
from lmforge.recipes.lm.aliases import SUPERSEDES, seed_aliases
from lmforge.recipes.lm.data import build_lm_data


def count(model, batch: dict[str, Any]) -> Counts:
    """Packed windows: every position is a real token."""
    rows, length = batch["input_ids"].shape
    return Counts(tokens=rows * length, examples=rows, flops=rows * length * flops_per_token(model, length))


class RandomTokens:
    """Seeded random token windows (``lmforge bench``): the same batches for every system compared."""

    def __init__(self, vocab_size: int, micro_batch_size: int, seq_len: int, seed: int = 0):
        self.shape = (micro_batch_size, seq_len + 1)
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> dict[str, torch.Tensor]:
        w = torch.randint(0, self.vocab_size, self.shape, generator=self.gen)
        return {"input_ids": w[:, :-1], "labels": w[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def bench_data(cfg) -> RandomTokens:
    return RandomTokens(cfg.model.vocab_size, cfg.training.micro_batch_size, cfg.data.seq_len, cfg.seed)


SPEC = register(RecipeSpec(
    name="lm",
    summary="language models (gpt family): loss, perplexity and bits per byte; text continuation",
    families=(GPT,),
    build_data=build_lm_data,
    count=count,
    aliases=seed_aliases,
    supersedes=SUPERSEDES,
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("batch-size",),
                    help="loss, perplexity and bits per byte on prepared shards or raw files"),
    generate=CLIOptions(run=cli.run_generate, add=cli.add_generate_args, uses=("sampling", "precision"),
                        help="continue a prompt, streaming tokens"),
    bench_data=bench_data,
    supports_fsdp=True,
    supports_cuda_graphs=True,
    reads_val_path=True,
))
