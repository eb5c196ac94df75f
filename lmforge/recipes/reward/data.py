"""The reward kind's data: preference pairs read from the user's files, rendered with the tokenizer the
policy is served with, both replies of a pair packed into one row (``lmforge.posttrain.pairs``); and
the held-out figures ``lmforge eval --preferences`` prints."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.gpt import GPTConfig
from lmforge.models.reward import reward_config_from
from lmforge.posttrain.formats import ReadStats
from lmforge.posttrain.init import (
    TUNABLE_MODEL_KEYS,
    chat_tokenizer,
    check_pair_rows,
    fit_model_to_tokenizer,
    init_tokenizer_path,
    rows_path,
)
from lmforge.posttrain.pairs import PackedPairs, PairStats, PairStore, render_pairs
from lmforge.posttrain.preferences import PREFERENCE_FORMATS, read_preference_splits
from lmforge.recipes import TrainData
from lmforge.train.distributed import DistInfo

UNLABELLED = "(no kind)"  # the report's name for pairs whose data names no kind of rejected reply


@dataclass
class RewardSettings:
    """Training settings of the reward kind (config section ``recipe``)."""

    format: str = "auto"  # row layout of the preference files: auto (per row, from its keys) or one of the readers'
    skip_bad_rows: bool = False  # skip (and count) malformed rows instead of refusing the data
    use_margin: bool = False  # subtract the data's `margin` column inside the loss: -logsigmoid(r_c - r_r - margin)
    center_rewards_coef: float = 0.0  # weight of mean((r_c + r_r)^2), which keeps rewards near 0 (0 = off)

    def __post_init__(self) -> None:
        if self.format not in ("auto", *PREFERENCE_FORMATS):
            raise LMForgeError(f"recipe.format must be auto or one of {', '.join(PREFERENCE_FORMATS)}, "
                               f"got {self.format!r}")
        if not self.center_rewards_coef >= 0:
            raise LMForgeError(f"recipe.center_rewards_coef must be >= 0 (0 = off; 0.01 is usual), got "
                               f"{self.center_rewards_coef}")


def prepare_model(model, cfg) -> None:
    """``RecipeSpec.prepare_model``: the loss settings onto the model, whose forward is the loss."""
    model.use_margin = cfg.recipe.use_margin
    model.center_rewards_coef = cfg.recipe.center_rewards_coef


def init_model_config(cfg) -> Path | None:
    """With ``training.init_from`` (a chat model, or a reward model to train further) the reward model is
    built on its trunk: ``cfg.model`` becomes its shape (dropout from this run). Returns its directory.
    (``lmforge.posttrain.init.init_model_config`` wants the run's own family; this one crosses from gpt.)"""
    if not cfg.training.init_from:
        return None
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.models.base import read_model_config

    if not Path(cfg.training.init_from).exists():
        raise LMForgeError(f"training.init_from={cfg.training.init_from} does not exist: point it at the chat model "
                           "to build the reward model on (an sft checkpoint or run directory)")
    source = resolve_model_dir(cfg.training.init_from)
    klass, config = read_model_config(source)
    if not isinstance(config, GPTConfig):  # a gpt model's config, or a reward model's (a subclass)
        raise LMForgeError(f"training.init_from={cfg.training.init_from} holds a {klass.family!r} model; a reward model "
                           "is built on a gpt-family chat model (an sft checkpoint) or continues a reward model")
    for key in TUNABLE_MODEL_KEYS:
        setattr(config, key, getattr(cfg.model, key))
    cfg.model = reward_config_from(config)
    return source


def read_pairs(path: Path, settings: RewardSettings, val_fraction: float, seed: int, stats: ReadStats):
    """Train and held-out pairs of ``data.train_path``."""
    return read_preference_splits(path, format=settings.format, skip_bad_rows=settings.skip_bad_rows,
                                  val_fraction=val_fraction, seed=seed, stats=stats)


def build_reward_data(cfg, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the reward kind."""

    settings: RewardSettings = cfg.recipe
    path = rows_path(cfg, "reward", "preference pairs", "a JSONL / JSON / parquet file of pairs (prompt, chosen, "
                     "rejected), or a directory with train.jsonl (and val.jsonl), e.g. one written by `lmforge data "
                     "preferences --out DIR`")
    init_dir = init_model_config(cfg)
    tokenizer_file = init_tokenizer_path(cfg, init_dir, "reward")
    tokenizer = chat_tokenizer(tokenizer_file)
    model = cfg.model
    fit_model_to_tokenizer(model, tokenizer, tokenizer_file)
    seq_len = cfg.data.seq_len
    check_pair_rows(seq_len, model.n_positions)

    read_stats = ReadStats()
    train_pairs, val_pairs = read_pairs(path, settings, cfg.data.val_fraction, cfg.seed, read_stats)
    if settings.use_margin and not any(p.margin is not None for p in train_pairs):
        raise LMForgeError(f"recipe.use_margin=true but no training pair in {path} has a margin; add a `margin` "
                           "column or set recipe.use_margin=false")
    train_stats, val_stats = PairStats(), PairStats()
    train_store = render_pairs(tokenizer, train_pairs, seq_len, train_stats, model.n_positions)
    val_store = render_pairs(tokenizer, val_pairs, seq_len, val_stats, model.n_positions)
    if not len(train_store):
        raise LMForgeError(f"no training pair left in {path}: {train_stats.summary(seq_len)}"
                           + (f"; {read_stats.skipped()}" if read_stats.bad else ""))
    mb = cfg.training.micro_batch_size
    train = PackedPairs(train_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=True)
    val = None
    if len(val_store):
        val = PackedPairs(val_store, seq_len, mb, distinfo.rank, distinfo.world_size, cfg.seed, shuffle=False)
    if distinfo.is_main:
        if read_stats.bad:
            print(f"data: {read_stats.skipped()}")
        print(f"data: train: {train_stats.summary(seq_len)}")
        if val is not None:
            print(f"data: val: {val_stats.summary(seq_len)}")
        else:
            print("note: no held-out pairs; evaluation is off and checkpoints/best is not chosen")
    description = (f"{path}: {len(train_store):,} preference pairs ({train.rows_per_epoch:,} rows of {seq_len}), "
                   f"{train_stats.tokens:,} tokens" + (f"; {len(val_store):,} held out" if val is not None else ""))
    return TrainData(train=train, val=val, description=description, examples_per_epoch=train.rows_per_epoch,
                     tokenizer_path=tokenizer_file)


# ---- held-out figures ---------------------------------------------------------------------------------
@torch.no_grad()
def score_pairs(model, store: PairStore, seq_len: int, batch_size: int) -> np.ndarray:
    """``[N, 2]`` rewards of the store's pairs (chosen, rejected), in the store's order."""
    device = next(model.parameters()).device
    out = np.zeros((len(store), 2), dtype=np.float32)
    for batch in PackedPairs(store, seq_len, batch_size, shuffle=False).iter_eval_batches():
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        rewards = model.rewards(batch).view(-1, 2).cpu().numpy()
        out[batch["pair_index"].cpu().numpy()] = rewards
    return out


def _figures(diff: np.ndarray) -> dict[str, Any]:
    accuracy = float(((diff > 0) + 0.5 * (diff == 0)).mean())
    return {"pairs": int(diff.size), "accuracy": accuracy, "margin": float(diff.mean())}


def pair_report(store: PairStore, rewards: np.ndarray) -> dict[str, Any]:
    """Pair accuracy (a tie counts half) and mean margin ``r_chosen - r_rejected``, overall and per kind of
    rejected reply; the rewards' mean and standard deviation."""
    diff = rewards[:, 0] - rewards[:, 1]
    by_kind: dict[str, list[int]] = defaultdict(list)
    for i, kind in enumerate(store.kinds):
        by_kind[kind or UNLABELLED].append(i)
    return {**_figures(diff), "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "by_kind": {kind: _figures(diff[rows]) for kind, rows in sorted(by_kind.items())}}


def format_pair_report(report: dict[str, Any]) -> str:
    width = max([len("kind of rejected reply"), *(len(k) for k in report["by_kind"])])
    lines = [f"{'kind of rejected reply':<{width}}  {'pairs':>6}  {'accuracy':>8}  {'margin':>8}"]
    for kind, f in [*report["by_kind"].items(), ("all", report)]:
        lines.append(f"{kind:<{width}}  {f['pairs']:>6,}  {f['accuracy']:>8.3f}  {f['margin']:>8.3f}")
    lines.append(f"rewards: mean {report['reward_mean']:.3f}, std {report['reward_std']:.3f} (accuracy: share of "
                 "pairs whose chosen reply scores higher, a tie counting half: 0.5 is chance)")
    return "\n".join(lines)


__all__ = ["RewardSettings", "build_reward_data", "format_pair_report", "init_model_config", "pair_report",
           "prepare_model", "score_pairs"]
