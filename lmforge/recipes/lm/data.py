"""The language-model kind's data: token shards (``lmforge data prepare``), or raw text prepared into the
run on first use, checked against the tokenizer and the model."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from lmforge.config import RunConfig
from lmforge.errors import LMForgeError
from lmforge.eval.lm import lm_metrics
from lmforge.recipes import TrainData
from lmforge.tokenizer import DEFAULT_TRAINED_VOCAB, Tokenizer, require_same_tokenizer, unused_vocab
from lmforge.train.distributed import DistInfo, barrier


def token_data_dir(cfg: RunConfig) -> Path:
    """Where the token shards are: data.path, or RUN_DIR/data for data.train_path."""
    return Path(cfg.data.path) if cfg.data.path or not cfg.data.train_path else cfg.run_dir / "data"


def given_tokenizer(cfg: RunConfig) -> str:
    """data.tokenizer; else, when fine-tuning (training.init_from), the tokenizer of the weights it starts
    from (their ids mean nothing with another one); else "" (the data's own, or one trained on it)."""
    if not cfg.training.init_from:
        return cfg.data.tokenizer
    from lmforge.checkpoint import resolve_model_dir
    from lmforge.infer.loading import find_tokenizer

    theirs = find_tokenizer(resolve_model_dir(cfg.training.init_from))
    if cfg.data.tokenizer:
        require_same_tokenizer(cfg.data.tokenizer, theirs, cfg.training.init_from)
        return cfg.data.tokenizer
    return str(theirs)


def prepared_data_mismatch(cfg: RunConfig, data_dir: Path, given: str | None = None) -> str | None:
    """Why the data prepared in ``data_dir`` (RUN_DIR/data, with its meta.json) is not what this config's
    data.train_path makes: prepared from another path, with another validation set (data.val_path, or
    data.val_fraction's split), or tokenized with another tokenizer than the one given (``given``: the
    ``given_tokenizer``, found here when None). None when it is. Raises LMForgeError when meta.json cannot
    be read. ``prepare_train_path`` refuses such data; `lmforge pipeline` prepares it again instead of
    reusing it."""
    from lmforge.data.loader import read_meta

    out, src = Path(data_dir), Path(cfg.data.train_path)
    val = [Path(cfg.data.val_path)] if cfg.data.val_path else []
    meta = read_meta(out)
    prepared_from = [s.get("path") for s in meta.get("sources") or []]
    if prepared_from != [str(src.resolve())]:
        return (f"{out} was prepared from {prepared_from}, not data.train_path={src}; train into a new run "
                "(name=NEW) or delete that directory")
    held_out = [s.get("path") for s in meta.get("val_sources") or []]  # data of older runs has none
    if held_out != [str(v.resolve()) for v in val]:
        was = (f"the validation set {held_out[0]}" if held_out
               else "data.val_fraction's split (no data.val_path)")
        now = f"data.val_path={val[0]}" if val else "no data.val_path"
        return (f"{out} was prepared with {was}, but this run has {now}; train into a new run (name=NEW), or "
                "delete that directory to prepare it again")
    given = given_tokenizer(cfg) if given is None else given
    if given and Tokenizer.load(given).sha256 != meta.get("tokenizer_sha256"):
        return f"{out} was tokenized with another tokenizer than {given}; train into a new run (name=NEW)"
    return None


def prepare_train_path(cfg: RunConfig, distinfo: DistInfo) -> None:
    """data.train_path (raw JSONL / text / a directory): tokenize it into RUN_DIR/data once, with
    data.tokenizer or a tokenizer trained on it (model.vocab_size tokens, or 8192), and reuse that
    directory on resumed runs. data.val_path, if given, is the val split (else data.val_fraction of
    data.train_path); the tokenizer is trained on data.train_path only. Rank 0 does the work; the others
    wait."""
    from lmforge.data import prepare_data, train_tokenizer_from_sources
    from lmforge.data.prepare import VAL_LEAK, check_val_sources

    src, out = Path(cfg.data.train_path), token_data_dir(cfg)
    val = [Path(cfg.data.val_path)] if cfg.data.val_path else []
    given = given_tokenizer(cfg)
    if distinfo.is_main:
        if not src.exists():
            raise LMForgeError(f"data.train_path={src} does not exist: point it at a JSONL file of "
                               '{"text": ...} records, a text file or a directory of files')
        include = tuple(cfg.data.include)
        if (out / "meta.json").is_file():
            problem = prepared_data_mismatch(cfg, out, given)
            if problem:
                raise LMForgeError(problem)
            print(f"data: reusing {out} (prepared from {src})")
        else:
            # before a tokenizer is trained: a missing, empty or doubly given data.val_path fails fast
            check_val_sources([src], val, {"include": include, "text_field": cfg.data.text_field},
                              option="data.val_path=")
            tokenizer: Path | str = given
            scratch = cfg.run_dir / ".tokenizer-training"  # the tokenizer's lasting copy goes into `out`
            try:
                if not tokenizer:
                    vocab = getattr(cfg.model, "vocab_size", 0) or DEFAULT_TRAINED_VOCAB
                    print(f"data: no data.tokenizer given: training a {vocab}-token byte-level BPE on {src}")
                    train_tokenizer_from_sources([src], scratch, vocab_size=vocab, include=include,
                                                 text_field=cfg.data.text_field, seed=cfg.seed, overwrite=True)
                    tokenizer = scratch
                print(f"data: tokenizing {src}" + (f" (validation: {val[0]})" if val else "") + f" into {out}")
                meta = prepare_data([src], out, tokenizer, include=include, text_field=cfg.data.text_field,
                                    val_fraction=None if val else cfg.data.val_fraction, seed=cfg.seed,
                                    val_sources=val, val_option="data.val_path=")
                leaked = meta.get("val_filters", {}).get("skipped", {}).get(VAL_LEAK, 0)
                if leaked:
                    print(f"warning: {leaked} documents of data.val_path={val[0]} duplicate documents of "
                          f"data.train_path={src} (exact or near copies) and were left out of the val split")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    barrier(distinfo)


def build_token_data(cfg: RunConfig, distinfo: DistInfo) -> TrainData:
    from lmforge.data.loader import PackedLoader, TokenDataset, read_meta

    path = token_data_dir(cfg)
    if not cfg.data.path and not cfg.data.train_path:
        raise LMForgeError("no training data: set data.train_path to a JSONL file of {\"text\": ...} records "
                           "(or a text file / directory), or data.path to a directory made by `lmforge data "
                           "prepare` (e.g. data.path=data/go). No data at hand: `lmforge data stories --out DIR` "
                           "writes a small story corpus in seconds (then data.train_path=DIR/train.txt "
                           "data.val_path=DIR/val.txt), and `lmforge bench RECIPE` runs the model on random "
                           "tokens")
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

    @functools.cache  # at the first evaluation: by then the tokenizer is known to be the data's (check_vocab)
    def bytes_per_token() -> float:
        return _eval_bytes_per_token(val, cfg.training.eval_batches or None, Tokenizer.load(tokenizer_path(cfg)))

    def derive(metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, **lm_metrics(metrics["loss"], bytes_per_token())}

    return TrainData(train=train, val=val, derive_eval_metrics=derive, examples_per_epoch=train.num_windows,
                     description=f"{path}: {train_ds.num_tokens:,} train tokens"
                                 + (f", {val_ds.num_tokens:,} val tokens" if val is not None else ""))


def _eval_bytes_per_token(val, max_batches: int | None, tokenizer: Tokenizer) -> float:
    """UTF-8 bytes per target token of the windows an evaluation scores (``training.eval_batches`` of them on
    every rank, or all): bits per byte of exactly those, not of the split's average."""
    targets = val.eval_windows(max_batches) * val.seq_len
    chunk = 1 << 23  # read a large split in pieces
    total = sum(tokenizer.text_bytes(val.dataset.read(lo, min(lo + chunk, targets + 1)))
                for lo in range(1, targets + 1, chunk))
    return total / targets


def build_lm_data(cfg: RunConfig, distinfo: DistInfo) -> TrainData:
    """``RecipeSpec.build_data`` of the lm kind: prepares data.train_path if given, then the shards."""
    n_positions = cfg.model.n_positions
    if cfg.data.seq_len > n_positions:
        raise LMForgeError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context "
                           f"model.n_positions={n_positions}; lower one or raise the other")
    if cfg.data.train_path:
        prepare_train_path(cfg, distinfo)
    data = build_token_data(cfg, distinfo)
    data.tokenizer_path = tokenizer_path(cfg)
    check_vocab(cfg, data.tokenizer_path, distinfo.is_main)
    return data


