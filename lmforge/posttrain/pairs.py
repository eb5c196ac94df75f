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
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError
from lmforge.models.losses import IGNORE_INDEX
from lmforge.posttrain.packing import PAD_DOCUMENT, ROUND_TO, RowLoader, pack_rows
from lmforge.posttrain.preferences import PreferencePair
from lmforge.posttrain.render import supervised_spans, tokenize_spans

TOO_LONG = "chosen + rejected longer than data.seq_len"
SIDE_TOO_LONG = "a side longer than the model's context (model.n_positions)"


@dataclass
class PairStats:
    """What became of the pairs handed to ``render_pairs``."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    tokens: int = 0  # tokens of the kept sequences (both sides)
    longest: int = 0  # tokens of the longest pair seen (both sides)
    untokenized: int = 0  # of the too long ones, those left out untokenized: more characters than seq_len tokens hold

    def summary(self, seq_len: int) -> str:
        total = self.kept + sum(self.skipped.values())
        parts = [f"{self.kept:,} of {total:,} pairs kept", f"{self.tokens:,} tokens"]
        for reason, n in sorted(self.skipped.items()):
            parts.append(f"{n:,} skipped: {reason}")
        if self.skipped.get(TOO_LONG, 0) > self.untokenized:
            parts.append(f"longest {self.longest:,} tokens: raise data.seq_len (now {seq_len}) to keep them")
        if self.untokenized:
            parts.append(f"{self.untokenized:,} of them not tokenized: more characters than {seq_len} tokens can hold")
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
    most = tokenizer.max_chars(seq_len)
    for pair in pairs:
        texts = []
        for reply in (pair.chosen, pair.rejected):
            conv = SimpleNamespace(messages=[*pair.prompt, reply], tools=pair.tools)
            try:
                texts.append(supervised_spans(tokenizer, conv.messages, conv.tools, "last"))
            except LMForgeError as e:
                raise LMForgeError(f"{pair.source or 'a preference pair'}: {e}") from e
        if sum(len(text) for text, _ in texts) > most:  # cannot fit: left out untokenized (megabytes take minutes)
            stats.skipped[TOO_LONG] += 1
            stats.untokenized += 1
            continue
        sides = [tokenize_spans(tokenizer, text, spans) for text, spans in texts]
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


class PackedPairs(RowLoader):
    """Train and eval loader over a ``PairStore`` (``TrainData.train`` / ``.val``)."""

    items = "preference pairs"

    def __init__(self, store: PairStore, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if len(store) and int(store.pair_lengths.max()) > seq_len:  # render_pairs leaves such pairs out
            raise LMForgeError(f"a preference pair has {int(store.pair_lengths.max())} tokens on its two sides, more "
                               f"than a row of data.seq_len={seq_len}; raise data.seq_len")
        self.store, self.seq_len = store, seq_len
        self._start(len(store), micro_batch_size, rank, world_size, seed, shuffle)
        if shuffle and self.rows_per_epoch < world_size * micro_batch_size:
            raise LMForgeError(f"the pairs pack into {self.rows_per_epoch} rows of {seq_len} tokens, fewer than "
                               f"{world_size} process(es) x micro_batch_size={micro_batch_size}; use more pairs or a "
                               "smaller training.micro_batch_size")

    def _layout(self, order: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
        rows = pack_rows(self.store.pair_lengths, self.seq_len, order)  # whole pairs: both sides in one row
        return [rows[i] for i in rng.permutation(len(rows))] if self.shuffle else rows

    def _batch(self, rows: list[list[int]]) -> dict[str, Any]:
        s = self.store
        longest = max(int(s.pair_lengths[row].sum()) for row in rows)
        width = min(self.seq_len, -(-longest // ROUND_TO) * ROUND_TO)
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
