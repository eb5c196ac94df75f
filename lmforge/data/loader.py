"""Read prepared token shards: a memory-mapped dataset and a resumable, rank-aware batch loader.

Layout of a data directory (written by ``lmforge data prepare``)::

    meta.json  tokenizer.json  tokenizer_config.json  special_tokens_map.json
    train_000000.bin  train_000001.bin ...  val_000000.bin ...

Each ``.bin`` is a flat little-endian array of token ids; documents are concatenated, each followed
by ``</s>``, with no padding. A split is read as one long token stream across its shards.

Training windows are ``seq_len + 1`` tokens at stride ``seq_len`` (window i covers tokens
``[i*seq_len, i*seq_len + seq_len + 1)``), so every token except the first is a target exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where batches are made: the data verbs and --help start without it (~2 s)
    import torch
from lmforge.errors import LMForgeError

META_FILE = "meta.json"
FORMAT = "lmforge-tokens"
VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REPREPARE = "Re-run `lmforge data prepare` to rebuild the data directory."


def read_meta(data_dir: str | Path) -> dict:
    """The validated meta.json of a data directory."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise LMForgeError(
            f"{path} not found: {data_dir} is not a prepared data directory. Create one with "
            "`lmforge data prepare SOURCES --tokenizer TOK --out DIR` and point data.path at DIR.")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise LMForgeError(f"{path} is corrupt ({e}). {_REPREPARE}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LMForgeError(f"{path}: not an {FORMAT!r} meta file. {_REPREPARE}")
    if meta.get("version") != VERSION:
        raise LMForgeError(
            f"{path}: format version {meta.get('version')} is not supported (expected {VERSION}). "
            f"{_REPREPARE}")
    if meta.get("dtype") not in DTYPES:
        raise LMForgeError(f"{path}: unknown dtype {meta.get('dtype')!r}. {_REPREPARE}")
    return meta


class TokenDataset:
    """One split of a data directory, memory-mapped; ``read`` and ``gather`` span shard boundaries."""

    def __init__(self, data_dir: str | Path, split: str):
        self.data_dir = Path(data_dir)
        self.split = split
        meta = read_meta(self.data_dir)
        if split not in meta["splits"]:
            raise LMForgeError(
                f"{self.data_dir / META_FILE}: no split {split!r} (splits: {sorted(meta['splits'])}).")
        info = meta["splits"][split]
        dtype = DTYPES[meta["dtype"]]
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.tokenizer_sha256: str = meta["tokenizer_sha256"]
        self.bytes: int = info["bytes"]
        self.documents: int = info["documents"]
        self._shards: list[np.ndarray] = []
        for shard in info["shards"]:
            path = self.data_dir / shard["file"]
            expected = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"has {size} bytes, expected {expected}"
                raise LMForgeError(
                    f"shard {path} {found}: the data directory is corrupt or truncated. {_REPREPARE}")
            if shard["tokens"]:  # np.memmap cannot map an empty file
                self._shards.append(np.memmap(path, dtype=dtype, mode="r"))
        # offsets[k] = global index of shard k's first token; offsets[-1] = total tokens
        self._offsets = np.cumsum([0] + [len(s) for s in self._shards], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def shard_path(self, position: int) -> Path:
        """The file the token at global ``position`` is in."""
        info = [s for s in read_meta(self.data_dir)["splits"][self.split]["shards"] if s["tokens"]]
        k = int(np.searchsorted(self._offsets, position, side="right") - 1)
        return self.data_dir / info[k]["file"]

    def check_ids(self, ids: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Refuse token ids outside meta.json's vocabulary (a damaged shard), which the model's embedding would
        fail on (the model's vocabulary is at least meta.json's: ``check_vocab``). ``ids`` is the CPU array a
        batch is made from, so the check costs one pass over it there and never waits on a device."""
        if not ids.size or self.vocab_size <= 0:
            return
        top = int(ids.max())
        if top < self.vocab_size and int(ids.min()) >= 0:
            return
        first = tuple(int(i) for i in np.argwhere((ids >= self.vocab_size) | (ids < 0))[0])
        bad = int(ids[first])
        where = ""
        if starts is not None and ids.ndim == 2:
            where = f" {self.shard_path(int(starts[first[0]]) + first[1])}"
        raise LMForgeError(
            f"split {self.split!r} of {self.data_dir}: shard{where} has token id {bad}, but {META_FILE} gives a "
            f"vocabulary of {self.vocab_size} ids: the shard is damaged. {_REPREPARE}")

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at arbitrary global positions (any shape), as int64; one vectorised read per shard."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_tokens):
            raise IndexError(f"token positions must lie in [0, {self.num_tokens})")
        flat = positions.ravel()
        shard_of = np.searchsorted(self._offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=np.int64)
        for k in np.unique(shard_of):
            mask = shard_of == k
            out[mask] = self._shards[k][flat[mask] - self._offsets[k]]
        return out.reshape(positions.shape)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream, as int64 (contiguous slices of each shard)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"read({start}, {stop}) is outside [0, {self.num_tokens}]")
        parts = [np.empty(0, dtype=np.int64)]
        for shard, begin, end in zip(self._shards, self._offsets[:-1], self._offsets[1:], strict=True):
            lo, hi = max(start, begin), min(stop, end)
            if lo < hi:
                parts.append(shard[lo - begin:hi - begin].astype(np.int64))
        return np.concatenate(parts)


class PackedLoader:
    """Shuffled fixed-length windows, split across ranks so that any world size sees the same data.

    Each epoch permutes the window indices with ``seed + epoch``. Every micro-step takes the next
    ``micro_batch_size * world_size`` windows of the permutation and rank r keeps slice
    ``[r*mb, (r+1)*mb)``, so 2 ranks with mb=B/2 see exactly the windows 1 rank with mb=B sees.
    Windows left over at the end of an epoch (fewer than one full step) are skipped.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 1337, shuffle: bool = True):
        if seq_len < 1 or micro_batch_size < 1:
            raise LMForgeError(
                f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be at least 1.")
        if not 0 <= rank < world_size:
            raise LMForgeError(f"rank {rank} is outside world_size {world_size}.")
        self.dataset = dataset
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_windows = (dataset.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise LMForgeError(
                f"split {dataset.split!r} of {dataset.data_dir} has {dataset.num_tokens} tokens, fewer "
                f"than data.seq_len + 1 = {seq_len + 1}. Lower data.seq_len or add data (for the val "
                "split, a larger --val-fraction also helps).")
        self._epoch = 0
        self._position = 0  # index into this epoch's permutation of the next step's first window
        self._order = self._epoch_order(0)

    @property
    def _step_windows(self) -> int:
        return self.micro_batch_size * self.world_size

    @property
    def epoch(self) -> int:
        return self._epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows, dtype=np.int64)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_windows)

    def _batch(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        starts = windows * self.seq_len
        ids = self.dataset.gather(starts[:, None] + np.arange(self.seq_len + 1))
        self.dataset.check_ids(ids, starts)
        import torch

        tokens = torch.from_numpy(ids)
        # contiguous copies, so callers can .view() them (e.g. flattening labels for cross-entropy)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``labels`` (shifted by one), both LongTensor[micro_batch_size, seq_len]."""
        if self.num_windows < self._step_windows:  # checked here, not in __init__: eval needs no full step
            raise LMForgeError(
                f"split {self.dataset.split!r} of {self.dataset.data_dir} has {self.num_windows} windows of "
                f"{self.seq_len} tokens, fewer than one training step needs (micro_batch_size "
                f"{self.micro_batch_size} x world_size {self.world_size}). Lower training.micro_batch_size "
                "or data.seq_len, or add data.")
        if self._position + self._step_windows > self.num_windows:
            self._epoch += 1
            self._position = 0
            self._order = self._epoch_order(self._epoch)
        block = self._order[self._position:self._position + self._step_windows]
        self._position += self._step_windows
        mb = self.micro_batch_size
        return self._batch(block[self.rank * mb:(self.rank + 1) * mb])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        if (state["seq_len"], state["num_windows"]) != (self.seq_len, self.num_windows):
            raise LMForgeError(
                f"cannot resume the data loader: it was saved with seq_len={state['seq_len']} over "
                f"{state['num_windows']} windows, but now has seq_len={self.seq_len} over "
                f"{self.num_windows}. Resume with the same data.path and data.seq_len, or start a new run (to "
                "fine-tune a checkpoint's weights on other data, use training.init_from=CKPT).")
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._epoch_order(self._epoch)

    def eval_windows(self, max_batches: int | None = None) -> int:
        """How many windows ``iter_eval_batches(max_batches)`` yields on all ranks together: the first ones,
        whose targets are tokens ``[1, windows * seq_len]`` of the split."""
        return self.num_windows if max_batches is None else min(self.num_windows, max_batches * self._step_windows)

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Windows in order, disjoint across ranks (same block layout as training); the last may be short."""
        mb = self.micro_batch_size
        for step, block_start in enumerate(range(0, self.num_windows, self._step_windows)):
            if max_batches is not None and step >= max_batches:
                return
            lo = block_start + self.rank * mb
            windows = np.arange(lo, min(lo + mb, self.num_windows), dtype=np.int64)
            if len(windows) == 0:
                return
            yield self._batch(windows)
