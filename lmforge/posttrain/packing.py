"""Conversations packed into training rows, with no attention between them.

Each example of ``n + 1`` tokens gives ``n`` (input, target) pairs. Best-fit decreasing packs the
examples of an epoch into rows of ``seq_len`` pairs (the longest first, each into the fullest row it
still fits), so a row wastes little or nothing; every position carries its position within its own
conversation and the conversation's number in the row (``position_ids``, ``document_ids``), which
``GPT`` turns into positions and a block-diagonal causal mask: a conversation sees only itself, as it
will when served. Padding (the rest of a row that nothing fits into) has document id -1 and no target,
and a micro-batch is cut to its longest row.

Without packing (``recipe.packing=false``) each row holds one conversation, padded to the longest of
its micro-batch: the layout of TRL's default collator, kept for comparison.

The loader is an endless stream of epochs, each packed and ordered from ``seed + epoch``; its state is
``(epoch, row)``, so a resumed run continues with exactly the rows it would have drawn. Under DDP rank
``r`` takes rows ``r, r + world, ...`` of each epoch (the last ``rows % world`` rows of an epoch are
dropped so every rank draws the same number).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.render import Example

PAD_DOCUMENT = -1
ROUND_TO = 16  # a micro-batch is cut to its longest row, rounded up to this (fewer distinct shapes)


class ExampleStore:
    """All examples in two flat arrays: inputs and targets (``-100`` where nothing is learned)."""

    def __init__(self, examples: list[Example]):
        lengths = np.asarray([len(e.ids) - 1 for e in examples], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.lengths = lengths
        self.inputs = np.concatenate([e.ids[:-1] for e in examples]) if examples else np.zeros(0, np.int32)
        targets = [np.where(e.supervised[1:] > 0, e.ids[1:], IGNORE_INDEX) for e in examples]
        self.targets = np.concatenate(targets).astype(np.int64) if examples else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def supervised(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def pack_rows(lengths: np.ndarray, seq_len: int, order: np.ndarray) -> list[list[int]]:
    """Best-fit decreasing: example indices per row. ``order`` breaks ties between equal lengths."""
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted: the fullest row that fits is found by bisect
    for i in by_length.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
            rows[row].append(i)
            space -= n
        else:
            rows.append([i])
            row, space = len(rows) - 1, seq_len - n
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


class RowLoader(ABC):
    """Endless epochs of packed rows, handed out ``micro_batch_size`` rows at a time: what the sft loader
    and the preference-pair loader (``lmforge.posttrain.pairs``) share. A subclass lays out one epoch
    (``_layout``: rows of item indices, from the epoch's order) and builds a batch of rows (``_batch``).
    Epoch ``e`` is laid out from ``seed + e``; under DDP rank ``r`` takes rows ``r, r + world, ...``
    (the last ``rows % world`` dropped so every rank draws as many); the state is ``(epoch, row)``."""

    items = "items"  # what the rows hold, for messages

    def _start(self, n_items: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
               shuffle: bool) -> None:
        self.n_items, self.micro_batch_size = n_items, micro_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.row = 0, 0
        self._rows_epoch: int | None = None
        self._rows: list[list[int]] = []
        self.rows_per_epoch = len(self._epoch_rows(0, all_ranks=True))  # all ranks together

    @abstractmethod
    def _layout(self, order: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
        """The epoch's rows: lists of item indices, taken from ``order`` (shuffled or not)."""

    @abstractmethod
    def _batch(self, rows: list[list[int]]) -> dict[str, Any]:
        """One micro-batch's tensors from its rows."""

    def _epoch_rows(self, epoch: int, all_ranks: bool = False) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.n_items) if self.shuffle else np.arange(self.n_items)
        rows = self._layout(order, rng)
        if all_ranks:
            return rows
        usable = len(rows) - len(rows) % self.world_size if self.shuffle else len(rows)
        return rows[self.rank:usable:self.world_size]

    def _rows_of(self, epoch: int) -> list[list[int]]:
        if self._rows_epoch != epoch:
            self._rows, self._rows_epoch = self._epoch_rows(epoch), epoch
        return self._rows

    def next_batch(self) -> dict[str, Any]:
        picked: list[list[int]] = []
        while len(picked) < self.micro_batch_size:
            rows = self._rows_of(self.epoch)
            if not rows:
                raise LMForgeError(f"the training {self.items} pack into fewer rows than processes")
            take = rows[self.row:self.row + self.micro_batch_size - len(picked)]
            picked += take
            self.row += len(take)
            if self.row >= len(rows):
                self.epoch, self.row = self.epoch + 1, 0
        return self._batch(picked)

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[dict[str, Any]]:
        rows = self._rows_of(0)
        for b, i in enumerate(range(0, len(rows), self.micro_batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self._batch(rows[i:i + self.micro_batch_size])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "row": self.row, "rows_per_epoch": self.rows_per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("rows_per_epoch", self.rows_per_epoch)) != self.rows_per_epoch:
            raise LMForgeError(f"the checkpoint's data packed into {state['rows_per_epoch']} rows per epoch, this "
                               f"data into {self.rows_per_epoch}: the {self.items}, tokenizer, data.seq_len or "
                               "recipe settings changed since it was saved; resume with the same data, or start "
                               "a new run (name=NEW) with training.init_from=CHECKPOINT")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])


class PackedConversations(RowLoader):
    """The sft kind's train and eval loader (``TrainData.train`` / ``.val``)."""

    items = "conversations"

    def __init__(self, store: ExampleStore, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, packing: bool = True):
        if len(store) and int(store.lengths.max()) > seq_len:
            raise LMForgeError(f"an example has {int(store.lengths.max())} inputs, more than the rows' {seq_len}")
        self.store, self.seq_len, self.packing = store, seq_len, packing
        self._start(len(store), micro_batch_size, rank, world_size, seed, shuffle)

    # ---- layout ------------------------------------------------------------------------------
    def _layout(self, order: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
        if not self.packing:
            return [[int(i)] for i in order]
        rows = pack_rows(self.store.lengths, self.seq_len, order)
        return [rows[i] for i in rng.permutation(len(rows))] if self.shuffle else rows

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of the row positions of one epoch that hold no token (packed rows are full length;
        unpacked micro-batches are padded to their longest row)."""
        rows = self._epoch_rows(epoch, all_ranks=True)
        real = int(self.store.lengths.sum())
        if self.packing:
            return 1.0 - real / max(1, len(rows) * self.seq_len) if rows else 0.0
        total = 0
        for i in range(0, len(rows), self.micro_batch_size):
            group = rows[i:i + self.micro_batch_size]
            total += len(group) * max(int(self.store.lengths[r[0]]) for r in group)
        return 1.0 - real / max(1, total)

    # ---- batches -----------------------------------------------------------------------------
    def _batch(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        lengths = self.store.lengths
        longest = max(int(sum(lengths[i] for i in row)) for row in rows)
        width = min(self.seq_len, -(-longest // ROUND_TO) * ROUND_TO)
        shape = (len(rows), width)
        inputs = np.zeros(shape, dtype=np.int64)
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        documents = np.full(shape, PAD_DOCUMENT, dtype=np.int64)
        examples = 0
        for r, row in enumerate(rows):
            at = 0
            for doc, i in enumerate(row):
                start, n = int(self.store.offsets[i]), int(lengths[i])
                inputs[r, at:at + n] = self.store.inputs[start:start + n]
                targets[r, at:at + n] = self.store.targets[start:start + n]
                positions[r, at:at + n] = np.arange(n)
                documents[r, at:at + n] = doc
                at += n
            examples += len(row)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(targets),
                "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents),
                "num_examples": examples}
