"""HRGC's training sequences and the loaders that batch them, from ``lmforge data go-functions`` records.

Sequences (segment markers are plain text, so any tokenizer works; each segment is encoded alone)::

    planner     spec <plan> plan </s>                                   loss on plan and </s>
    generator   spec <plan> plan <code> code </s>                       loss on code and </s>
    refinement  spec <plan> plan <attempt> attempt <judge>              head label read at <judge>
                    [<verdict> validator message <code> target </s>]    loss on target (refine / continue)

The plain baseline (``model.hierarchical: false``) has only ``spec <code> code </s>``. The
``spec <plan> plan`` prefix takes the same positions in all three, which is where the planner's
states condition the generator (``lmforge.recipes.hrgc.model``).

Batches are bucketed by length (a shuffled pool of 50 batches is sorted, cut into batches, and the
batches shuffled), so padding stays small without packing functions together: every row is one
function, as the head and the conditioning need.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmforge.recipes.hrgc.functions import GoFunction
from lmforge.recipes.hrgc.refinement import refinement_examples
from lmforge.recipes.hrgc.model import HEAD_LABELS
from lmforge.models.losses import IGNORE_INDEX

MARKERS = {"plan": "\n<plan>\n", "code": "\n<code>\n", "attempt": "\n<attempt>\n", "judge": "\n<judge>",
           "verdict": "\n<verdict>\n"}
BUCKET_POOL = 50  # batches per length-sorted pool
OWN_FAILURE_POOL = 256  # the model's own failed attempts kept for refinement training


@dataclass
class Row:
    ids: list[int]
    labels: np.ndarray


class SequenceFormat:
    """Turns (spec, plan, code, attempt, message) token lists into model inputs and labels."""

    def __init__(self, tokenizer, hierarchical: bool = True):
        self.tokenizer = tokenizer
        self.hierarchical = hierarchical
        self.eos = tokenizer.eos_id
        self.pad = tokenizer.pad_id
        self.marker = {k: tokenizer.encode(v) for k, v in MARKERS.items()}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prefix(self, spec: list[int], plan: list[int]) -> list[int]:
        """What the planner's states condition: ``spec <plan> plan`` (just ``spec`` without a planner)."""
        return spec + self.marker["plan"] + plan if self.hierarchical else list(spec)

    @staticmethod
    def _pair(seq: list[int], loss_from: int) -> Row:
        """Inputs ``seq[:-1]``, next-token labels ``seq[1:]``, ignored before position ``loss_from``."""
        labels = np.asarray(seq[1:], dtype=np.int64)
        labels[:max(loss_from - 1, 0)] = IGNORE_INDEX
        return Row(seq[:-1], labels)

    def planner_row(self, spec: list[int], plan: list[int]) -> Row:
        head = spec + self.marker["plan"]
        return self._pair(head + plan + [self.eos], len(head))

    def code_prompt(self, prefix: list[int]) -> list[int]:
        return prefix + self.marker["code"]

    def code_row(self, prefix: list[int], code: list[int]) -> Row:
        head = self.code_prompt(prefix)
        return self._pair(head + code + [self.eos], len(head))

    def judge_prompt(self, prefix: list[int], attempt: list[int]) -> list[int]:
        return prefix + self.marker["attempt"] + attempt + self.marker["judge"]

    def refine_prompt(self, prefix: list[int], attempt: list[int], message: list[int]) -> list[int]:
        return self.judge_prompt(prefix, attempt) + self.marker["verdict"] + message + self.marker["code"]

    def refine_row(self, prefix: list[int], attempt: list[int], message: list[int] | None,
                   target: list[int] | None) -> tuple[Row, int]:
        """The head's row (and, with a target, the corrected attempt's LM loss); returns the row and
        the index of the ``<judge>`` position the head reads."""
        judge = self.judge_prompt(prefix, attempt)
        judge_pos = len(judge) - 1
        if target is None:
            row = Row(judge, np.full(len(judge), IGNORE_INDEX, dtype=np.int64))
            return row, judge_pos
        head = self.refine_prompt(prefix, attempt, message or [])
        return self._pair(head + target + [self.eos], len(head)), judge_pos


