"""The dpo kind's data: preference pairs read from the user's files (``lmforge.posttrain.preferences``),
rendered with the chat template of the model being tuned and packed pair by pair
(``lmforge.posttrain.pairs``); and the checks on the model, tokenizer and reference it starts from."""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import ReadStats
from lmforge.posttrain.init import (
    chat_tokenizer,
    check_pair_rows,
    check_reference,
    fit_model_to_tokenizer,
    init_model_config,
    init_tokenizer_path,
    rows_path,
)
from lmforge.posttrain.pairs import PackedPairs, PairStats, render_pairs
from lmforge.posttrain.preferences import PREFERENCE_FORMATS, read_preference_splits
from lmforge.recipes import TrainData
from lmforge.recipes.dpo.reference import make_binder
from lmforge.train.distributed import DistInfo

REFERENCE_MODES = ("precompute", "live")


@dataclass
class DPOSettings:
    """Training settings of the dpo kind (config section ``recipe``)."""

    beta: float = 0.1  # how far the policy may move from the reference: the implicit reward's scale
    label_smoothing: float = 0.0  # cDPO: the chance that a pair's label is wrong (0 = plain DPO), < 0.5
    reference: str = "precompute"  # precompute: reference log-probs once, before training | live: every batch
    reference_path: str = ""  # the frozen reference checkpoint; "" = training.init_from
    rpo_alpha: float = 0.0  # > 0: add this x the chosen replies' NLL per token (keeps them likely; TRL's rpo_alpha)
    format: str = "auto"  # row layout: auto (per row) | plain | ultrafeedback | hh_rlhf
    skip_bad_rows: bool = False  # skip (and count) malformed rows instead of refusing the data

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise LMForgeError(f"recipe.beta must be > 0, got {self.beta}: at beta=0 the DPO loss is log 2 whatever "
                               "the model does, so nothing is learnt (typical values: 0.01 to 0.5; default 0.1)")
        if not 0 <= self.label_smoothing < 0.5:
            raise LMForgeError(f"recipe.label_smoothing must be >= 0 and < 0.5, got {self.label_smoothing}: it is the "
                               "share of labels assumed wrong, and at 0.5 chosen and rejected would weigh the same")
        if not self.rpo_alpha >= 0:
            raise LMForgeError(f"recipe.rpo_alpha must be >= 0 (0 = plain DPO), got {self.rpo_alpha}")
        if self.reference not in REFERENCE_MODES:
            raise LMForgeError(f"recipe.reference must be precompute or live, got {self.reference!r}")
        if self.format not in ("auto", *PREFERENCE_FORMATS):
            raise LMForgeError(f"recipe.format must be auto or one of {', '.join(PREFERENCE_FORMATS)}, "
                               f"got {self.format!r}")


def build_dpo_data(cfg, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the dpo kind. Everything is checked and every pair rendered here,
    before any model runs; the reference's log-probs are computed once the policy is on its device."""

    settings: DPOSettings = cfg.recipe
    path = rows_path(cfg, "dpo", "preference pairs", "a JSONL / JSON / parquet file, a `datasets` directory, or a "
                     "directory with train.jsonl (and val.jsonl) of {prompt, chosen, rejected} rows")
    if not cfg.training.init_from:
        raise LMForgeError("the dpo kind tunes a chat model that already follows its chat template: set "
                           "training.init_from to that checkpoint (e.g. the sft run, runs/NAME); it is also the "
                           "frozen reference unless recipe.reference_path names another")
    init_dir = init_model_config(cfg, "dpo")
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "dpo")
    tokenizer = chat_tokenizer(tokenizer_file)
    model = cfg.model
    fit_model_to_tokenizer(model, tokenizer, tokenizer_file)
    seq_len = cfg.data.seq_len
    check_pair_rows(seq_len, model.n_positions)
    reference_setting = "recipe.reference_path" if settings.reference_path else "training.init_from"
    reference_dir = check_reference(settings.reference_path or cfg.training.init_from, reference_setting, model,
                                    tokenizer_file, min(seq_len, model.n_positions))

    read_stats = ReadStats()
    train_pairs, val_pairs = read_preference_splits(path, settings.format, settings.skip_bad_rows, read_stats,
                                                    cfg.data.val_fraction, cfg.seed)
    train_stats, val_stats = PairStats(), PairStats()
    train_store = render_pairs(tokenizer, train_pairs, seq_len, train_stats, model.n_positions)
    val_store = render_pairs(tokenizer, val_pairs, seq_len, val_stats, model.n_positions)
    if not len(train_store):
        raise LMForgeError(f"no training pair left in {path}: {train_stats.summary(seq_len)}"
                           + (f"; {read_stats.skipped()}" if read_stats.bad else ""))
    mb = cfg.training.micro_batch_size
    train = PackedPairs(train_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=True)
    val = None
    stores = [("train", train_store)]
    if len(val_store):
        val = PackedPairs(val_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=False)
        stores.append(("val", val_store))
    if distinfo.is_main:
        if read_stats.bad:
            print(f"data: {read_stats.skipped()}")
        print(f"data: train: {train_stats.summary(seq_len)}")
        if val is not None:
            print(f"data: val: {val_stats.summary(seq_len)}")
        else:
            print("note: no held-out pairs; evaluation is off (give a val.jsonl or data.val_fraction > 0)")
    progress = distinfo.is_main and cfg.logging.progress_bar
    description = (f"{path}: {len(train_store):,} preference pairs ({train.rows_per_epoch:,} rows of {seq_len})"
                   + (f", {len(val_store):,} held out" if val is not None else "")
                   + f"; reference {reference_dir} ({settings.reference}), beta {settings.beta:g}"
                   + (f", label smoothing {settings.label_smoothing:g}" if settings.label_smoothing else ""))
    return TrainData(train=train, val=val, description=description, examples_per_epoch=train.rows_per_epoch,
                     tokenizer_path=tokenizer_file,
                     bind_model=make_binder(settings, reference_dir, stores, seq_len, mb, distinfo, progress))
