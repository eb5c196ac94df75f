"""Build the loop's data bundle from a run config (token shards for language models)."""

from __future__ import annotations

import shutil
from pathlib import Path

from lmforge.config import RunConfig
from lmforge.errors import LMForgeError
from lmforge.eval.lm import lm_metrics
from lmforge.train.distributed import DistInfo, barrier
from lmforge.train.loop import DataBundle


DEFAULT_TRAINED_VOCAB = 8192  # data.train_path without a tokenizer and with model.vocab_size 0


def token_data_dir(cfg: RunConfig) -> Path:
    """Where the token shards are: data.path, or RUN_DIR/data for data.train_path."""
    return Path(cfg.data.path) if cfg.data.path or not cfg.data.train_path else cfg.run_dir / "data"


def prepare_train_path(cfg: RunConfig, distinfo: DistInfo) -> None:
    """data.train_path (raw JSONL / text / a directory): tokenize it into RUN_DIR/data once, with
    data.tokenizer or a tokenizer trained on it (model.vocab_size tokens, or 8192), and reuse that
    directory on resumed runs. Rank 0 does the work; the others wait."""
    from lmforge.data import prepare_data, train_tokenizer_from_sources
    from lmforge.data.loader import read_meta
    from lmforge.tokenizer import Tokenizer

    src, out = Path(cfg.data.train_path), token_data_dir(cfg)
    if distinfo.is_main:
        if not src.exists():
            raise LMForgeError(f"data.train_path={src} does not exist: point it at a JSONL file of "
                               '{"text": ...} records, a text file or a directory of files')
        include = tuple(cfg.data.include)
        if (out / "meta.json").is_file():
            meta = read_meta(out)
            prepared_from = [s["path"] for s in meta["sources"]]
            if prepared_from != [str(src.resolve())]:
                raise LMForgeError(f"{out} was prepared from {prepared_from}, not data.train_path={src}; "
                                   "train into a new run (name=NEW) or delete that directory")
            if cfg.data.tokenizer and Tokenizer.load(cfg.data.tokenizer).sha256 != meta["tokenizer_sha256"]:
                raise LMForgeError(f"{out} was tokenized with another tokenizer than data.tokenizer="
                                   f"{cfg.data.tokenizer}; train into a new run (name=NEW)")
            print(f"data: reusing {out} (prepared from {src})")
        else:
            tokenizer: Path | str = cfg.data.tokenizer
            scratch = cfg.run_dir / ".tokenizer-training"  # the tokenizer's lasting copy goes into `out`
            try:
                if not tokenizer:
                    vocab = getattr(cfg.model, "vocab_size", 0) or DEFAULT_TRAINED_VOCAB
                    print(f"data: no data.tokenizer given: training a {vocab}-token byte-level BPE on {src}")
                    train_tokenizer_from_sources([src], scratch, vocab_size=vocab, include=include,
                                                 text_field=cfg.data.text_field, seed=cfg.seed, overwrite=True)
                    tokenizer = scratch
                print(f"data: tokenizing {src} into {out}")
                prepare_data([src], out, tokenizer, include=include, text_field=cfg.data.text_field,
                             val_fraction=cfg.data.val_fraction, seed=cfg.seed)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    barrier(distinfo)


def build_token_data(cfg: RunConfig, distinfo: DistInfo) -> DataBundle:
    from lmforge.data.loader import PackedLoader, TokenDataset, read_meta

    path = token_data_dir(cfg)
    if not cfg.data.path and not cfg.data.train_path:
        raise LMForgeError("no training data: set data.train_path to a JSONL file of {\"text\": ...} records "
                           "(or a text file / directory), or data.path to a directory made by `lmforge data "
                           "prepare` (e.g. data.path=data/go)")
    if not path.exists():
        raise LMForgeError(f"data.path={path} does not exist; run `lmforge data prepare SRC --tokenizer TOK "
                           f"--out {path}` first")
    train_ds = TokenDataset(path, "train")
    mb, seq = cfg.training.micro_batch_size, cfg.data.seq_len
    train = PackedLoader(train_ds, seq_len=seq, micro_batch_size=mb, rank=distinfo.rank,
                         world_size=distinfo.world_size, seed=cfg.seed, shuffle=True)
    val, val_ds = None, None
    if "val" in read_meta(path)["splits"]:  # a val split that is there but corrupt raises, never hides
        val_ds = TokenDataset(path, "val")
        if val_ds.num_tokens > seq:
            val = PackedLoader(val_ds, seq_len=seq, micro_batch_size=mb, rank=distinfo.rank,
                               world_size=distinfo.world_size, seed=cfg.seed, shuffle=False)
    if val is None and distinfo.is_main:
        print(f"note: {path} has no validation split longer than data.seq_len={seq}; evaluation is off")

    bytes_per_token = val_ds.bytes / val_ds.num_tokens if val is not None and val_ds.num_tokens else 0.0

    def derive(metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, **lm_metrics(metrics["loss"], bytes_per_token)}

    return DataBundle(train=train, val=val, tokens_per_micro_batch=mb * seq, seq_len=seq,
                      derive_eval_metrics=derive, examples_per_epoch=train.num_windows,
                      description=f"{path}: {train_ds.num_tokens:,} train tokens"
                                  + (f", {val_ds.num_tokens:,} val tokens" if val is not None else ""))


def build_puzzle_data(cfg: RunConfig, distinfo: DistInfo) -> DataBundle:
    """Puzzles in HRM's layout (``lmforge data sudoku`` or HRM's own builders): train + test splits.

    Fills ``model.seq_len``, ``vocab_size`` and ``num_puzzle_identifiers`` from ``dataset.json`` when
    they are 0, and refuses a model whose sizes differ from the data's.
    """
    from lmforge.data.puzzles import GroupSampler, PuzzleEvalLoader, PuzzleSplit

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
    return DataBundle(train=train, val=val, tokens_per_micro_batch=mb * train_split.seq_len,
                      seq_len=train_split.seq_len, derive_eval_metrics=puzzle_eval_metrics,
                      description=description, best_metric="eval/exact_accuracy", best_higher_is_better=True,
                      examples_per_epoch=train.epoch_size, tokens_per_example=train_split.seq_len,
                      eval_weight_by_rows=True)


def puzzle_eval_metrics(means: dict[str, float]) -> dict[str, float]:
    """Per-difficulty exact accuracy from the (rows in bucket, exact rows in bucket) shares."""
    out = {k: v for k, v in means.items() if not k.startswith("difficulty/")}
    for key, share in means.items():
        if key.startswith("difficulty/") and key.endswith("/n") and share > 0:
            name = key.split("/")[1]
            out[f"exact_accuracy_{name}"] = means[f"difficulty/{name}/exact"] / share
            out[f"share_{name}"] = share
    return out