def collate(rows: list[Row], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows to the longest: ``[B, T]`` ids (pad) and labels (ignored)."""
    length = max(len(r.ids) for r in rows)
    ids = np.full((len(rows), length), pad, dtype=np.int64)
    labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = r.ids
        labels[i, :len(r.labels)] = r.labels
    return torch.from_numpy(ids), torch.from_numpy(labels)


class EncodedFunctions:
    """One split's functions, tokenized once (int32 arrays, encoded in chunks to bound memory), keeping
    only those whose sequences fit the contexts. ``spec(i)`` / ``plan(i)`` / ``code(i)`` give token lists."""

    CHUNK = 2048  # functions encoded per call

    def __init__(self, functions: list[GoFunction], fmt: SequenceFormat, planner_positions: int,
                 generator_positions: int):
        tok = fmt.tokenizer
        self.fmt = fmt
        self.generator_positions = generator_positions
        self.functions: list[GoFunction] = []
        self._tokens: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        lengths = []
        self.too_long = 0
        marker_plan, marker_code = len(fmt.marker["plan"]), len(fmt.marker["code"])
        for start in range(0, len(functions), self.CHUNK):
            chunk = functions[start:start + self.CHUNK]
            encoded = [tok.encode_batch([getattr(f, part) for f in chunk]) for part in ("spec", "plan", "code")]
            for fn, s, p, c in zip(chunk, *encoded):
                plan_len = len(s) + marker_plan + len(p)
                # The generator's inputs: the sequence minus its last token.
                code_len = (plan_len if fmt.hierarchical else len(s)) + marker_code + len(c)
                if code_len > generator_positions or (fmt.hierarchical and plan_len > planner_positions):
                    self.too_long += 1
                    continue
                self.functions.append(fn)
                self._tokens.append(tuple(np.asarray(x, dtype=np.int32) for x in (s, p, c)))
                lengths.append(code_len)
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.functions)

    def spec(self, i: int) -> list[int]:
        return self._tokens[i][0].tolist()

    def plan(self, i: int) -> list[int]:
        return self._tokens[i][1].tolist()

    def code(self, i: int) -> list[int]:
        return self._tokens[i][2].tolist()

    def prefix(self, i: int) -> list[int]:
        return self.fmt.prefix(self.spec(i), self.plan(i))


def bucketed_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, rank: int = 0,
                     world_size: int = 1, shuffle: bool = True) -> list[list[int]]:
    """This rank's batches of one epoch: a (shuffled) order cut into pools of ``BUCKET_POOL`` batches,
    each pool sorted by length and cut into batches; the batches then shuffled."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    pool = batch_size * BUCKET_POOL
    batches = []
    for start in range(0, len(order), pool):
        chunk = order[start:start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size].tolist() for i in range(0, len(chunk), batch_size))
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches[rank::world_size]


class _Batcher:
    """What the train and eval loaders share: building one batch dict from function indices."""

    def __init__(self, data: EncodedFunctions, parser, seed: int):
        self.data, self.fmt, self.parser, self.seed = data, data.fmt, parser, seed

    def state_for(self, i: int, salt: str) -> tuple[list[int], list[int] | None, list[int] | None, str] | None:
        """A labelled refinement state of function ``i``: ``(attempt, message, target, label)``; the
        label is drawn uniformly among the labels the function offers, then a state of that label."""
        fn = self.data.functions[i]
        rng = random.Random(f"{self.seed}-{salt}-{i}")
        states = refinement_examples(self.parser, fn, rng)
        if not states:
            return None
        label = rng.choice(sorted({s.label for s in states}))
        state = rng.choice([s for s in states if s.label == label])
        return self.encode_state(i, state.attempt, state.message, state.label)

    def encode_state(self, i: int, attempt: str, message: str, label: str):
        target = None if label == "done" else self.data.code(i)
        return self.fmt.encode(attempt), self.fmt.encode(message) if message else [], target, label

    def batch(self, indices: list[int], states: list[tuple | None] | None,
              lm_rows: int | None = None) -> dict[str, torch.Tensor]:
        """One row per function index; rows from ``lm_rows`` on (the model's own failures) carry only a
        refinement state: their plan and code rows are there to condition it, with no LM loss."""
        d, fmt = self.data, self.fmt
        out: dict[str, torch.Tensor] = {}
        prefixes = [d.prefix(i) for i in indices]
        if fmt.hierarchical:
            out["plan_ids"], out["plan_labels"] = collate([fmt.planner_row(d.spec(i), d.plan(i)) for i in indices],
                                                          fmt.pad)
            out["prefix_len"] = torch.tensor([len(p) for p in prefixes], dtype=torch.int64)
        out["code_ids"], out["code_labels"] = collate([fmt.code_row(p, d.code(i)) for p, i in zip(prefixes, indices)],
                                                      fmt.pad)
        if lm_rows is not None:
            for key in ("plan_labels", "code_labels"):
                if key in out:
                    out[key][lm_rows:] = IGNORE_INDEX
        if states is not None:
            rows, judge_pos, head_labels = [], [], []
            for prefix, state in zip(prefixes, states):
                row, pos, label = None, 0, IGNORE_INDEX
                if state is not None:
                    attempt, message, target, name = state
                    row, pos = fmt.refine_row(prefix, attempt, message, target)
                    if len(row.ids) > d.generator_positions:  # the corrected copy does not fit: head only
                        row, pos = fmt.refine_row(prefix, attempt, None, None)
                    if len(row.ids) <= d.generator_positions:
                        label = HEAD_LABELS.index(name)
                    else:
                        row, pos = None, 0
                rows.append(row or Row([fmt.pad], np.full(1, IGNORE_INDEX, dtype=np.int64)))
                judge_pos.append(pos)
                head_labels.append(label)
            out["refine_ids"], out["refine_labels"] = collate(rows, fmt.pad)
            out["judge_pos"] = torch.tensor(judge_pos, dtype=torch.int64)
            out["head_labels"] = torch.tensor(head_labels, dtype=torch.int64)
        return out


