"""Sudoku puzzles for the HRM/TRM reasoning models: solve, generate, rate, import, augment and write.

A grid is a numpy ``uint8`` array of shape ``(81,)``, row by row, with values 0..9 (0 = blank).

``build_sudoku_dataset`` writes the on-disk layout of HRM's ``dataset/build_sudoku_dataset.py``, so
HRM's own tools read lmforge's data and ``lmforge.recipes.puzzles.data.PuzzleSplit`` reads HRM's::

    OUT/identifiers.json          ["<blank>"]
    OUT/lmforge_sudoku.json       provenance: sources, seed, clue range, num_aug, counts
    OUT/{train,test}/dataset.json {"pad_id": 0, "ignore_label_id": 0, "vocab_size": 11, "seq_len": 81, ...}
    OUT/{train,test}/all__inputs.npy            (N, 81) uint8  question digit + 1, blank = 1
    OUT/{train,test}/all__labels.npy            (N, 81) uint8  answer digit + 1 (2..10)
    OUT/{train,test}/all__puzzle_identifiers.npy (P,) int32    all 0
    OUT/{train,test}/all__puzzle_indices.npy    (P+1,) int32   puzzle p = examples [idx[p], idx[p+1])
    OUT/{train,test}/all__group_indices.npy     (G+1,) int32   group g = puzzles [gidx[g], gidx[g+1])
    OUT/{train,test}/all__ratings.npy           (N,) int32     lmforge only: each example's rating

In the train split each puzzle is a group of itself plus ``num_aug`` augmented copies (exact Sudoku
symmetries); the test split is not augmented and every puzzle is its own group.

The rating of a generated puzzle is the number of guesses the solver below makes to find its solution
(0 = naked singles alone solve it); an imported CSV keeps the CSV's own ``rating`` column.
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing as mp
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge.recipes.puzzles.data import rating_histogram
from lmforge.errors import LMForgeError
from lmforge.files import atomic_directory, remove_stale

# ---- the solver: bitmask candidates, naked singles, most-constrained cell ------------------------------
# Digit d (1..9) is bit 1 << (d - 1) of a 9-bit mask; rows/cols/boxes hold the masks of digits used.

_FULL = 0x1FF
_ROW = tuple(i // 9 for i in range(81))
_COL = tuple(i % 9 for i in range(81))
_BOX = tuple((i // 27) * 3 + (i % 9) // 3 for i in range(81))
_POP = tuple(bin(m).count("1") for m in range(512))
_BITS = tuple(tuple(1 << k for k in range(9) if m >> k & 1) for m in range(512))  # ascending digits
_DIGIT = [0] * 512
for _k in range(9):
    _DIGIT[1 << _k] = _k + 1
_DIGIT = tuple(_DIGIT)


def _setup(cells: list[int]):
    """Masks and empty cells of a grid given as a list, or None if a digit repeats in a row/col/box."""
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    empties = []
    for i, d in enumerate(cells):
        if d:
            bit = 1 << (d - 1)
            r, k, b = _ROW[i], _COL[i], _BOX[i]
            if (rows[r] | cols[k] | boxes[b]) & bit:
                return None
            rows[r] |= bit
            cols[k] |= bit
            boxes[b] |= bit
        else:
            empties.append(i)
    return rows, cols, boxes, empties


def _search(grid: list[int], rows: list[int], cols: list[int], boxes: list[int], empties: list[int],
            out: list[list[int]], limit: int, effort: list[int]) -> None:
    """Depth-first search; appends solved grids to ``out`` until it holds ``limit``. Mutates its arguments.

    ``effort[0]`` counts guesses: every digit tried at a cell that had two or more candidates.
    """
    while True:  # naked singles until none is left; remember the cell with the fewest candidates
        progress = False
        best, best_mask, best_n = -1, 0, 10
        remaining = []
        for c in empties:
            r, k, b = _ROW[c], _COL[c], _BOX[c]
            m = _FULL & ~(rows[r] | cols[k] | boxes[b])
            if not m:
                return  # a cell with no candidate: dead end
            if not m & (m - 1):
                grid[c] = _DIGIT[m]
                rows[r] |= m
                cols[k] |= m
                boxes[b] |= m
                progress = True
            else:
                remaining.append(c)
                if not progress and _POP[m] < best_n:  # only needed for a pass that placed nothing
                    best, best_mask, best_n = c, m, _POP[m]
        empties = remaining
        if not empties:
            out.append(grid)
            return
        if not progress:
            break
    r, k, b = _ROW[best], _COL[best], _BOX[best]
    rest = [c for c in empties if c != best]
    choices = _BITS[best_mask]
    last = len(choices) - 1
    for j, bit in enumerate(choices):
        effort[0] += 1
        if j == last:  # the last choice may reuse this frame's state
            g, rr, cc, bb = grid, rows, cols, boxes
        else:
            g, rr, cc, bb = grid[:], rows[:], cols[:], boxes[:]
        g[best] = _DIGIT[bit]
        rr[r] |= bit
        cc[k] |= bit
        bb[b] |= bit
        _search(g, rr, cc, bb, rest, out, limit, effort)
        if len(out) >= limit:
            return


def _cells(grid) -> list[int]:
    a = np.asarray(grid)
    if a.size != 81 or a.ndim not in (1, 2) or not np.issubdtype(a.dtype, np.integer):
        raise LMForgeError(f"a Sudoku grid must be 81 integers (shape (81,) or (9, 9)); got shape {a.shape} "
                           f"dtype {a.dtype}. Build grids with parse_grid().")
    cells = a.reshape(81).tolist()
    if min(cells) < 0 or max(cells) > 9:
        raise LMForgeError("a Sudoku grid holds values 0..9 (0 = blank); got values outside that range.")
    return cells


def _solve_cells(cells: list[int], limit: int) -> tuple[list[list[int]], int]:
    state = _setup(cells)
    if state is None:
        return [], 0
    rows, cols, boxes, empties = state
    out: list[list[int]] = []
    effort = [0]
    _search(cells[:], rows, cols, boxes, empties, out, limit, effort)
    return out, effort[0]


def solve(grid, limit: int = 2) -> tuple[list[np.ndarray], int]:
    """Up to ``limit`` solutions of ``grid`` (in search order) and the search effort in guesses.

    The search is deterministic: naked singles are filled in, then the empty cell with the fewest
    candidates is tried with its digits in ascending order. A grid that breaks the rules (a digit
    twice in a row, column or box) has no solution. ``limit=2`` checks uniqueness.
    """
    if limit < 1:
        raise LMForgeError(f"solve(limit={limit}): limit must be at least 1.")
    sols, effort = _solve_cells(_cells(grid), limit)
    return [np.array(s, dtype=np.uint8) for s in sols], effort


def rate(grid) -> int:
    """Difficulty: the guesses the solver makes to find the first solution (0 = naked singles suffice)."""
    return _solve_cells(_cells(grid), 1)[1]


# ---- validity, vectorised over many grids ------------------------------------------------------------

_ONE_TO_NINE = np.arange(1, 10, dtype=np.uint8)


def _units(grids: np.ndarray) -> np.ndarray:
    """(N, 27, 9): the 9 rows, 9 columns and 9 boxes of each of N grids."""
    g = grids.reshape(-1, 9, 9)
    boxes = g.reshape(-1, 3, 3, 3, 3).transpose(0, 1, 3, 2, 4).reshape(-1, 9, 9)
    return np.concatenate([g, g.transpose(0, 2, 1), boxes], axis=1)


def _valid_solutions(questions: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """(N,) bool: each answer is a complete valid grid that agrees with every clue of its question."""
    units_ok = (np.sort(_units(answers), axis=-1) == _ONE_TO_NINE).all(axis=(1, 2))
    clues_ok = ((questions == 0) | (questions == answers)).all(axis=1)
    return units_ok & clues_ok


def is_valid_solution(puzzle, solution) -> bool:
    """True when ``solution`` is complete, every row/col/box holds 1..9 once, and it keeps every clue."""
    q = np.asarray(puzzle).reshape(1, 81)
    a = np.asarray(solution).reshape(1, 81)
    return bool(_valid_solutions(q, a)[0])


# ---- text ---------------------------------------------------------------------------------------------

_TABLE_BLANKS = np.full(256, 255, dtype=np.uint8)
_TABLE_BLANKS[np.frombuffer(b"123456789", dtype=np.uint8)] = _ONE_TO_NINE
_TABLE_BLANKS[ord(".")] = _TABLE_BLANKS[ord("0")] = 0
_TABLE_FULL = _TABLE_BLANKS.copy()
_TABLE_FULL[ord(".")] = _TABLE_FULL[ord("0")] = 255


def parse_grid(text: str, where: str = "grid", allow_blanks: bool = True) -> np.ndarray:
    """81 characters, row by row: digits '1'-'9', blanks '.' or '0' -> uint8 grid of shape (81,)."""
    if not isinstance(text, str):
        raise LMForgeError(f"{where}: expected a string of 81 characters, got {type(text).__name__}.")
    s = text.strip()
    if len(s) != 81:
        raise LMForgeError(f"{where} has {len(s)} cells, expected 81 (one character per cell, row by row: "
                           "digits 1-9, '.' or '0' for a blank).")
    raw = np.frombuffer(s.encode("ascii", errors="replace"), dtype=np.uint8)
    grid = (_TABLE_BLANKS if allow_blanks else _TABLE_FULL)[raw]
    bad = np.flatnonzero(grid == 255)
    if bad.size:
        i = int(bad[0])
        if not allow_blanks and s[i] in ".0":
            raise LMForgeError(f"{where} has a blank {s[i]!r} at cell {i + 1}; a solution must be complete "
                               "(digits 1-9 only).")
        allowed = "digits 1-9" + (", '.' or '0' for a blank" if allow_blanks else "")
        raise LMForgeError(f"{where} has a bad character {s[i]!r} at cell {i + 1}; allowed: {allowed}.")
    return grid


def format_grid(grid) -> str:
    """The 81-character form, '.' for a blank."""
    return "".join("." if d == 0 else str(d) for d in _cells(grid))


def pretty_grid(grid) -> str:
    """Nine lines for the terminal, boxes separated by '|' and '-'."""
    cells = _cells(grid)
    lines = []
    for r in range(9):
        if r and r % 3 == 0:
            lines.append("------+-------+------")
        row = ["." if d == 0 else str(d) for d in cells[r * 9:(r + 1) * 9]]
        lines.append(" | ".join(" ".join(row[i:i + 3]) for i in (0, 3, 6)))
    return "\n".join(lines)


# ---- puzzles ------------------------------------------------------------------------------------------

@dataclass
class Puzzle:
    question: np.ndarray  # (81,) uint8, 0 = blank
    answer: np.ndarray    # (81,) uint8, complete
    rating: int
    source: str


def clue_count(puzzle: Puzzle) -> int:
    return int(np.count_nonzero(puzzle.question))


# ---- augmentation -------------------------------------------------------------------------------------

_POSITIONS = np.arange(81).reshape(9, 9)


def _symmetries(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random Sudoku symmetries at once (no Python loop: the papers' 1,000 copies of 1,000 puzzles are a
    million), as digit maps (n, 10) and cell index maps (n, 81)."""
    digits = np.zeros((n, 10), dtype=np.uint8)
    digits[:, 1:] = rng.permuted(np.tile(np.arange(1, 10, dtype=np.uint8), (n, 1)), axis=1)
    transpose = rng.random(n) < 0.5

    def lines() -> np.ndarray:  # (n, 9): the bands (or stacks) shuffled, and the lines inside each
        outer = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)
        inner = rng.permuted(np.tile(np.arange(3), (n, 3, 1)), axis=2)
        return (outer[:, :, None] * 3 + inner).reshape(n, 9)

    rows, cols = lines(), lines()
    base = np.where(transpose[:, None, None], _POSITIONS.T, _POSITIONS)
    return digits, base[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]].reshape(n, 81)


