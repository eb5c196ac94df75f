"""Preference pairs rendered and packed for training: what the reward and dpo kinds feed their models.

Each pair becomes two sequences, ``[eos] + render(prompt + [chosen])`` and the same with
``rejected``, rendered with the tokenizer's own chat template (as ``lmforge serve`` prompts and as the
sft kind trains: ``lmforge.posttrain.render``). A sequence is all input — its closing eos included,
so a reward model reads its score after seeing the whole reply — and its targets are the next tokens
of the reply (the last assistant message and its closing eos); the last position has no target.

``PackedPairs`` packs whole pairs, both sequences side by side in one row (best-fit decreasing, as
``lmforge.posttrain.packing`` does for conversations), each sequence its own document: no attention
between sequences, positions restarting at each. A batch carries, besides the usual ``input_ids``,
``labels``, ``position_ids`` and ``document_ids``:

- ``sequence_ids`` ``[B, T]``: the sequence each token belongs to, ``0 .. 2P-1`` over the batch
  (``2k`` is pair k's chosen reply, ``2k+1`` its rejected one), ``-1`` on padding;
- ``last_index`` ``[2P]``: each sequence's last token (its closing eos) as a flat index into the
  ``B * T`` tokens, found by length, not by looking for eos (eos also opens and closes every turn);
- ``margin`` ``[P]`` (0 where the data gives none), ``pair_index`` ``[P]`` (into the store),
  ``num_examples`` (P), and ``ref_logps`` ``[P, 2]`` when the store holds reference log-probs.

The loader's state is ``(epoch, row)``: exact resume, as the sft loader.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.packing import PAD_DOCUMENT, pack_rows
from lmforge.posttrain.preferences import PreferencePair
from lmforge.posttrain.render import supervised_spans, tokenize_spans

_ROUND = 16  # a micro-batch is cut to its longest row, rounded up to this (fewer distinct shapes)
TOO_LONG = "chosen + rejected longer than data.seq_len"
SIDE_TOO_LONG = "a side longer than the model's context (model.n_positions)"


@dataclass
class PairStats:
    """What became of the pairs handed to ``render_pairs``."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    tokens: int = 0  # tokens of the kept sequences (both sides)
    longest: int = 0  # tokens of the longest pair seen (both sides)

    def summary(self, seq_len: int) -> str:
        total = self.kept + sum(self.skipped.values())
        parts = [f"{self.kept:,} of {total:,} pairs kept", f"{self.tokens:,} tokens"]
        for reason, n in sorted(self.skipped.items()):
            parts.append(f"{n:,} skipped: {reason}")
        if self.skipped.get(TOO_LONG):
            parts.append(f"longest {self.longest:,} tokens: raise data.seq_len (now {seq_len}) to keep them")
        return "; ".join(parts)


class PairStore:
    """Kept pairs as flat arrays: sequence ``2k`` is pair k's chosen side, ``2k+1`` its rejected side."""

    def __init__(self, pairs: list[PreferencePair], sequences: list[tuple[list[int], list[int]]]):
        self.pairs = pairs
        self.kinds = [p.kind for p in pairs]
        self.margins = np.asarray([p.margin or 0.0 for p in pairs], dtype=np.float32)
        lengths = np.asarray([len(ids) for ids, _ in sequences], dtype=np.int64)
        self.lengths = lengths  # per sequence
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.inputs = (np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in sequences])
                       if sequences else np.zeros(0, np.int64))
        # targets[t] = the next token where it belongs to the reply; the last position has none
        targets = [np.append(np.where(np.asarray(sup[1:]) > 0, ids[1:], IGNORE_INDEX), IGNORE_INDEX)
                   for ids, sup in sequences]
        self.targets = np.concatenate(targets).astype(np.int64) if sequences else np.zeros(0, np.int64)
        self.pair_lengths = lengths[0::2] + lengths[1::2]
        self.ref_logps: np.ndarray | None = None  # [N, 2]: reference log-probs of chosen, rejected

    def __len__(self) -> int:
        return len(self.pairs)


def render_pairs(tokenizer: Any, pairs: list[PreferencePair], seq_len: int, stats: PairStats | None = None,
                 max_sequence: int | None = None) -> PairStore:
    """Tokenize pairs (see the module doc). The two sides of a pair share a row, so a pair whose
    sides together exceed ``seq_len`` tokens is counted in ``stats`` and left out, as is one with a
    side longer than ``max_sequence`` (the model's context: a row may be longer, as each sequence
    restarts its positions, but no sequence can)."""
    stats = stats if stats is not None else PairStats()
    kept: list[PreferencePair] = []
    sequences: list[tuple[list[int], list[int]]] = []
    for pair in pairs:
        sides = []
        for reply in (pair.chosen, pair.rejected):
            conv = SimpleNamespace(messages=[*pair.prompt, reply], tools=pair.tools)
            try:
                text, spans = supervised_spans(tokenizer, conv.messages, conv.tools, "last")
            except LMForgeError as e:
                raise LMForgeError(f"{pair.source or 'a preference pair'}: {e}") from e
            ids, sup = tokenize_spans(tokenizer, text, spans)
            sides.append((ids, sup))
        both = sum(len(ids) for ids, _ in sides)  # the two sides share a row
        stats.longest = max(stats.longest, both)
        if both > seq_len:
            stats.skipped[TOO_LONG] += 1
            continue
        if max_sequence is not None and max(len(ids) for ids, _ in sides) > max_sequence:
            stats.skipped[SIDE_TOO_LONG] += 1
            continue
        stats.kept += 1
        stats.tokens += sum(len(ids) for ids, _ in sides)
        kept.append(pair)
        sequences.extend(sides)
    return PairStore(kept, sequences)


