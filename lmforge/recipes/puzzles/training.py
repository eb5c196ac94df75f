"""The puzzle kind's training glue: its data for the loop, its settings, its optimizer and what a
batch counts for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.config import RunConfig
from lmforge.errors import LMForgeError
from lmforge.recipes import Counts, TrainData, flops_per_token
from lmforge.recipes.puzzles.data import GroupSampler, PuzzleEvalLoader, PuzzleSplit
from lmforge.recipes.puzzles.optimizers import AdamATan2SignSGD
from lmforge.train.distributed import DistInfo


@dataclass
class PuzzleSettings:
    """Training settings of the puzzle kind (config section ``recipe``; HRM's names work too)."""

    puzzle_emb_lr: float = 1e-4  # sign-SGD learning rate of the puzzle embeddings (HRM's puzzle_emb_lr)
    puzzle_emb_weight_decay: float = 0.1

    def __post_init__(self) -> None:
        if self.puzzle_emb_lr < 0 or self.puzzle_emb_weight_decay < 0:
            raise LMForgeError("recipe.puzzle_emb_lr and recipe.puzzle_emb_weight_decay must be >= 0")


def make_optimizer(model, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamATan2 for the weights, sign-SGD for the puzzle embeddings (HRM's and TRM's optimizer)."""
    t, s = cfg.training, cfg.recipe
    groups = model.param_groups(t.weight_decay, t.lr)
    for g in groups:
        if g["name"] == "puzzle_emb":
            g.update(lr=s.puzzle_emb_lr, weight_decay=s.puzzle_emb_weight_decay, algorithm="sign_sgd")
        else:
            g["algorithm"] = "adam_atan2"
    return AdamATan2SignSGD(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def count(model, batch: dict[str, Any]) -> Counts:
    """One row = one ACT segment of one puzzle: every cell is a token."""
    rows, cells = batch["inputs"].shape
    return Counts(tokens=rows * cells, examples=rows, flops=rows * cells * flops_per_token(model, cells))


def eval_weight(batch: dict[str, Any]) -> float:
    """Evaluation means are per puzzle."""
    return float(batch["inputs"].shape[0])


def build_puzzle_data(cfg: RunConfig, distinfo: DistInfo) -> TrainData:
    """Puzzles in HRM's layout (``lmforge data sudoku`` or HRM's own builders): train + test splits.

    Fills ``model.seq_len``, ``vocab_size`` and ``num_puzzle_identifiers`` from ``dataset.json`` when
    they are 0, and refuses a model whose sizes differ from the data's.
    """
    path = Path(cfg.data.path)
    if not cfg.data.path:
        raise LMForgeError("data.path (data_path) is not set: point it at a puzzle dataset made by "
                           "`lmforge data sudoku --out DIR` (or by HRM's dataset builders)")
    if not (path / "train").is_dir():
        raise LMForgeError(f"{path} has no train/ split: build a dataset with `lmforge data sudoku --out {path}`")
    train_split = PuzzleSplit(path, "train")
    m = cfg.model
    for key, value in (("seq_len", train_split.seq_len), ("vocab_size", train_split.vocab_size),
                       ("num_puzzle_identifiers", train_split.num_puzzle_identifiers)):
        have = getattr(m, key)
        if have == 0:
            setattr(m, key, int(value))
        elif have != value:
            raise LMForgeError(f"model.{key}={have} but the dataset {path} has {key} {value}: set "
                               f"model.{key}=0 to take it from the data")
    if cfg.training.grad_accum_steps > 1 and getattr(cfg.model, "halt_max_steps", 1) > 1:
        raise LMForgeError("training.grad_accum_steps > 1 does not work with ACT models: each row of the batch "
                           "carries its puzzle from step to step, so micro-batches are not independent. Lower "
                           "global_batch_size, or set training.activation_checkpointing=true to save memory")
    mb = cfg.training.micro_batch_size
    train = GroupSampler(train_split, batch_size=mb, seed=cfg.seed, rank=distinfo.rank,
                         world_size=distinfo.world_size)
    val = None
    description = f"{path}: {train_split.num_groups:,} train groups, {train_split.num_examples:,} examples"
    if (path / "test").is_dir():
        test_split = PuzzleSplit(path, "test")
        test_ids = int(test_split.puzzle_identifiers.max()) if test_split.num_puzzles else 0
        if (test_split.seq_len, test_split.vocab_size) != (m.seq_len, m.vocab_size) or test_ids >= m.num_puzzle_identifiers:
            raise LMForgeError(f"{path}/test does not match {path}/train (seq_len {test_split.seq_len} vs "
                               f"{m.seq_len}, vocab {test_split.vocab_size} vs {m.vocab_size}, puzzle id up to "
                               f"{test_ids} of {m.num_puzzle_identifiers}): rebuild the dataset")
        val = PuzzleEvalLoader(test_split, batch_size=mb, rank=distinfo.rank, world_size=distinfo.world_size)
        description += f"; {test_split.num_examples:,} test examples"
    elif distinfo.is_main:
        print(f"note: {path} has no test/ split; evaluation is off")
    return TrainData(train=train, val=val, derive_eval_metrics=puzzle_eval_metrics, description=description,
                     examples_per_epoch=train.epoch_size)


def puzzle_eval_metrics(means: dict[str, float]) -> dict[str, float]:
    """Per-difficulty exact accuracy from the (rows in bucket, exact rows in bucket) shares."""
    out = {k: v for k, v in means.items() if not k.startswith("difficulty/")}
    for key, share in means.items():
        if key.startswith("difficulty/") and key.endswith("/n") and share > 0:
            name = key.split("/")[1]
            out[f"exact_accuracy_{name}"] = means[f"difficulty/{name}/exact"] / share
            out[f"share_{name}"] = share
    return out


