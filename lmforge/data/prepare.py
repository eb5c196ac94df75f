"""Turn sources into training artifacts: a tokenizer trained on a sample, and packed token shards.

Both work in two passes over the sources so that no corpus-sized state is held in memory: the first
pass reads and filters every document, keeping only a digest, a size and a split key per document;
the second reads them again and streams the chosen ones onward (into the BPE trainer, or tokenized
into the shard files). Sources are read in a fixed order, and the second pass checks every digest,
so the passes always agree.

Splits are by document (by file for code trees): a hash of ``seed`` and the document's source_id
decides, so a file stays in the same split across runs and never leaks into both. With ``val_sources``
(the user's own validation set) there is no hash split: the sources are train, the val sources val.
Deduplication then runs over both, train first, so a val document that duplicates a training one
(exactly, or nearly with ``near_dedup``) is dropped from val and counted as ``val_duplicate_of_train``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge.data.dedup import NearDeduper, text_digest
from lmforge.data.loader import DTYPES, FORMAT, META_FILE, VERSION
from lmforge.data.sources import (DEFAULT_INCLUDE, Document, FilterStats, dataset_dict_splits, iter_documents,
                                  source_kind, unread_splits_note)
from lmforge.errors import LMForgeError
from lmforge.tokenizer import Tokenizer, check_out_dir, train_tokenizer
from lmforge.files import atomic_directory, remove_stale

SPLITS = ("train", "val")
ENCODE_BATCH_BYTES = 1 << 20  # text per encode_batch call: its Encodings are far larger than the text
HELDOUT_MAX_BYTES = 10_000_000  # held-out text measured for the tokenizer's bytes per token
DEFAULT_VAL_FRACTION = 0.05
VAL_LEAK = "val_duplicate_of_train"  # the filter count of val documents dropped as copies of training ones


def split_key(source_id: str, seed: int) -> float:
    """A deterministic number in [0, 1) for a document; small keys go to validation."""
    digest = hashlib.blake2b(f"{seed}\0{source_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def assign_heldout(keys: np.ndarray, fraction: float) -> np.ndarray:
    """Mask of held-out documents: keys below ``fraction``, but with >= 2 documents both sides get one."""
    heldout = keys < fraction
    if fraction > 0 and len(keys) >= 2:
        if not heldout.any():
            heldout[np.argmin(keys)] = True
        if heldout.all():
            heldout[np.argmax(keys)] = False
    return heldout


@dataclass
class _Survey:
    """What the first pass learned, one entry per document that passed the filters (the sources', then
    the val sources')."""

    stats: FilterStats  # all documents
    digests: list[bytes]
    keys: np.ndarray  # split keys
    sizes: np.ndarray  # UTF-8 bytes
    keep: np.ndarray  # False for duplicates
    n_train: int  # entries from the sources; the rest are from the val sources
    train_stats: FilterStats
    val_stats: FilterStats | None  # when there are val sources


def _survey(sources: Sequence[str | Path], read_opts: dict, near_dedup: bool, seed: int,
            show_progress: bool, val_sources: Sequence[str | Path] = ()) -> _Survey:
    stats, val_stats = FilterStats(), FilterStats()
    seen: set[bytes] = set()  # digests of every training document read: the first copy wins
    seen_val: set[bytes] = set()  # of the val documents kept: a copy of one is a duplicate, not a leak
    near = NearDeduper(seed=seed) if near_dedup else None
    near_val = NearDeduper(seed=seed) if near_dedup and val_sources else None
    digests, keys, sizes, keep = [], [], [], []

    def tagged() -> Iterator[tuple[bool, Document]]:
        for doc in iter_documents(sources, stats=stats, **read_opts):
            yield False, doc
        for doc in iter_documents(val_sources, stats=val_stats, **read_opts):
            yield True, doc

    n_train = 0
    for is_val, doc in tqdm(tagged(), desc="reading", unit=" docs", disable=not show_progress):
        digest = text_digest(doc.text)
        digests.append(digest)
        keys.append(split_key(doc.source_id, seed))
        sizes.append(len(doc.text.encode("utf-8")))
        if not is_val:
            n_train += 1
            if digest in seen:
                reason = "duplicate"
            else:
                seen.add(digest)
                reason = "near_duplicate" if near is not None and not near.is_new(doc.text) else None
        elif digest in seen or (near is not None and near.is_near(doc.text)):
            reason = VAL_LEAK
        elif digest in seen_val:
            reason = "duplicate"
        elif near_val is not None and not near_val.is_new(doc.text):
            reason = "near_duplicate"
        else:
            seen_val.add(digest)
            reason = None
        if reason is not None:
            (val_stats if is_val else stats).discard(reason)
        keep.append(reason is None)
    both = FilterStats(stats.kept + val_stats.kept, stats.skipped + val_stats.skipped)
    return _Survey(both, digests, np.array(keys, dtype=np.float64), np.array(sizes, dtype=np.int64),
                   np.array(keep, dtype=bool), n_train, stats, val_stats if val_sources else None)


def _reread(sources: Sequence[str | Path], read_opts: dict, survey: _Survey) -> Iterator[tuple[int, str]]:
    """(index, text) of every filtered document again, checked against the first pass."""
    changed = LMForgeError(
        f"the sources {list(map(str, sources))} changed while they were being read. Re-run once "
        "nothing is writing to them.")
    count = 0
    for i, doc in enumerate(iter_documents(sources, **read_opts)):
        if i >= len(survey.digests) or text_digest(doc.text) != survey.digests[i]:
            raise changed
        count += 1
        yield i, doc.text
    if count != len(survey.digests):
        raise changed


class ShardWriter:
    """Appends token arrays to ``{split}_000000.bin``, ``{split}_000001.bin``, ... of fixed size."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):06d}.bin"
                self._file = open(self.directory / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
            part = tokens[:self.shard_tokens - self.shards[-1]["tokens"]]
            self._file.write(part.tobytes())  # a file write reports ENOSPC with its errno (tofile does not)
            self.shards[-1]["tokens"] += len(part)
            tokens = tokens[len(part):]
            if self.shards[-1]["tokens"] == self.shard_tokens:
                self._close_file()

    def _close_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the directory is renamed into place
        self._file.close()
        self._file = None

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_file()
        return self.shards


def _with_eos(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Concatenate the documents' ids, each followed by ``eos_id``, without a Python loop per token."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), eos_id)


def _flags(option: str) -> str:
    """How the reading options are spelled where ``option`` is: the command line's flags or a config's keys."""
    return "--include / --text-field" if option.startswith("--") else "data.include / data.text_field"


def _refuse_overlap(path: Path, sources: Sequence[str | Path], option: str) -> None:
    """A validation input that is a training input, lies inside a training directory or holds one would be
    read as training data too (a directory reads a file as one document, so no copy would be detected)."""
    here = path.resolve()
    for src in map(Path, sources):
        there = src.resolve()
        if here == there:
            raise LMForgeError(f"{option}{path} is also a training input: the same file cannot be both training "
                               "and validation data. Give the validation set only as the validation input.")
        if source_kind(src) == "hf_dataset_dict":
            continue  # only its train split is read: DS --val DS/validation holds out another split
        if here.is_relative_to(there) or there.is_relative_to(here):
            inside = here.is_relative_to(there)
            raise LMForgeError(f"{option}{path} {'lies inside' if inside else 'holds'} the training input {src}, "
                               "whose files are read as training documents: move the validation files out of "
                               "the training directory (or give the training files one by one).")


def check_val_sources(sources: Sequence[str | Path], val_sources: Sequence[str | Path], read_opts: dict,
                      option: str = "--val ") -> list[str]:
    """The val sources' kinds; a missing path, a DatasetDict whose train split would be read, an input given
    as both, and val sources without a document are errors (``option`` names them: "--val ")."""
    kinds = []
    for raw in val_sources:
        path = Path(raw)
        if not path.exists():
            raise LMForgeError(f"{option}{path} not found. Check the spelling, or create it first.")
        _refuse_overlap(path, sources, option)
        kind = source_kind(path)
        splits = dataset_dict_splits(path) if kind == "hf_dataset_dict" else []
        if "train" in splits:  # it would be read as its train split
            held = next((s for s in ("validation", "valid", "val", "dev", "test") if s in splits), "SPLIT")
            raise LMForgeError(f"{option}{path} is a DatasetDict with splits {', '.join(splits)}, and its train "
                               f"split is the one read: name the split to hold out, e.g. {option}{path / held}")
        kinds.append(kind)
    # Before the (long) first pass: read until the first document, so an empty val set fails fast.
    if val_sources and next(iter_documents(val_sources, **read_opts), None) is None:
        raise LMForgeError(f"{option}{' '.join(map(str, val_sources))} yields no documents (all empty, or no file "
                           f"matches the include globs). Check the validation inputs and {_flags(option)}.")
    return kinds


def _check_out_dir(out: Path, overwrite: bool, sources: Sequence[str | Path], tokenizer_path: Path | None) -> None:
    remove_stale(out)  # a run killed mid-replacement may have moved the previous data aside
    if out.exists() and not out.is_dir():
        raise LMForgeError(f"--out {out} is a file, not a directory. Choose a directory path.")
    in_the_way = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if in_the_way is not None and not in_the_way.is_dir():
        raise LMForgeError(f"--out {out} cannot be made: {in_the_way} is a file, not a directory. Choose another "
                           "--out directory, or move the file away.")
    for src in [*map(Path, sources), *([tokenizer_path] if tokenizer_path else [])]:
        src = src.resolve()
        if out.is_relative_to(src) or src.is_relative_to(out):
            raise LMForgeError(f"--out {out} overlaps the input {src}; choose an output directory that neither "
                               "contains nor lies inside the inputs and the tokenizer.")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise LMForgeError(
                f"--out {out} already exists and is not empty; refusing to overwrite it. Pass --overwrite "
                "(overwrite=True) to replace it, or choose another --out directory.")
        if not (out / META_FILE).is_file():
            raise LMForgeError(
                f"--out {out} is not empty and is not an lmforge data directory (no {META_FILE}); --overwrite "
                "only replaces earlier `lmforge data prepare` output. Choose another --out directory.")


def _write_splits(tmp: Path, sources: Sequence[str | Path], read_opts: dict, survey: _Survey,
                  is_val: np.ndarray, tok: Tokenizer, dtype: np.dtype, shard_tokens: int,
                  show_progress: bool) -> dict[str, list[dict]]:
    writers = {split: ShardWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
    pending: dict[str, list[str]] = {split: [] for split in SPLITS}
    pending_bytes = dict.fromkeys(SPLITS, 0)
    bar = tqdm(total=int(survey.sizes[survey.keep].sum()), desc="tokenizing", unit="B", unit_scale=True,
               disable=not show_progress)

    def flush(split: str) -> None:
        if pending[split]:
            writers[split].write(_with_eos(tok.encode_batch(pending[split]), tok.eos_id, dtype))
            bar.update(pending_bytes[split])
        pending[split], pending_bytes[split] = [], 0

    for i, text in _reread(sources, read_opts, survey):
        if not survey.keep[i]:
            continue
        split = "val" if is_val[i] else "train"
        pending[split].append(text)
        pending_bytes[split] += int(survey.sizes[i])
        if pending_bytes[split] >= ENCODE_BATCH_BYTES:
            flush(split)
    for split in SPLITS:
        flush(split)
    bar.close()
    return {split: writer.close() for split, writer in writers.items()}


def prepare_data(sources: Sequence[str | Path], out_dir: str | Path, tokenizer: Tokenizer | str | Path,
                 include: Sequence[str] = DEFAULT_INCLUDE, text_field: str = "text",
                 exclude_tests: bool = False, near_dedup: bool = False, val_fraction: float | None = None,
                 seed: int = 1337, shard_tokens: int = 100_000_000, overwrite: bool = False,
                 show_progress: bool = True, val_sources: Sequence[str | Path] = (), val_option: str = "--val ") -> dict:
    """Filter, deduplicate, split and tokenize ``sources`` into ``out_dir``; returns its meta.json.

    The val split is ``val_fraction`` (default 0.05) of the documents by a hash split, or, with
    ``val_sources``, exactly the documents of those (less copies of training documents); not both.
    ``out_dir`` appears only once complete (it is built in a hidden sibling and renamed), so an
    interrupted run never leaves a directory that looks valid. It holds a copy of the tokenizer.
    ``val_option`` is how messages name the validation inputs ("--val ", or "data.val_path=" in training).
    """
    if not sources:
        raise LMForgeError("no input paths given: pass one or more directories or files to read.")
    if val_sources and val_fraction is not None:
        raise LMForgeError(f"--val-fraction {val_fraction} and --val both given: --val holds out exactly its "
                           "documents (no hash split). Drop --val-fraction, or drop --val to split the inputs.")
    val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    if not 0 < val_fraction < 1:
        raise LMForgeError(f"--val-fraction {val_fraction} must be between 0 and 1 (0.05 is typical).")
    if shard_tokens < 1:
        raise LMForgeError(f"--shard-tokens {shard_tokens} must be at least 1.")
    kinds = [source_kind(Path(s)) for s in sources]  # fails fast on a missing path
    read_opts = {"include": tuple(include), "text_field": text_field, "exclude_tests": exclude_tests}
    val_kinds = check_val_sources(sources, val_sources, read_opts, option=val_option)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    out = Path(out_dir).resolve()  # resolved so that "." still has a name for the temporary sibling
    _check_out_dir(out, overwrite, [*sources, *val_sources],
                   Path(tok.origin) if Path(tok.origin).exists() else None)
    for src, kind in zip(sources, kinds, strict=True):
        note = unread_splits_note(Path(src), [*sources, *val_sources]) if kind == "hf_dataset_dict" else None
        if note:
            print(note, file=sys.stderr)
    survey = _survey(sources, read_opts, near_dedup, seed, show_progress, val_sources)
    if survey.train_stats.kept == 0:
        raise LMForgeError(
            f"no documents left to prepare from {list(map(str, sources))} (filters: "
            f"{survey.train_stats.as_dict()}). Check the inputs and {_flags(val_option)}.")
    is_val = np.zeros(len(survey.keep), dtype=bool)
    if val_sources:
        is_val[survey.n_train:] = survey.keep[survey.n_train:]
        if not is_val.any():
            raise LMForgeError(
                f"every document of {val_option}{' '.join(map(str, val_sources))} duplicates a training document "
                f"({survey.val_stats.skipped[VAL_LEAK]} exact or near copies), so the val split would be empty: "
                "the training inputs already contain the validation set. Give held-out data as the validation "
                "set, or remove it from the training inputs.")
    else:
        is_val[survey.keep] = assign_heldout(survey.keys[survey.keep], val_fraction)
    dtype_name = "uint16" if tok.vocab_size <= 2**16 else "uint32"

    with atomic_directory(out) as tmp:
        shards = _write_splits(tmp, [*sources, *val_sources], read_opts, survey, is_val, tok, DTYPES[dtype_name],
                               shard_tokens, show_progress)
        splits = {}
        for split, members in (("train", survey.keep & ~is_val), ("val", is_val)):
            splits[split] = {"shards": shards[split], "tokens": sum(s["tokens"] for s in shards[split]),
                             "documents": int(members.sum()), "bytes": int(survey.sizes[members].sum())}
        meta = {
            "format": FORMAT, "version": VERSION, "dtype": dtype_name, "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256, "eos_id": tok.eos_id, "document_separator": tok.special_tokens["eos"],
            "splits": splits, "filters": survey.stats.as_dict(),
            "sources": [{"path": str(Path(s).resolve()), "kind": kind}
                        for s, kind in zip(sources, kinds, strict=True)],
            "val_sources": [{"path": str(Path(s).resolve()), "kind": kind}
                            for s, kind in zip(val_sources, val_kinds, strict=True)],
            "settings": {"include": list(include), "text_field": text_field, "exclude_tests": exclude_tests,
                         "near_dedup": near_dedup, "val_fraction": None if val_sources else val_fraction,
                         "seed": seed, "shard_tokens": shard_tokens},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if survey.val_stats is not None:
            meta["val_filters"] = survey.val_stats.as_dict()
        tok.save(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def train_tokenizer_from_sources(
        sources: Sequence[str | Path], out_dir: str | Path, vocab_size: int = 8192,
        include: Sequence[str] = DEFAULT_INCLUDE, text_field: str = "text", exclude_tests: bool = False,
        min_frequency: int = 2, max_bytes: int = 50_000_000, heldout_fraction: float = 0.01,
        seed: int = 1337, show_progress: bool = True, overwrite: bool = False) -> dict:
    """Train a tokenizer on a sample of ``sources`` and measure it on held-out documents.

    Documents are filtered and exactly deduplicated as in ``prepare_data``. ``heldout_fraction`` of
    them (by the same hash split, at least one when there are >= 2) are held out; the training sample
    is a uniform random subset (by split key) of the rest, capped at ``max_bytes`` of UTF-8. Bytes per
    token is measured on up to ``HELDOUT_MAX_BYTES`` of held-out text. Returns a report dict.
    """
    if max_bytes < 1:
        raise LMForgeError(f"--max-bytes {max_bytes} must be positive (e.g. 50000000 for 50 MB).")
    if not 0 <= heldout_fraction < 1:
        raise LMForgeError(f"--heldout-fraction {heldout_fraction} must be in [0, 1) (0.01 is typical).")
    for src in sources:
        source_kind(Path(src))  # fails fast on a missing path
    check_out_dir(Path(out_dir), overwrite)  # before the (long) survey and training
    read_opts = {"include": tuple(include), "text_field": text_field, "exclude_tests": exclude_tests}
    survey = _survey(sources, read_opts, near_dedup=False, seed=seed, show_progress=show_progress)
    heldout = np.zeros(len(survey.keep), dtype=bool)
    heldout[survey.keep] = assign_heldout(survey.keys[survey.keep], heldout_fraction)
    # Lowest split keys first until the byte budget is spent: a uniform sample, the same every run.
    candidates = np.flatnonzero(survey.keep & ~heldout)
    order = candidates[np.argsort(survey.keys[candidates], kind="stable")]
    spent_before = np.cumsum(survey.sizes[order]) - survey.sizes[order]
    sample = np.zeros(len(survey.keep), dtype=bool)
    sample[order[spent_before < max_bytes]] = True
    heldout_texts: list[str] = []

    def training_texts() -> Iterator[str]:
        heldout_bytes = 0
        for i, text in _reread(sources, read_opts, survey):
            if sample[i]:
                yield text
            elif heldout[i] and heldout_bytes < HELDOUT_MAX_BYTES:
                heldout_texts.append(text)
                heldout_bytes += int(survey.sizes[i])

    path = train_tokenizer(training_texts(), vocab_size, out_dir, min_frequency, show_progress, overwrite)
    tok = Tokenizer.load(path)
    return {
        "tokenizer": str(path), "vocab_size": tok.vocab_size, "filters": survey.stats.as_dict(),
        "train_documents": int(sample.sum()), "train_bytes": int(survey.sizes[sample].sum()),
        "heldout_documents": len(heldout_texts),
        "heldout_bytes": sum(len(t.encode("utf-8")) for t in heldout_texts),
        "heldout_bytes_per_token": tok.bytes_per_token(heldout_texts) if heldout_texts else None,
    }