def augment(question: np.ndarray, answer: np.ndarray, rng: np.random.Generator,
            copies: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Apply one random exact symmetry to both grids: relabel digits 1-9 (0 stays blank), transpose
    with probability 0.5, shuffle the bands and the rows inside each band, the stacks and the columns
    inside each stack. A valid (question, answer) pair stays valid, with the same number of clues.
    ``copies=N``: N independent symmetries, as (N, 81) arrays."""
    digits, index = _symmetries(rng, 1 if copies is None else copies)
    which = np.arange(len(index))[:, None]
    q, a = digits[which, np.asarray(question)[index]], digits[which, np.asarray(answer)[index]]
    return (q[0], a[0]) if copies is None else (q, a)


# ---- generation ---------------------------------------------------------------------------------------

MAX_GRID_ATTEMPTS = 200  # fresh solution grids tried per puzzle before giving up on its clue target


def _puzzle_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, stream, index]))


def _random_solution(rng: np.random.Generator) -> list[int]:
    """A random complete grid: the three diagonal boxes filled at random (they share no row, column or
    box), the rest completed by the solver, then a random symmetry on top."""
    cells = [0] * 81
    for box in range(3):
        for j, d in enumerate(rng.permutation(9) + 1):
            cells[(box * 3 + j // 3) * 9 + box * 3 + j % 3] = int(d)
    sols, _ = _solve_cells(cells, 1)  # always solvable: the diagonal boxes are independent
    grid = np.array(sols[0], dtype=np.uint8)
    return augment(grid, grid, rng)[0].tolist()


def _has_other_solution(cells: list[int], cell: int, digit: int) -> bool:
    """Whether ``cells`` (with ``cell`` blank) has a solution with something other than ``digit`` there."""
    rows, cols, boxes, empties = _setup(cells)
    r, k, b = _ROW[cell], _COL[cell], _BOX[cell]
    free = _FULL & ~(rows[r] | cols[k] | boxes[b]) & ~(1 << (digit - 1))
    rest = [c for c in empties if c != cell]
    for bit in _BITS[free]:
        g, rr, cc, bb = cells[:], rows[:], cols[:], boxes[:]
        g[cell] = _DIGIT[bit]
        rr[r] |= bit
        cc[k] |= bit
        bb[b] |= bit
        out: list[list[int]] = []
        _search(g, rr, cc, bb, rest, out, 1, [0])
        if out:
            return True
    return False


def _generate_one(seed: int, stream: int, index: int, min_clues: int, max_clues: int) -> Puzzle:
    rng = _puzzle_rng(seed, stream, index)
    target = int(rng.integers(min_clues, max_clues + 1))
    for _ in range(MAX_GRID_ATTEMPTS):
        solution = _random_solution(rng)
        cells = solution[:]
        clues = 81
        for c in rng.permutation(81).tolist():
            if clues == target:
                break
            d = cells[c]
            cells[c] = 0
            if _has_other_solution(cells, c, d):
                cells[c] = d
            else:
                clues -= 1
        if clues != target:
            continue  # this grid cannot lose enough clues in this order: try another
        sols, _ = _solve_cells(cells, 2)
        if len(sols) != 1 or sols[0] != solution:  # cannot happen; a guard on the removal logic
            raise RuntimeError(f"generated puzzle {index} does not have the unique solution it was built from")
        question = np.array(cells, dtype=np.uint8)
        return Puzzle(question=question, answer=np.array(solution, dtype=np.uint8),
                      rating=_solve_cells(cells, 1)[1], source="generated")
    raise LMForgeError(
        f"could not reach {target} clues with a unique solution in {MAX_GRID_ATTEMPTS} random grids "
        f"(puzzle {index}). Puzzles with fewer than about 22 clues are rare; raise --min-clues.")


def _generate_chunk(task: tuple[int, int, list[int], int, int]) -> list[Puzzle]:
    seed, stream, indices, min_clues, max_clues = task
    return [_generate_one(seed, stream, i, min_clues, max_clues) for i in indices]


def _pool_context():
    """fork on Linux: workers start at once (spawn would re-import torch in each) and run plain Python."""
    return mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context()


def generate_puzzles(n: int, min_clues: int = 30, max_clues: int = 36, seed: int = 0,
                     show_progress: bool = True, workers: int = 0, stream: int = 0,
                     start_index: int = 0) -> list[Puzzle]:
    """``n`` random puzzles with a unique solution and a clue count drawn uniformly from
    [min_clues, max_clues], each rated with ``rate``.

    Puzzle i comes from its own RNG seeded by (seed, stream, start_index + i), so the output depends on
    neither ``workers`` (0 = os.cpu_count()) nor how the work is split. Use different ``stream`` values
    for sets that must not share puzzles (the CLI uses 0 for train and 1 for test).
    """
    if n < 0:
        raise LMForgeError(f"cannot generate {n} puzzles: the count must be 0 or more.")
    if min_clues < 17:
        raise LMForgeError(f"--min-clues {min_clues}: a Sudoku with a unique solution has at least 17 clues.")
    if max_clues > 80:
        raise LMForgeError(f"--max-clues {max_clues}: at most 80 clues (81 would be a solved grid).")
    if min_clues > max_clues:
        raise LMForgeError(f"--min-clues {min_clues} is larger than --max-clues {max_clues}.")
    if workers < 0:
        raise LMForgeError(f"--workers {workers}: use 0 (all CPU cores) or a positive number.")
    workers = workers or os.cpu_count() or 1
    chunk = max(1, min(16, math.ceil(n / (workers * 4)))) if n else 1
    tasks = [(seed, stream, list(range(start_index + s, start_index + min(n, s + chunk))), min_clues, max_clues)
             for s in range(0, n, chunk)]
    out: list[Puzzle] = []
    with tqdm(total=n, desc="generating", unit=" puzzles", disable=not show_progress) as bar:
        if workers > 1 and len(tasks) > 1:
            with _pool_context().Pool(min(workers, len(tasks))) as pool:
                for part in pool.imap(_generate_chunk, tasks):
                    out.extend(part)
                    bar.update(len(part))
        else:
            for task in tasks:
                part = _generate_chunk(task)
                out.extend(part)
                bar.update(len(part))
    return out


# ---- CSV import ---------------------------------------------------------------------------------------

CSV_HEADER = ["source", "q", "a", "rating"]


def read_sudoku_csv(path: str | Path) -> list[Puzzle]:
    """Read a Sudoku-Extreme style CSV (header ``source,q,a,rating``; q and a 81 characters, '.' = blank
    in q; rating an integer). Every row is checked: the answer must be a valid solution of the question."""
    path = Path(path)
    fix = "Fix or remove that row (format: source,q,a,rating with 81-character q and a)."
    if not path.is_file():
        raise LMForgeError(f"{path}: no such file. Pass a Sudoku CSV with the header source,q,a,rating "
                           "(the format of Sudoku-Extreme's train.csv and test.csv).")
    questions, answers, ratings, sources, lines = [], [], [], [], []
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise LMForgeError(f"{path} is empty; expected the header source,q,a,rating and one row per "
                                   "puzzle.")
            if [h.strip().lower() for h in header] != CSV_HEADER:
                raise LMForgeError(f"{path}, line 1: header is {','.join(header)!r}, expected "
                                   "'source,q,a,rating'. Add or fix the header line.")
            for row in reader:
                line = reader.line_num
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue  # blank line
                if len(row) != 4:
                    raise LMForgeError(f"{path}, line {line}: {len(row)} columns, expected 4 "
                                       f"(source,q,a,rating). {fix}")
                source, q, a, r = row
                where = f"{path}, line {line}:"
                questions.append(parse_grid(q, where=f"{where} question", allow_blanks=True))
                answers.append(parse_grid(a, where=f"{where} answer", allow_blanks=False))
                try:
                    value = float(r)
                except ValueError:
                    value = math.nan
                if not math.isfinite(value) or value != int(value):
                    raise LMForgeError(f"{where} rating {r!r} is not an integer. {fix}")
                ratings.append(int(value))
                sources.append(source.strip())
                lines.append(line)
        except csv.Error as e:
            raise LMForgeError(f"{path}, line {reader.line_num}: not valid CSV ({e}). {fix}") from e
    if not questions:
        raise LMForgeError(f"{path} has a header but no puzzles; add one row per puzzle.")
    q_all, a_all = np.stack(questions), np.stack(answers)
    ok = _valid_solutions(q_all, a_all)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        units_bad = not (np.sort(_units(a_all[i:i + 1]), axis=-1) == _ONE_TO_NINE).all()
        why = ("the answer repeats a digit in a row, column or box" if units_bad
               else "the answer disagrees with a clue of the question")
        raise LMForgeError(f"{path}, line {lines[i]}: {why}, so it is not a solution. {fix}")
    return [Puzzle(question=q_all[i], answer=a_all[i], rating=ratings[i], source=sources[i])
            for i in range(len(questions))]


def subsample(puzzles: Sequence[Puzzle], size: int, seed: int) -> list[Puzzle]:
    """A seeded random subset of ``size`` puzzles, in their original order (same seed, same subset)."""
    if size < 1:
        raise LMForgeError(f"--subsample-size {size}: must be at least 1.")
    if size > len(puzzles):
        raise LMForgeError(f"--subsample-size {size} is larger than the {len(puzzles)} puzzles available; "
                           "ask for fewer or provide more puzzles.")
    keep = np.sort(np.random.default_rng(seed).choice(len(puzzles), size=size, replace=False))
    return [puzzles[i] for i in keep.tolist()]


def hardest(puzzles: Sequence[Puzzle], k: int, flag: str = "--hardest") -> list[Puzzle]:
    """The ``k`` puzzles with the highest rating (ties: earlier first), in their original order. ``flag``: the
    option that asked for them, for the error messages."""
    if k < 1:
        raise LMForgeError(f"{flag} {k}: must be at least 1.")
    if k > len(puzzles):
        raise LMForgeError(f"{flag} {k} is larger than the {len(puzzles)} puzzles available; ask for fewer.")
    ratings = np.array([p.rating for p in puzzles], dtype=np.int64)
    keep = np.sort(np.argsort(-ratings, kind="stable")[:k])
    return [puzzles[i] for i in keep.tolist()]


# ---- writing HRM's layout -----------------------------------------------------------------------------

OUT_MARKER = "lmforge_sudoku.json"
SPLIT_META = "dataset.json"


def _is_puzzle_dataset(out: Path) -> bool:
    return (out / OUT_MARKER).is_file() or any(p.is_file() for p in out.glob(f"*/{SPLIT_META}"))


def check_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Refuse a file, a non-empty directory without ``overwrite``, or (with it) anything but a dataset."""
    out = Path(out_dir).resolve()
    remove_stale(out)  # a run killed mid-replacement may have moved the previous dataset aside
    if out.exists() and not out.is_dir():
        raise LMForgeError(f"--out {out} is a file, not a directory. Choose a directory path.")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise LMForgeError(f"--out {out} already exists and is not empty; refusing to overwrite it. Pass "
                               "--overwrite (overwrite=True) to replace it, or choose another --out directory.")
        if not _is_puzzle_dataset(out):
            raise LMForgeError(f"--out {out} is not empty and is not a puzzle dataset (no {OUT_MARKER} or "
                               f"*/{SPLIT_META}); --overwrite only replaces an earlier dataset. Choose another "
                               "--out directory.")
    return out


def _save(path: Path, array: np.ndarray) -> None:
    """``np.save``'s .npy, written with a file write: a full disk raises ENOSPC with its errno, where
    ``np.save`` (``ndarray.tofile``) raises an OSError without one ("N requested and M written")."""
    array = np.require(array, requirements="C")  # keeps a 0-d array 0-d (ascontiguousarray would not)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(array.data)
        f.flush()
        os.fsync(f.fileno())


def _split_meta(total_groups: int) -> dict:
    return {"pad_id": 0, "ignore_label_id": 0, "blank_identifier_id": 0, "vocab_size": 11, "seq_len": 81,
            "num_puzzle_identifiers": 1, "total_groups": total_groups, "mean_puzzle_examples": 1,
            "sets": ["all"]}


def _write_split(directory: Path, questions: np.ndarray, answers: np.ndarray, ratings: np.ndarray,
                 group_size: int) -> None:
    directory.mkdir()
    n = len(questions)
    _save(directory / "all__inputs.npy", (questions + 1).astype(np.uint8))
    _save(directory / "all__labels.npy", (answers + 1).astype(np.uint8))
    _save(directory / "all__puzzle_identifiers.npy", np.zeros(n, dtype=np.int32))
    _save(directory / "all__puzzle_indices.npy", np.arange(n + 1, dtype=np.int32))
    _save(directory / "all__group_indices.npy", np.arange(0, n + 1, group_size, dtype=np.int32))
    _save(directory / "all__ratings.npy", ratings.astype(np.int32))
    meta = _split_meta(n // group_size)
    (directory / SPLIT_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _split_summary(puzzles: Sequence[Puzzle], examples: int, groups: int) -> dict:
    clues = [clue_count(p) for p in puzzles]
    ratings = np.array([p.rating for p in puzzles], dtype=np.int64)
    return {"puzzles": len(puzzles), "examples": examples, "groups": groups,
            "clues": [min(clues), max(clues)],
            "ratings": [int(ratings.min()), int(ratings.max())],
            "rating_buckets": rating_histogram(ratings),
            "sources": dict(Counter(p.source for p in puzzles).most_common())}


def build_sudoku_dataset(out_dir: str | Path, train: Sequence[Puzzle], test: Sequence[Puzzle], num_aug: int,
                         seed: int, overwrite: bool = False, show_progress: bool = True,
                         provenance: dict | None = None) -> dict:
    """Write ``train`` (each puzzle plus ``num_aug`` augmented copies, one group) and ``test`` (as is, one
    group per puzzle) in HRM's layout; returns the summary stored in ``lmforge_sudoku.json``.

    ``out_dir`` appears only once complete: it is built in a hidden sibling and renamed into place.
    """
    if not train or not test:
        raise LMForgeError(f"need at least one train and one test puzzle (got {len(train)} train, {len(test)} "
                           "test).")
    if num_aug < 0:
        raise LMForgeError(f"--num-aug {num_aug}: must be 0 or more.")
    out = check_out_dir(out_dir, overwrite)
    rng = np.random.default_rng(seed)
    group = num_aug + 1
    n_train = len(train) * group
    tq = np.empty((n_train, 81), dtype=np.uint8)
    ta = np.empty((n_train, 81), dtype=np.uint8)
    tr = np.empty(n_train, dtype=np.int32)
    for i, p in enumerate(tqdm(train, desc="augmenting", unit=" puzzles", disable=not show_progress or not num_aug)):
        row = i * group
        tq[row], ta[row], tr[row:row + group] = p.question, p.answer, p.rating
        if num_aug:
            tq[row + 1:row + group], ta[row + 1:row + group] = augment(p.question, p.answer, rng, copies=num_aug)
    eq = np.stack([p.question for p in test])
    ea = np.stack([p.answer for p in test])
    er = np.array([p.rating for p in test], dtype=np.int32)
    summary = {"splits": {"train": _split_summary(train, n_train, len(train)),
                          "test": _split_summary(test, len(test), len(test))},
               "num_aug": num_aug, "seed": seed}
    record = {"format": "lmforge-sudoku", "version": 1, **(provenance or {}), **summary,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}

    with atomic_directory(out) as tmp:
        _write_split(tmp / "train", tq, ta, tr, group)
        _write_split(tmp / "test", eq, ea, er, 1)
        (tmp / "identifiers.json").write_text(json.dumps(["<blank>"]) + "\n", encoding="utf-8")
        (tmp / OUT_MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    summary["out"] = str(out)
    return summary
