"""The sft kind's data: conversations read from the user's files, rendered with the tokenizer the model
will be served with, packed into rows (``lmforge.posttrain.packing``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import FORMATS, ReadStats, read_conversations, split_files
from lmforge.posttrain.init import (
    chat_tokenizer,
    fit_model_to_tokenizer,
    init_model_config,
    init_tokenizer_path,
    rows_path,
)
from lmforge.posttrain.render import (
    ASSISTANT_TURNS,
    RenderStats,
    render_examples,
)
from lmforge.recipes import TrainData

if TYPE_CHECKING:
    from lmforge.train.distributed import DistInfo
# The packing loaders (torch) are imported by build_sft_data: `lmforge data sft` reads conversations without torch


@dataclass
class SFTSettings:
    """Training settings of the sft kind (config section ``recipe``)."""

    format: str = "auto"  # row layout: auto (per row, from its keys) | openai | prompt_completion | sharegpt | glaive | xlam
    assistant_turns: str = "all"  # all | last: the assistant turns the loss covers
    skip_bad_rows: bool = False  # skip (and count) malformed rows instead of refusing the data
    packing: bool = True  # several conversations per row, no attention between them; false = one per row, padded

    def __post_init__(self) -> None:
        if self.format not in ("auto", *FORMATS):
            raise LMForgeError(f"recipe.format must be auto or one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.assistant_turns not in ASSISTANT_TURNS:
            raise LMForgeError(f"recipe.assistant_turns must be all or last, got {self.assistant_turns!r}")


def read_splits(path: Path, settings: SFTSettings, val_fraction: float, seed: int,
                stats: ReadStats) -> tuple[list, list]:
    """Train and held-out conversations of ``data.train_path``: its own splits where it has them, else
    ``val_fraction`` of its rows held out (chosen by ``seed``). A directory with held-out files (val,
    test) but no train file is refused (``split_files``)."""
    def read(paths: Any, split: str | None = None) -> list:
        return list(read_conversations(paths, format=settings.format, skip_bad_rows=settings.skip_bad_rows,
                                       stats=stats, split=split))

    splits = split_files(path)
    if splits is not None:
        return read(splits[0]), read(splits[1]) if splits[1] else []
    if (path / "dataset_dict.json").is_file():
        import json

        names = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        val_name = next((n for n in ("validation", "val") if n in names), None)
        return read(path, "train"), read(path, val_name) if val_name else []
    rows = read(path)
    held = np.random.default_rng(seed).random(len(rows)) < val_fraction
    if len(rows) > 1 and not held.any():
        held[-1] = True
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def build_sft_data(cfg, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the sft kind."""
    from lmforge.posttrain.packing import ExampleStore, PackedConversations

    settings: SFTSettings = cfg.recipe
    path = rows_path(cfg, "sft", "conversations", "a JSONL / JSON / parquet file, a `datasets` directory, or a "
                     "directory with train.jsonl (and val.jsonl), e.g. one written by `lmforge data tool-calls --out DIR`")
    init_dir = init_model_config(cfg, "sft", fine_tune=True, example="runs/code_assistant_code")
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "sft", fine_tune=True)
    tokenizer = chat_tokenizer(tokenizer_file)
    model = cfg.model
    fit_model_to_tokenizer(model, tokenizer, tokenizer_file)
    seq_len = cfg.data.seq_len
    if seq_len > model.n_positions:
        raise LMForgeError(f"data.seq_len={seq_len} is longer than the model's context model.n_positions="
                           f"{model.n_positions}; lower data.seq_len")

    read_stats = ReadStats()
    train_convs, val_convs = read_splits(path, settings, cfg.data.val_fraction, cfg.seed, read_stats)
    train_stats, val_stats = RenderStats(), RenderStats()
    train_examples = render_examples(tokenizer, train_convs, seq_len, settings.assistant_turns, train_stats)
    val_examples = render_examples(tokenizer, val_convs, seq_len, settings.assistant_turns, val_stats)
    if not train_examples:
        raise LMForgeError(f"no training conversation left in {path}: {train_stats.summary(seq_len)}"
                           + (f"; {read_stats.skipped()}" if read_stats.bad else ""))
    mb = cfg.training.micro_batch_size
    train = PackedConversations(ExampleStore(train_examples), seq_len, mb, distinfo.rank, distinfo.world_size,
                                cfg.seed, shuffle=True, packing=settings.packing)
    if train.rows_per_epoch < distinfo.world_size:
        raise LMForgeError(f"the training set fills {train.rows_per_epoch} rows, fewer than the {distinfo.world_size} "
                           "processes; use more conversations or fewer processes")
    val = None
    if val_examples:
        val = PackedConversations(ExampleStore(val_examples), seq_len, mb, distinfo.rank, distinfo.world_size,
                                  cfg.seed, shuffle=False, packing=settings.packing)
    if distinfo.is_main:
        if read_stats.bad:
            print(f"data: {read_stats.skipped()}")
        print(f"data: train: {train_stats.summary(seq_len)}")
        if val_convs:
            print(f"data: val: {val_stats.summary(seq_len)}")
        else:
            print("note: no held-out conversations; evaluation is off")
    layout = "packed" if settings.packing else "one per row"
    description = (f"{path}: {train_stats.kept:,} conversations ({layout}, {train.rows_per_epoch:,} rows of "
                   f"{seq_len}, {train.padding_fraction():.1%} padding), {train_stats.supervised:,} supervised tokens"
                   + (f"; {val_stats.kept:,} held out" if val is not None else ""))
    return TrainData(train=train, val=val, description=description, examples_per_epoch=train.rows_per_epoch,
                     tokenizer_path=tokenizer_file)
