"""Read raw documents from the places a corpus lives, applying Go-aware filters to source trees.

A source path is one of (detected from the path):

* a directory tree: every file matching the ``include`` globs (relative to the directory, pathlib
  style, default ``**/*.go``) is one document, ``source_id`` = its path relative to the directory;
* a Hugging Face dataset written by ``save_to_disk`` (a directory with ``dataset_info.json`` and
  ``state.json``): one document per row. For a ``DatasetDict`` (``dataset_dict.json``) only the
  ``train`` split is read when there is one (a benchmark's test split must never become training
  data); otherwise every split, in name order. ``source_id`` = ``NAME#row`` or ``NAME#split/row``.
  Each split is a sub-directory that is itself a dataset, so ``NAME/validation`` reads that split;
* a ``.jsonl`` file: one JSON object per line, ``source_id`` = ``NAME:line``;
* a ``.parquet`` file: one document per row of the text column, ``source_id`` = ``NAME#row``;
* any other file (``.txt``, ``.md``, ...): the whole file is one document, ``source_id`` = its name;
  except a file of stories separated by lines that hold only ``<|endoftext|>`` (TinyStories as
  released, ``TinyStoriesV2-GPT4-train.txt``; ``lmforge data stories`` writes the same): each story is
  one document, stripped of the blank lines around it, ``source_id`` = ``NAME#k`` (k = 0, 1, ... in
  file order). Nothing between two separators is no story; the text after the last separator is the
  last story. A marker inside a line of text does not separate; a file without a separator line
  stays one document.

Files in trees that are binary or not UTF-8 are skipped and counted, never decoded with replacement
characters (those would teach the model garbage). Inside trees, anything under ``vendor/`` or
``testdata/``, Go files marked ``// Code generated ... DO NOT EDIT.`` and, optionally, ``*_test.go``
files are skipped too. Empty documents are skipped everywhere.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.errors import LMForgeError

DEFAULT_INCLUDE = ("**/*.go",)
SKIPPED_DIRS = ("vendor", "testdata")  # Go's conventions for third-party code and test fixtures
# Go's marker for generated files (https://go.dev/s/generatedcode); \r? tolerates CRLF checkouts.
GENERATED_MARKER = re.compile(r"^// Code generated .* DO NOT EDIT\.\r?$", re.MULTILINE)
PACKAGE_CLAUSE = re.compile(r"^package\s", re.MULTILINE)
STORY_SEPARATOR = b"<|endoftext|>"  # a line of its own between stories in a text file (TinyStories)
_RECORD_BATCH = 1024  # rows per read from parquet / HF datasets


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    source_id: str


@dataclass
class FilterStats:
    """How many documents were kept, and how many were skipped for each reason."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def discard(self, reason: str) -> None:
        """Turn one kept document into a skipped one (used by later stages such as dedup)."""
        self.kept -= 1
        self.skipped[reason] += 1

    def as_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(sorted(self.skipped.items()))}