def tokenizer_path(cfg: RunConfig) -> Path:
    given = given_tokenizer(cfg)
    path = Path(given) if given else token_data_dir(cfg)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise LMForgeError(f"tokenizer {path} not found: set data.tokenizer=PATH/tokenizer.json (or a Hugging "
                           "Face tokenizer directory), or prepare the data with `lmforge data prepare`, which "
                           "stores the tokenizer beside the shards")
    return path


def check_vocab(cfg: RunConfig, tokenizer_path: Path, is_main: bool) -> None:
    """The data, tokenizer and model agree; fills model.vocab_size (if 0) and the special-token ids."""
    from lmforge.data.loader import TokenDataset

    tok = Tokenizer.load(tokenizer_path)
    data_dir = token_data_dir(cfg)
    meta = TokenDataset(data_dir, "train")
    if meta.tokenizer_sha256 and meta.tokenizer_sha256 != tok.sha256:
        # with training.init_from the tokenizer is the weights' (another would be refused): only the data can change
        other = ("" if cfg.training.init_from else
                 " or point data.tokenizer at the one the data was made with")
        raise LMForgeError(f"the data in {data_dir} was tokenized with a different tokenizer than "
                           f"{tokenizer_path}; re-run `lmforge data prepare` with this tokenizer{other}")
    model_vocab = getattr(cfg.model, "vocab_size", None)
    if model_vocab is None:
        return
    if model_vocab == 0:
        cfg.model.vocab_size = tok.vocab_size
    elif model_vocab < tok.vocab_size or model_vocab < meta.vocab_size:
        raise LMForgeError(f"model.vocab_size={model_vocab} but the tokenizer {tokenizer_path} has "
                           f"{tok.vocab_size} tokens: set model.vocab_size={tok.vocab_size} (or 0 to take it "
                           "from the tokenizer)")
    elif unused_vocab(model_vocab, tok.vocab_size) and is_main:
        print(f"note: model.vocab_size={model_vocab} but the tokenizer {tokenizer_path} has {tok.vocab_size} "
              f"tokens: {model_vocab - tok.vocab_size} rows of the embedding and head will never be trained "
              "(model.vocab_size=0 takes the tokenizer's size)")
    for key, value in (("eos_token_id", tok.eos_id), ("bos_token_id", tok.bos_id), ("pad_token_id", tok.pad_id)):
        if hasattr(cfg.model, key):
            setattr(cfg.model, key, tok.eos_id if value is None else value)
