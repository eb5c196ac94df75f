"""Byte-level BPE tokenizer: training, loading, and the files that tie it to Hugging Face.

Byte-level means every UTF-8 byte is in the base vocabulary, so ``decode(encode(s)) == s`` for any
text (Go code, tabs, emoji) and ``<unk>`` never appears. There is no normalizer and no prefix space for
the same reason. The special tokens always take ids 0..5 so that data shards, models and the user's
guide agree on ``bos=1, eos=2, pad=3`` without looking anything up.

``save`` writes ``tokenizer.json`` (the Rust tokenizer), ``tokenizer_config.json`` and
``special_tokens_map.json``, which is what ``transformers.AutoTokenizer.from_pretrained(dir)`` needs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lmforge.errors import LMForgeError

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<PR_TITLE>", "<PR_BODY>"]
UNK, BOS, EOS, PAD = SPECIAL_TOKENS[:4]
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # all bytes + the specials, before any merge


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Tokenizer:
    """A trained lmforge tokenizer: a thin, validated wrapper over a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: _RustTokenizer, origin: str = "<in memory>"):
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            found = backend.token_to_id(token)
            if found != expected_id:
                has = "is missing" if found is None else f"has id {found}"
                raise LMForgeError(
                    f"{origin}: special token {token!r} must have id {expected_id} but {has}; this "
                    "tokenizer was not made by `lmforge tokenizer train`. Train one with that command "
                    "(or lmforge.tokenizer.train_tokenizer).")
        self._backend = backend
        self.origin = origin  # the file it was loaded from, for messages and overlap checks
        self._canonical = backend.to_str()  # compact serialization: file formatting never changes the hash

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, or the directory that holds one."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise LMForgeError(
                f"tokenizer not found: {file} does not exist. Pass a tokenizer.json or the directory "
                "written by `lmforge tokenizer train --out DIR`.")
        try:
            backend = _RustTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception for any parse problem
            raise LMForgeError(
                f"{file} is not a valid tokenizer file ({e}). Re-create it with `lmforge tokenizer train`."
            ) from e
        return cls(backend, origin=str(file))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def unk_id(self) -> int:
        return SPECIAL_TOKENS.index(UNK)

    @property
    def bos_id(self) -> int:
        return SPECIAL_TOKENS.index(BOS)

    @property
    def eos_id(self) -> int:
        return SPECIAL_TOKENS.index(EOS)

    @property
    def pad_id(self) -> int:
        return SPECIAL_TOKENS.index(PAD)

    @property
    def sha256(self) -> str:
        """Hex digest of the canonical tokenizer.json text; data shards record it to catch mix-ups."""
        return hashlib.sha256(self._canonical.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos is added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel on the Rust side."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Special tokens are kept by default so that decode inverts encode exactly."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors
            ids = ids.tolist()
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def bytes_per_token(self, texts: Iterable[str]) -> float:
        """UTF-8 bytes per token over ``texts`` (higher = better compression)."""
        texts = list(texts)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        n_tokens = sum(len(ids) for ids in self.encode_batch(texts))
        if n_tokens == 0:
            raise LMForgeError("bytes_per_token needs at least one non-empty text to measure.")
        return n_bytes / n_tokens

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
                       "additional_special_tokens": SPECIAL_TOKENS[4:]}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "add_bos_token": False,
            "add_eos_token": False,
            # transformers must not touch spaces when decoding, or round trips break.
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
        }
        _atomic_write_text(directory / TOKENIZER_FILE, self._backend.to_str(pretty=True))
        _atomic_write_text(directory / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        _atomic_write_text(directory / SPECIAL_MAP_FILE, json.dumps(special_map, indent=2) + "\n")
        return directory


def _untrained_bpe() -> _RustTokenizer:
    backend = _RustTokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to write over a file, or over an existing tokenizer unless asked (data shards made with it
    would no longer match)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise LMForgeError(f"--out {out_dir} is a file; give a directory for the tokenizer files")
    if (out_dir / TOKENIZER_FILE).exists() and not overwrite:
        raise LMForgeError(f"{out_dir / TOKENIZER_FILE} already exists; pass --overwrite to replace it (data "
                           "prepared with the old tokenizer will then refuse to train) or choose another --out")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2,
                    show_progress: bool = True, overwrite: bool = False) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it in ``out_dir``.

    Returns the path of the written ``tokenizer.json``. ``vocab_size`` counts the 256 byte tokens and
    the special tokens; training stops early when no pair reaches ``min_frequency``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise LMForgeError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs 256 byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens. Use --vocab-size {MIN_VOCAB_SIZE} or more "
            "(8192 is typical).")
    if min_frequency < 1:
        raise LMForgeError(f"min_frequency={min_frequency} must be at least 1.")
    check_out_dir(Path(out_dir), overwrite)
    non_empty = (t for t in texts if t)
    first = next(non_empty, None)
    if first is None:
        raise LMForgeError(
            "the tokenizer training corpus is empty: no non-empty text was found. Check the input "
            "paths and --include globs (or --text-field for record files).")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    backend = _untrained_bpe()
    backend.train_from_iterator(itertools.chain([first], non_empty), trainer=trainer)
    return Tokenizer(backend).save(out_dir) / TOKENIZER_FILE