class PackedPairs:
    """Train and eval loader over a ``PairStore`` (``TrainData.train`` / ``.val``)."""

    def __init__(self, store: PairStore, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if len(store) and int(store.pair_lengths.max()) > seq_len:  # render_pairs leaves such pairs out
            raise LMForgeError(f"a preference pair has {int(store.pair_lengths.max())} tokens on its two sides, more "
                               f"than a row of data.seq_len={seq_len}; raise data.seq_len")
        self.store, self.seq_len, self.micro_batch_size = store, seq_len, micro_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.row = 0, 0
        self._rows_epoch: int | None = None
        self._rows: list[list[int]] = []
        self.rows_per_epoch = len(self._epoch_rows(0, all_ranks=True))
        if shuffle and self.rows_per_epoch < world_size * micro_batch_size:
            raise LMForgeError(f"the pairs pack into {self.rows_per_epoch} rows of {seq_len} tokens, fewer than "
                               f"{world_size} process(es) x micro_batch_size={micro_batch_size}; use more pairs or a "
                               "smaller training.micro_batch_size")

    def _epoch_rows(self, epoch: int, all_ranks: bool = False) -> list[list[int]]:
        n = len(self.store)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        rows = pack_rows(self.store.pair_lengths, self.seq_len, order)
        if self.shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
        if all_ranks:
            return rows
        usable = len(rows) - len(rows) % self.world_size if self.shuffle else len(rows)
        return rows[self.rank:usable:self.world_size]

    def _rows_of(self, epoch: int) -> list[list[int]]:
        if self._rows_epoch != epoch:
            self._rows, self._rows_epoch = self._epoch_rows(epoch), epoch
        return self._rows

    def _batch(self, rows: list[list[int]]) -> dict[str, Any]:
        s = self.store
        longest = max(int(s.pair_lengths[row].sum()) for row in rows)
        width = min(self.seq_len, -(-longest // _ROUND) * _ROUND)
        shape = (len(rows), width)
        inputs = np.zeros(shape, dtype=np.int64)
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        documents = np.full(shape, PAD_DOCUMENT, dtype=np.int64)
        sequences = np.full(shape, -1, dtype=np.int64)
        last, pair_index = [], []
        seq = 0
        for r, row in enumerate(rows):
            at = 0
            for doc_pair, p in enumerate(row):
                pair_index.append(p)
                for side in (0, 1):
                    i = 2 * p + side
                    start, n = int(s.offsets[i]), int(s.lengths[i])
                    inputs[r, at:at + n] = s.inputs[start:start + n]
                    targets[r, at:at + n] = s.targets[start:start + n]
                    positions[r, at:at + n] = np.arange(n)
                    documents[r, at:at + n] = 2 * doc_pair + side
                    sequences[r, at:at + n] = seq
                    last.append(r * width + at + n - 1)
                    at += n
                    seq += 1
        index = np.asarray(pair_index, dtype=np.int64)
        batch: dict[str, Any] = {
            "input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(targets),
            "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents),
            "sequence_ids": torch.from_numpy(sequences), "last_index": torch.tensor(last, dtype=torch.int64),
            "margin": torch.from_numpy(s.margins[index]), "pair_index": torch.from_numpy(index),
            "num_examples": len(index)}
        if s.ref_logps is not None:
            batch["ref_logps"] = torch.from_numpy(np.ascontiguousarray(s.ref_logps[index], dtype=np.float32))
        return batch

    def next_batch(self) -> dict[str, Any]:
        picked: list[list[int]] = []
        while len(picked) < self.micro_batch_size:
            rows = self._rows_of(self.epoch)
            if not rows:
                raise LMForgeError("the preference pairs pack into fewer rows than processes")
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
            raise LMForgeError(f"the checkpoint's pairs packed into {state['rows_per_epoch']} rows per epoch, this data "
                               f"into {self.rows_per_epoch}: the pairs, tokenizer or data.seq_len changed since it was "
                               "saved; resume with the same data, or start a new run (name=NEW) with "
                               "training.init_from=CHECKPOINT")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