class HRGCTrainLoader(_Batcher):
    """Endless training batches; refinement rows join after ``refinement_warmup`` optimizer steps,
    plus extra rows from the model's own failures (``add_failure``) once the validation probe finds some."""

    def __init__(self, data: EncodedFunctions, parser, micro_batch_size: int, seed: int, rank: int,
                 world_size: int, refinement_warmup: int, own_failure_share: float):
        super().__init__(data, parser, seed)
        if len(data) < micro_batch_size * world_size:
            raise_small(len(data), micro_batch_size * world_size)
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.step = 0  # the optimizer step being drawn for: the loop says (set_step)
        self.refinement_warmup, self.own_failure_share = refinement_warmup, own_failure_share
        self.epoch, self.position, self.drawn = 0, 0, 0
        self.failures: list[dict[str, Any]] = []
        self._batches = self._plan()

    def _plan(self) -> list[list[int]]:
        return bucketed_batches(self.data.lengths, self.micro_batch_size, self.seed, self.epoch, self.rank,
                                self.world_size)

    def set_step(self, step: int) -> None:
        """The training loop's optimizer step, before its micro-batches are drawn (TrainData.on_step):
        refinement rows join from step ``refinement_warmup`` on."""
        self.step = step

    def add_failure(self, index: int, attempt: str, message: str, label: str) -> None:
        """Keep one of the model's failed attempts at training function ``index`` (target: its real body),
        with the length of its refinement row."""
        fmt, d = self.fmt, self.data
        length = len(fmt.refine_prompt(d.prefix(index), fmt.encode(attempt), fmt.encode(message))) + len(d.code(index))
        self.failures.append({"index": int(index), "attempt": attempt, "message": message, "label": label,
                              "length": length})
        del self.failures[:-OWN_FAILURE_POOL]

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.position >= len(self._batches):
            self.epoch, self.position = self.epoch + 1, 0
            self._batches = self._plan()
        indices = list(self._batches[self.position])
        self.position += 1
        lm_rows = len(indices)
        states = None
        if self.data.fmt.hierarchical and self.step >= self.refinement_warmup:
            states = [self.state_for(i, f"e{self.epoch}") for i in indices]
            # The model's own failures join as extra rows (each row's chance: own_failure_share), so
            # they are at most that share of the refinement rows and never displace LM rows.
            # Only failures no longer than this batch's rows may join: a long one would pad every row.
            rng = random.Random(f"{self.seed}-own-{self.rank}-{self.drawn}")
            budget = 2 * int(self.data.lengths[indices].max()) + 16
            fitting = [f for f in self.failures if f.get("length", 0) <= budget]
            for _ in range(lm_rows):
                if fitting and rng.random() < self.own_failure_share:
                    f = rng.choice(fitting)
                    indices.append(f["index"])
                    states.append(self.encode_state(f["index"], f["attempt"], f["message"], f["label"]))
        self.drawn += 1
        return self.batch(indices, states, lm_rows)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn, "failures": self.failures}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.drawn = int(state["epoch"]), int(state["position"]), int(state["drawn"])
        self.failures = list(state.get("failures", []))
        self._batches = self._plan()


class HRGCEvalLoader(_Batcher):
    """The held-out functions in a fixed order, every batch with its refinement states."""

    def __init__(self, data: EncodedFunctions, parser, micro_batch_size: int, seed: int, rank: int, world_size: int):
        super().__init__(data, parser, seed)
        self.batches = bucketed_batches(data.lengths, micro_batch_size, seed, 0, rank, world_size)

    def iter_eval_batches(self, max_batches: int | None = None):
        for indices in self.batches[:max_batches]:
            states = [self.state_for(i, "eval") for i in indices] if self.data.fmt.hierarchical else None
            yield self.batch(indices, states)


def raise_small(have: int, need: int) -> None:
    from lmforge.errors import LMForgeError

    raise LMForgeError(f"only {have} training functions fit the model's contexts, fewer than one batch ({need}); "
                       "use a larger Go source tree, a smaller training.micro_batch_size, or longer "
                       "model.*_config.n_positions")


__all__ = ["MARKERS", "SequenceFormat", "EncodedFunctions", "HRGCTrainLoader", "HRGCEvalLoader",
           "bucketed_batches", "collate"]