def source_kind(path: Path) -> str:
    """One of ``hf_dataset``, ``hf_dataset_dict``, ``directory``, ``jsonl``, ``parquet``, ``text``."""
    if not path.exists():
        raise LMForgeError(f"input path not found: {path}. Check the spelling, or create it first.")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return "hf_dataset_dict"
        if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
            return "hf_dataset"
        return "directory"
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def dataset_dict_splits(path: Path) -> list[str]:
    """The split names of a ``DatasetDict`` saved with ``save_to_disk`` (from its ``dataset_dict.json``)."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LMForgeError(f"{path / 'dataset_dict.json'} is not a readable DatasetDict index ({e}). Save the "
                           "dataset again with save_to_disk.") from e
    return [str(s) for s in splits]


def splits_read(splits: Sequence[str]) -> list[str]:
    """Which splits of a ``DatasetDict`` are read: ``train`` alone when there is one, else all in name order."""
    return ["train"] if "train" in splits else sorted(splits)


def unread_splits_note(path: Path, inputs: Sequence[str | Path] = ()) -> str | None:
    """A note naming the splits of a ``DatasetDict`` at ``path`` that are not read, and how to hold one out;
    None when every split is read or one of its splits is among ``inputs`` (the user knows them)."""
    splits = dataset_dict_splits(path)
    read = splits_read(splits)
    unread = [s for s in sorted(splits) if s not in read]
    given = {Path(p).resolve() for p in inputs}
    if not unread or any((path / s).resolve() in given for s in splits):
        return None
    held = next((s for s in ("validation", "valid", "val", "dev") if s in unread), unread[0])
    return (f"note: {path} has splits {', '.join(sorted(splits))}; read {', '.join(read)} only. To hold out "
            f"its {held} split: --val {path / held} (data.val_path={path / held} in a training config).")


def iter_documents(paths: Sequence[str | Path], include: Sequence[str] = DEFAULT_INCLUDE,
                   text_field: str = "text", exclude_tests: bool = False,
                   stats: FilterStats | None = None) -> Iterator[Document]:
    """Documents from every path in order, filtered; counts go into ``stats`` when given."""
    stats = stats if stats is not None else FilterStats()
    for raw in paths:
        path = Path(raw)
        kind = source_kind(path)
        if kind == "directory":
            docs = iter_tree(path, include, exclude_tests, stats)
        elif kind == "jsonl":
            docs = _iter_jsonl(path, text_field)
        elif kind == "parquet":
            docs = _iter_parquet(path, text_field)
        elif kind == "text":
            docs = _iter_text_file(path, stats)
        else:
            docs = _iter_hf_dataset(path, text_field, is_dict=kind == "hf_dataset_dict")
        for doc in docs:
            if not doc.text.strip():
                stats.skipped["empty"] += 1
                continue
            stats.kept += 1
            yield doc


def _decode_file(path: Path, stats: FilterStats) -> str | None:
    return _decode_bytes(path.read_bytes(), stats)


def _decode_bytes(data: bytes, stats: FilterStats) -> str | None:
    """Binary (a NUL byte) or non-UTF-8 text is skipped and counted, never decoded with replacements."""
    if b"\x00" in data:
        stats.skipped["binary"] += 1
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats.skipped["not_utf8"] += 1
        return None


def is_generated_go(text: str) -> bool:
    """True when the Go generated-code marker appears before the package clause."""
    clause = PACKAGE_CLAUSE.search(text)
    header = text[: clause.start()] if clause else text
    return GENERATED_MARKER.search(header) is not None


def _path_skip_reason(rel: Path, exclude_tests: bool) -> str | None:
    for name in SKIPPED_DIRS:
        if name in rel.parts[:-1]:
            return name
    if exclude_tests and rel.name.endswith("_test.go"):
        return "go_test_file"
    return None


def iter_tree(root: Path, include: Sequence[str], exclude_tests: bool,
               stats: FilterStats) -> Iterator[Document]:
    for pattern in include:
        if not pattern or Path(pattern).is_absolute():
            raise LMForgeError(f"--include {pattern!r}: globs must be non-empty and relative to the input "
                               "directory, e.g. '**/*.go'")
    # Sorted, de-duplicated matches so every run (and both passes of `prepare`) sees the same order.
    try:
        files = sorted({p for pattern in include for p in root.glob(pattern) if p.is_file()})
    except (ValueError, NotImplementedError) as e:
        raise LMForgeError(f"--include {list(include)}: not a valid glob ({e})") from e
    if not files:
        raise LMForgeError(
            f"no files under {root} match the include globs {list(include)}. Globs are relative to "
            "the directory (pathlib style: '**/*.go' recurses, '*.go' does not); pass --include.")
    for file in files:
        rel = file.relative_to(root)
        reason = _path_skip_reason(rel, exclude_tests)
        if reason:
            stats.skipped[reason] += 1
            continue
        text = _decode_file(file, stats)
        if text is None:
            continue
        if file.suffix == ".go" and is_generated_go(text):
            stats.skipped["generated"] += 1
            continue
        yield Document(text, rel.as_posix())


def _is_story_separator(line: bytes) -> bool:
    return line.strip() == STORY_SEPARATOR


def _iter_text_file(path: Path, stats: FilterStats) -> Iterator[Document]:
    """One document per file, or per story in a file of stories separated by ``<|endoftext|>`` lines.

    Read line by line, so a released TinyStories file (2 GB) is never held whole: each story is checked
    (binary, UTF-8) and yielded on its own. A file with no separator line is checked and yielded whole."""
    lines: list[bytes] = []
    stories = 0
    with open(path, "rb") as f:
        for line in f:
            if not _is_story_separator(line):
                lines.append(line)
                continue
            story = _decode_story(b"".join(lines), stats)
            lines = []
            if story:  # nothing between two separators (or before the first) is no story
                yield Document(story, f"{path.name}#{stories}")
                stories += 1
    rest = b"".join(lines)
    if stories == 0:
        text = _decode_bytes(rest, stats)
        if text is not None:
            yield Document(text, path.name)
        return
    story = _decode_story(rest, stats)
    if story:  # a last story without a separator after it
        yield Document(story, f"{path.name}#{stories}")


def _decode_story(data: bytes, stats: FilterStats) -> str:
    if not data.strip():
        return ""
    text = _decode_bytes(data, stats)
    return text.strip() if text is not None else ""


def _record_text(value: object, where: str, text_field: str) -> str:
    if value is None:
        return ""  # counted as an empty document
    if not isinstance(value, str):
        raise LMForgeError(
            f"{where}: field {text_field!r} is a {type(value).__name__}, not a string. Point "
            "--text-field at the column that holds the document text.")
    return value


def _iter_jsonl(path: Path, text_field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, thousands of nested [ or {
                raise LMForgeError(
                    f"{where}: not valid JSON ({e}). Each line of a .jsonl file must be one JSON object "
                    f'such as {{"{text_field}": "..."}}; fix or delete that line.') from e
            if not isinstance(record, dict):
                raise LMForgeError(
                    f"{where}: expected a JSON object, got {type(record).__name__}. Each line must look "
                    f'like {{"{text_field}": "..."}}; fix or delete that line.')
            if text_field not in record:
                raise LMForgeError(
                    f"{where}: no field {text_field!r} (fields: {sorted(record)}). Pass --text-field "
                    "with the name of the field that holds the text, or fix that line.")
            yield Document(_record_text(record[text_field], where, text_field), f"{path.name}:{lineno}")


def _iter_parquet(path: Path, text_field: str) -> Iterator[Document]:
    # Imported here: pyarrow is slow to import and most corpora are source trees.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise LMForgeError(f"{path}: not a readable parquet file ({e}). Check or re-export the file.") from e
    names = pf.schema_arrow.names
    if text_field not in names:
        raise LMForgeError(
            f"{path}: no column {text_field!r} (columns: {names}). Pass --text-field with the text column.")
    row = 0
    for batch in pf.iter_batches(batch_size=_RECORD_BATCH, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield Document(_record_text(value, f"{path} row {row}", text_field), f"{path.name}#{row}")
            row += 1


def _iter_hf_dataset(path: Path, text_field: str, is_dict: bool) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as e:
        raise LMForgeError(
            f"{path} is a Hugging Face dataset, and reading it needs the `datasets` package: "
            "pip install 'lmforge[hf]' (or pip install datasets).") from e
    loaded = datasets.load_from_disk(str(path))
    if is_dict:
        splits = splits_read(list(loaded))
        parts = [(f"{split}/", loaded[split]) for split in splits]
    else:
        parts = [("", loaded)]
    for prefix, ds in parts:
        if text_field not in ds.column_names:
            raise LMForgeError(
                f"{path}: no column {text_field!r} (columns: {ds.column_names}). Pass --text-field "
                "with the text column.")
        row = 0
        for batch in ds.select_columns([text_field]).iter(batch_size=_RECORD_BATCH):
            for value in batch[text_field]:
                where = f"{path} {prefix}row {row}"
                yield Document(_record_text(value, where, text_field), f"{path.name}#{prefix}{row}")
                row += 1
