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


def build_go_function_data(cfg: RunConfig, distinfo: DistInfo) -> tuple[DataBundle, Path]:
    """HRGC's data: ``lmforge data go-functions`` records (train + val splits) tokenized with
    data.tokenizer, or with a byte-level BPE trained on the train split into RUN_DIR/data (reused on
    resume). Fills model.vocab_size (when 0) and the special-token ids from the tokenizer."""
    from lmforge.data.go_functions import go_parser, read_go_functions
    from lmforge.data.hrgc_data import EncodedFunctions, HRGCEvalLoader, HRGCTrainLoader, SequenceFormat
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    path, m, t = Path(cfg.data.path), cfg.model, cfg.training
    if not cfg.data.path:
        raise LMForgeError("data.path is not set: point it at a directory made by `lmforge data go-functions "
                           "SRC_DIR --out DIR` (e.g. data.path=data/go-functions)")
    if not (path / "train.jsonl").is_file():
        raise LMForgeError(f"{path} has no train.jsonl: build it with `lmforge data go-functions SRC_DIR --out {path}`")
    train_functions = list(read_go_functions(path / "train.jsonl"))
    if cfg.data.tokenizer:
        tokenizer_path = Path(cfg.data.tokenizer)
        tokenizer_path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
        if not tokenizer_path.is_file():
            raise LMForgeError(f"data.tokenizer={cfg.data.tokenizer}: no tokenizer.json there")
    else:
        tokenizer_path = cfg.run_dir / "data" / "tokenizer.json"
        if distinfo.is_main and not tokenizer_path.is_file():
            vocab = m.vocab_size or DEFAULT_TRAINED_VOCAB
            print(f"data: no data.tokenizer given: training a {vocab}-token byte-level BPE on {path}/train.jsonl")
            texts = (f"{f.spec}\n{f.plan}\n{f.code}" for f in train_functions)
            train_tokenizer(texts, vocab, tokenizer_path.parent, show_progress=cfg.logging.progress_bar, overwrite=True)
        barrier(distinfo)
    tok = Tokenizer.load(tokenizer_path)
    if m.vocab_size == 0:
        m.vocab_size = tok.vocab_size
    elif m.vocab_size < tok.vocab_size:
        raise LMForgeError(f"model.vocab_size={m.vocab_size} but the tokenizer {tokenizer_path} has {tok.vocab_size} "
                           f"tokens: set model.vocab_size={tok.vocab_size} (or 0 to take it from the tokenizer)")
    m.eos_token_id, m.pad_token_id = tok.eos_id, tok.pad_id
    m.bos_token_id = tok.eos_id if tok.bos_id is None else tok.bos_id

    fmt = SequenceFormat(tok, m.hierarchical)
    parser = go_parser()
    planner_n, generator_n = m.planner_config.n_positions, m.generator_config.n_positions
    train_data = EncodedFunctions(train_functions, fmt, planner_n, generator_n)
    mb = t.micro_batch_size
    train = HRGCTrainLoader(train_data, parser, mb, cfg.seed, distinfo.rank, distinfo.world_size, t.grad_accum_steps,
                            m.refinement_warmup, m.own_failure_share)
    val, val_data = None, None
    if (path / "val.jsonl").is_file():
        val_data = EncodedFunctions(list(read_go_functions(path / "val.jsonl")), fmt, planner_n, generator_n)
        if len(val_data) >= 1:
            val = HRGCEvalLoader(val_data, parser, mb, cfg.seed, distinfo.rank, distinfo.world_size)
    if val is None and distinfo.is_main:
        print(f"note: {path} has no val.jsonl with functions that fit; evaluation is off")
    probe = None
    if m.validation_frequency > 0:
        from lmforge.infer.hrgc import WritingProbe

        probe = WritingProbe(train, tok, parser, m.validation_samples, cfg.seed)
    skipped = train_data.too_long + (val_data.too_long if val_data is not None else 0)
    description = (f"{path}: {len(train_data):,} train functions"
                   + (f", {len(val_data):,} val" if val_data is not None else "")
                   + (f" ({skipped:,} longer than the contexts left out)" if skipped else ""))
    mean_tokens = float(train_data.lengths.mean()) if len(train_data) else 0.0
    bundle = DataBundle(train=train, val=val, tokens_per_micro_batch=max(1, round(mb * mean_tokens)),
                        seq_len=generator_n, description=description, examples_per_epoch=len(train_data),
                        eval_weight_by_rows=True, probe=probe, probe_interval=m.validation_frequency)
    return bundle, tokenizer_path
