"""The ``lm`` kind: next-token pretraining of the gpt family (GPT-2 and llama flavors, with the mHC
option) on packed token shards. What seeds 001 and 002 train, and what `lmforge quickstart` runs."""

from __future__ import annotations

from typing import Any

from lmforge.recipes import CLIOptions, Counts, Family, Lazy, RecipeSpec, flops_per_token, register
from lmforge.recipes.lm import cli
from lmforge.recipes.lm.aliases import SUPERSEDES, seed_aliases


def count(model, batch: dict[str, Any]) -> Counts:
    """Packed windows: every position is a real token."""
    rows, length = batch["input_ids"].shape
    return Counts(tokens=rows * length, examples=rows, flops=rows * length * flops_per_token(model, length))


SPEC = register(RecipeSpec(
    name="lm",
    summary="language models (gpt family): loss, perplexity and bits per byte; text continuation",
    families=(Family("gpt", "lmforge.models.gpt:GPT"),),
    build_data=Lazy("lmforge.recipes.lm.data:build_lm_data"),
    count=count,
    aliases=seed_aliases,
    supersedes=SUPERSEDES,
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args, uses=("batch-size",),
                    help="loss, perplexity and bits per byte on prepared shards or raw files"),
    generate=CLIOptions(run=cli.run_generate, add=cli.add_generate_args, uses=("sampling", "precision"),
                        help="continue a prompt, streaming tokens"),
    bench_data=Lazy("lmforge.recipes.lm.bench:bench_data"),
    supports_fsdp=True,
    supports_cuda_graphs=True,
    reads_val_path=True,
))
