"""The dpo kind's data: preference pairs read from the user's files (``lmforge.posttrain.preferences``),
rendered with the chat template of the model being tuned and packed pair by pair
(``lmforge.posttrain.pairs``); and the checks on the model, tokenizer and reference it starts from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import LMForgeError
from lmforge.posttrain.formats import ReadStats
from lmforge.posttrain.init import check_reference, init_model_config, init_tokenizer_path
from lmforge.posttrain.pairs import PackedPairs, PairStats, render_pairs
from lmforge.posttrain.preferences import PREFERENCE_FORMATS, read_preference_splits
from lmforge.posttrain.render import check_chat_tokenizer
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
    from lmforge.tokenizer import Tokenizer

    settings: DPOSettings = cfg.recipe
    if not cfg.data.train_path:
        raise LMForgeError("no preference pairs: set data.train_path to a JSONL / JSON / parquet file, a `datasets` "
                           "directory, or a directory with train.jsonl (and val.jsonl) of {prompt, chosen, rejected} "
                           "rows")
    if cfg.data.path:
        raise LMForgeError("the dpo kind reads preference pairs from data.train_path; data.path (token shards) is for "
                           "the lm kind: remove it")
    path = Path(cfg.data.train_path)
    if not path.exists():
        raise LMForgeError(f"data.train_path={path} does not exist: point it at the preference pairs")
    if not cfg.training.init_from:
        raise LMForgeError("the dpo kind tunes a chat model that already follows its chat template: set "
                           "training.init_from to that checkpoint (e.g. the sft run, runs/NAME); it is also the "
                           "frozen reference unless recipe.reference_path names another")
    init_dir = init_model_config(cfg, "dpo")
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "dpo")
    tokenizer = Tokenizer.load(tokenizer_file)
    check_chat_tokenizer(tokenizer, str(tokenizer_file))
    model = cfg.model
    if model.vocab_size < tokenizer.vocab_size:
        raise LMForgeError(f"the model has {model.vocab_size} token embeddings but the tokenizer {tokenizer_file} has "
                           f"{tokenizer.vocab_size} tokens: use the tokenizer the model was trained with (leave "
                           "data.tokenizer empty to take the init_from checkpoint's)")
    for key, value in (("eos_token_id", tokenizer.eos_id), ("bos_token_id", tokenizer.bos_id),
                       ("pad_token_id", tokenizer.pad_id)):
        setattr(model, key, tokenizer.eos_id if value is None else value)
    seq_len = cfg.data.seq_len
    if seq_len > 2 * model.n_positions:  # a row holds both sides of a pair, each within the context
        raise LMForgeError(f"data.seq_len={seq_len} is more than twice the model's context model.n_positions="
                           f"{model.n_positions}: a row holds the two sides of a pair, each at most n_positions "
                           "tokens; lower data.seq_len")
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
        raise LMForgeError(f"no training pair left in {path}: {train_stats.summary(seq_len)}")
    mb = cfg.training.micro_batch_size
    train = PackedPairs(train_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=True)
    val = None
    stores = [("train", train_store)]
    if len(val_store):
        val = PackedPairs(val_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=False)
        stores.append(("val", val_store))
    if distinfo.is_main:
        if read_stats.bad:
            print(f"data: {read_stats.bad:,} malformed rows skipped (recipe.skip_bad_rows); first: "
                  f"{read_stats.bad_examples[0] if read_stats.bad_examples else ''}")
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
