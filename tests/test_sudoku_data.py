"""Sudoku data: solver, generator, augmentation, CSV import, HRM layout, samplers and `lmforge data sudoku`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.recipes.puzzles.data import (DIFFICULTY_NAMES, GroupSampler, PuzzleEvalLoader, PuzzleSplit, difficulty_bucket,
                                  rating_histogram)
from lmforge.recipes.puzzles.sudoku import (Puzzle, augment, build_sudoku_dataset, format_grid, generate_puzzles,
                                 is_valid_solution, parse_grid, pretty_grid, rate, read_sudoku_csv, solve, subsample)
from lmforge.errors import LMForgeError

# A 26-clue puzzle made by generate_puzzles(60, 24, 26, seed=7) (the hardest of them) and its solution.
HARD_Q = ".4.1......16.3..5.5.2..4....51....7...3..5...67..2...343......7......48.....47.1."
HARD_A = "348156729716932854592784136251493678983675241674821593435218967127369485869547312"
HARD_RATING = 730  # guesses of the deterministic search: a regression check on the solver's order
# HARD_A with a "deadly rectangle" blanked (rows 1 and 3, columns 4 and 7 hold 1 7 / 7 1): two solutions.
TWO_SOLUTIONS = "348.56.29716932854592.84.36251493678983675241674821593435218967127369485869547312"


def grid(text: str) -> np.ndarray:
    return parse_grid(text)


@pytest.fixture(scope="module")
def puzzles() -> list[Puzzle]:
    return generate_puzzles(12, min_clues=30, max_clues=36, seed=3, show_progress=False, workers=1)


def same_puzzles(a: list[Puzzle], b: list[Puzzle]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.question, y.question) and np.array_equal(x.answer, y.answer) and x.rating == y.rating
        for x, y in zip(a, b))


# --- solver ----------------------------------------------------------------------------------------------

def test_solver_solves_known_puzzle_uniquely():
    sols, effort = solve(grid(HARD_Q), limit=2)
    assert len(sols) == 1 and format_grid(sols[0]) == HARD_A
    assert sols[0].dtype == np.uint8 and sols[0].shape == (81,)
    assert effort >= HARD_RATING > 0
    assert rate(grid(HARD_Q)) == HARD_RATING
    assert is_valid_solution(grid(HARD_Q), grid(HARD_A))
    assert rate(grid(HARD_A)) == 0 and solve(grid(HARD_A))[0][0].tolist() == grid(HARD_A).tolist()


def test_solver_counts_two_solutions_and_respects_limit():
    q = grid(TWO_SOLUTIONS)
    sols, _ = solve(q, limit=2)
    assert len(sols) == 2 and format_grid(sols[0]) != format_grid(sols[1])
    assert all(is_valid_solution(q, s) for s in sols)
    assert len(solve(q, limit=1)[0]) == 1
    assert len(solve(q, limit=5)[0]) == 2
    assert len(solve(np.zeros(81, np.uint8), limit=2)[0]) == 2  # the empty grid


@pytest.mark.parametrize("cells", [(0, 8), (0, 72), (0, 20)], ids=["row", "column", "box"])
def test_solver_rejects_rule_breaking_grid(cells):
    q = grid(HARD_Q)
    q[list(cells)] = 0
    q[list(cells)] = 9  # the same digit twice in one unit
    assert solve(q, limit=2) == ([], 0)
    assert not is_valid_solution(q, grid(HARD_A))


def test_parse_and_format_grid():
    q = grid(HARD_Q)
    assert q.dtype == np.uint8 and int(np.count_nonzero(q)) == 26
    assert format_grid(q) == HARD_Q
    assert np.array_equal(parse_grid(HARD_Q.replace(".", "0")), q)
    lines = pretty_grid(q).splitlines()
    assert len(lines) == 11 and lines[3].startswith("---") and "|" in lines[0]
    with pytest.raises(LMForgeError, match=r"puzzle has 80 cells, expected 81"):
        parse_grid(HARD_Q[:-1], where="puzzle")
    with pytest.raises(LMForgeError, match=r"bad character 'x' at cell 1"):
        parse_grid("x" + HARD_Q[1:])
    with pytest.raises(LMForgeError, match=r"must be complete"):
        parse_grid(HARD_Q, where="answer", allow_blanks=False)
    with pytest.raises(LMForgeError, match="bad character"):
        parse_grid("é" + HARD_Q[1:])


def test_is_valid_solution_checks_clues_and_units():
    q, a = grid(HARD_Q), grid(HARD_A)
    assert is_valid_solution(q, a)
    swapped = a.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # still a permutation per row, breaks columns
    assert not is_valid_solution(np.zeros(81, np.uint8), swapped)
    relabelled = np.array([0, 2, 1, 3, 4, 5, 6, 7, 8, 9], np.uint8)[a]  # valid grid, wrong clues
    assert is_valid_solution(np.zeros(81, np.uint8), relabelled) and not is_valid_solution(q, relabelled)


# --- generation ------------------------------------------------------------------------------------------

def test_generated_puzzles_unique_in_range_rated(puzzles):
    assert len(puzzles) == 12
    for p in puzzles:
        assert 30 <= np.count_nonzero(p.question) <= 36
        sols, _ = solve(p.question, limit=2)
        assert len(sols) == 1 and np.array_equal(sols[0], p.answer)
        assert p.rating == rate(p.question) and p.source == "generated"
        assert p.question.dtype == p.answer.dtype == np.uint8
    assert len({p.question.tobytes() for p in puzzles}) == 12


def test_generation_deterministic_and_independent_of_workers(puzzles):
    again = generate_puzzles(12, min_clues=30, max_clues=36, seed=3, show_progress=False, workers=1)
    pooled = generate_puzzles(12, min_clues=30, max_clues=36, seed=3, show_progress=False, workers=2)
    assert same_puzzles(puzzles, again) and same_puzzles(puzzles, pooled)
    other = generate_puzzles(3, min_clues=30, max_clues=36, seed=4, show_progress=False, workers=1)
    assert not any(np.array_equal(o.question, p.question) for o in other for p in puzzles)
    tail = generate_puzzles(4, min_clues=30, max_clues=36, seed=3, show_progress=False, workers=1, start_index=8)
    assert same_puzzles(tail, puzzles[8:])
    test_stream = generate_puzzles(3, min_clues=30, max_clues=36, seed=3, show_progress=False, stream=1)
    assert not same_puzzles(test_stream, puzzles[:3])


@pytest.mark.parametrize("kw, message", [
    ({"min_clues": 16}, "at least 17"), ({"max_clues": 81}, "at most 80"),
    ({"min_clues": 40, "max_clues": 35}, "larger than"), ({"workers": -1}, "workers")])
def test_generation_rejects_bad_arguments(kw, message):
    with pytest.raises(LMForgeError, match=message):
        generate_puzzles(1, show_progress=False, **kw)


# --- augmentation ----------------------------------------------------------------------------------------

def test_augmentation_is_an_exact_symmetry(puzzles):
    rng = np.random.default_rng(0)
    sources = [*puzzles[:4], Puzzle(grid(HARD_Q), grid(HARD_A), HARD_RATING, "test")]
    transposed = 0
    for i in range(200):
        p = sources[i % len(sources)]
        q, a = augment(p.question, p.answer, rng)
        assert q.dtype == a.dtype == np.uint8 and q.shape == a.shape == (81,)
        assert is_valid_solution(q, a)
        assert np.count_nonzero(q) == np.count_nonzero(p.question)
        assert sorted(np.bincount(q, minlength=10)[1:]) == sorted(np.bincount(p.question, minlength=10)[1:])
        if p.source != "test" or i < 20:  # the hard puzzle takes ~50 ms to solve: check a few of it
            sols, _ = solve(q, limit=2)
            assert len(sols) == 1 and np.array_equal(sols[0], a)
        rows = sorted(np.count_nonzero(q.reshape(9, 9), axis=1))  # clues per row, as a multiset
        orig_rows = sorted(np.count_nonzero(p.question.reshape(9, 9), axis=1))
        orig_cols = sorted(np.count_nonzero(p.question.reshape(9, 9), axis=0))
        assert rows in (orig_rows, orig_cols)
        transposed += rows != orig_rows
    assert transposed > 0  # transposition happens (the row clue counts become the column counts)
    a1 = augment(puzzles[0].question, puzzles[0].answer, np.random.default_rng(5))
    a2 = augment(puzzles[0].question, puzzles[0].answer, np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a1, a2))


def test_many_copies_at_once_are_exact_and_independent_symmetries(puzzles):
    """``copies=N`` (how the train split gets its augmentations, without a Python loop per copy): each row an
    exact symmetry of the puzzle, transposed about half of the time, the copies different from each other."""
    p = puzzles[1]
    qs, as_ = augment(p.question, p.answer, np.random.default_rng(3), copies=400)
    assert qs.shape == as_.shape == (400, 81) and qs.dtype == as_.dtype == np.uint8
    orig_rows = sorted(np.count_nonzero(p.question.reshape(9, 9), axis=1))
    transposed = 0
    for q, a in zip(qs, as_):
        assert is_valid_solution(q, a) and np.count_nonzero(q) == np.count_nonzero(p.question)
        assert sorted(np.bincount(q, minlength=10)[1:]) == sorted(np.bincount(p.question, minlength=10)[1:])
        assert np.array_equal(a[q > 0], q[q > 0])  # the clues stay where the answer has them
        transposed += sorted(np.count_nonzero(q.reshape(9, 9), axis=1)) != orig_rows
    assert len({q.tobytes() for q in qs}) == 400 and 120 < transposed < 280
    again = augment(p.question, p.answer, np.random.default_rng(3), copies=400)
    assert np.array_equal(again[0], qs) and np.array_equal(again[1], as_)


# --- HRM layout ------------------------------------------------------------------------------------------

def test_layout_round_trip(tmp_path, puzzles):
    train, test = puzzles[:5], puzzles[5:9]
    summary = build_sudoku_dataset(tmp_path / "ds", train, test, num_aug=3, seed=1, show_progress=False)
    assert summary["splits"]["train"]["examples"] == 20 and summary["splits"]["test"]["examples"] == 4
    assert json.loads((tmp_path / "ds" / "identifiers.json").read_text()) == ["<blank>"]
    record = json.loads((tmp_path / "ds" / "lmforge_sudoku.json").read_text())
    assert record["num_aug"] == 3 and record["splits"]["train"]["puzzles"] == 5
    assert not list(tmp_path.glob(".ds.*"))  # no temporary directory left behind

    tr = PuzzleSplit(tmp_path / "ds", "train")
    assert tr.meta == {"pad_id": 0, "ignore_label_id": 0, "blank_identifier_id": 0, "vocab_size": 11,
                       "seq_len": 81, "num_puzzle_identifiers": 1, "total_groups": 5, "mean_puzzle_examples": 1,
                       "sets": ["all"]}
    assert (tr.num_examples, tr.num_puzzles, tr.num_groups, tr.seq_len, tr.vocab_size) == (20, 20, 5, 81, 11)
    assert tr.inputs.dtype == tr.labels.dtype == np.uint8
    assert tr.puzzle_indices.dtype == tr.group_indices.dtype == tr.puzzle_identifiers.dtype == np.int32
    assert tr.puzzle_indices.tolist() == list(range(21))
    assert tr.group_indices.tolist() == [0, 4, 8, 12, 16, 20]
    assert tr.puzzle_identifiers.tolist() == [0] * 20
    for g, p in enumerate(train):
        assert np.array_equal(tr.inputs[4 * g], p.question + 1)
        assert np.array_equal(tr.labels[4 * g], p.answer + 1)
        assert tr.ratings[4 * g:4 * g + 4].tolist() == [p.rating] * 4
        for j in range(1, 4):  # augmented copies: valid, same clue count
            q, a = tr.inputs[4 * g + j].astype(np.int64) - 1, tr.labels[4 * g + j].astype(np.int64) - 1
            assert is_valid_solution(q, a) and np.count_nonzero(q) == np.count_nonzero(p.question)
    assert int(tr.inputs.min()) >= 1 and int(tr.inputs.max()) <= 10 and int(tr.labels.min()) >= 2

    te = PuzzleSplit(tmp_path / "ds", "test")
    assert (te.num_examples, te.num_puzzles, te.num_groups) == (4, 4, 4)
    assert te.group_indices.tolist() == [0, 1, 2, 3, 4] and te.meta["total_groups"] == 4
    assert np.array_equal(np.asarray(te.inputs), np.stack([p.question for p in test]) + 1)
    assert np.array_equal(np.asarray(te.labels), np.stack([p.answer for p in test]) + 1)
    assert te.ratings.tolist() == [p.rating for p in test]


def write_hrm_split(directory: Path, inputs: np.ndarray, labels: np.ndarray, puzzle_indices, group_indices,
                    dtype=np.int32, **meta) -> None:
    """A split as HRM's own builder might write it: other dtypes, no all__ratings.npy."""
    directory.mkdir(parents=True)
    num_puzzles = len(puzzle_indices) - 1
    np.save(directory / "all__inputs.npy", inputs.astype(dtype))
    np.save(directory / "all__labels.npy", labels.astype(dtype))
    np.save(directory / "all__puzzle_identifiers.npy", np.zeros(num_puzzles, dtype=np.int64))
    np.save(directory / "all__puzzle_indices.npy", np.asarray(puzzle_indices, dtype=np.int64))
    np.save(directory / "all__group_indices.npy", np.asarray(group_indices, dtype=np.int64))
    fields = {"pad_id": 0, "ignore_label_id": 0, "blank_identifier_id": 0, "vocab_size": 11, "seq_len": 81,
              "num_puzzle_identifiers": 1, "total_groups": len(group_indices) - 1, "mean_puzzle_examples": 1,
              "sets": ["all"], **meta}
    (directory / "dataset.json").write_text(json.dumps(fields))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_hrm_written_split_loads(tmp_path, dtype):
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 11, size=(6, 81))
    labels = rng.integers(0, 11, size=(6, 81))  # some 0 = ignore_label_id
    write_hrm_split(tmp_path / "train", inputs, labels, [0, 2, 3, 6], [0, 2, 3], dtype=dtype)
    split = PuzzleSplit(tmp_path, "train")
    assert split.ratings is None and split.inputs.dtype == dtype
    assert (split.num_examples, split.num_puzzles, split.num_groups) == (6, 3, 2)
    batch = PuzzleEvalLoader(split, batch_size=4).iter_eval_batches()
    first = next(batch)
    assert first["inputs"].dtype == torch.int64 and first["ratings"].tolist() == [-1] * 4
    expected = np.where(labels[:4] == 0, -100, labels[:4])
    assert np.array_equal(first["labels"].numpy(), expected)
    assert next(batch)["inputs"].shape == (2, 81)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "all__labels.npy").unlink(), "all__labels.npy not found"),
    (lambda d: np.save(d / "all__inputs.npy", np.ones((6, 80), np.uint8)), "shape"),
    (lambda d: np.save(d / "all__inputs.npy", np.full((6, 81), 11, np.uint8)), "outside the vocabulary"),
    (lambda d: np.save(d / "all__puzzle_indices.npy", np.array([0, 2, 5])), "ends at 5"),
    (lambda d: np.save(d / "all__group_indices.npy", np.array([0, 3, 2])), "strictly increasing"),
    (lambda d: np.save(d / "all__puzzle_identifiers.npy", np.zeros(2, np.int32)), "one per puzzle"),
    (lambda d: np.save(d / "all__inputs.npy", np.ones((6, 81), np.float32)), "not an integer"),
    (lambda d: (d / "dataset.json").write_text("{"), "corrupt"),
])
def test_split_validation_names_file_and_fix(tmp_path, damage, message):
    write_hrm_split(tmp_path / "train", np.ones((6, 81)), np.full((6, 81), 2), [0, 2, 3, 6], [0, 2, 3])
    damage(tmp_path / "train")
    with pytest.raises(LMForgeError, match=message) as err:
        PuzzleSplit(tmp_path, "train")
    assert "lmforge data sudoku" in str(err.value)
    with pytest.raises(LMForgeError, match="dataset.json not found"):
        PuzzleSplit(tmp_path, "test")


def test_build_refuses_existing_directories(tmp_path, puzzles):
    out = tmp_path / "ds"
    build_sudoku_dataset(out, puzzles[:2], puzzles[2:3], num_aug=0, seed=0, show_progress=False)
    with pytest.raises(LMForgeError, match="--overwrite"):
        build_sudoku_dataset(out, puzzles[:3], puzzles[3:4], num_aug=0, seed=0, show_progress=False)
    build_sudoku_dataset(out, puzzles[:3], puzzles[3:4], num_aug=0, seed=0, overwrite=True, show_progress=False)
    assert PuzzleSplit(out, "train").num_examples == 3
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep me")
    with pytest.raises(LMForgeError, match="not a puzzle dataset"):
        build_sudoku_dataset(unrelated, puzzles[:2], puzzles[2:3], num_aug=0, seed=0, overwrite=True,
                             show_progress=False)
    assert (unrelated / "todo.txt").read_text() == "keep me"


# --- samplers --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grouped(tmp_path_factory, puzzles) -> PuzzleSplit:
    out = tmp_path_factory.mktemp("grouped") / "ds"
    build_sudoku_dataset(out, puzzles[:8], puzzles[8:], num_aug=2, seed=0, show_progress=False)
    return PuzzleSplit(out, "train")  # 8 groups of 3 single-example puzzles


def group_of(split: PuzzleSplit, examples) -> list[int]:
    puzzle = np.searchsorted(split.puzzle_indices, examples, side="right") - 1
    return (np.searchsorted(split.group_indices, puzzle, side="right") - 1).tolist()


def test_group_sampler_epoch_covers_every_group_once(grouped):
    sampler = GroupSampler(grouped, batch_size=4, seed=0)
    assert sampler.epoch_size == 8
    epoch = [group_of(grouped, sampler.next_indices()) for _ in range(2)]
    assert sorted(epoch[0] + epoch[1]) == list(range(8)) and sampler.state_dict()["epoch"] == 1
    batch = sampler.next_batch()
    assert batch["inputs"].shape == batch["labels"].shape == (4, 81) and batch["inputs"].dtype == torch.int64
    assert batch["puzzle_identifiers"].tolist() == [0] * 4
    # a tail that does not fill a batch carries over: 3 batches of 3 = 9 draws = one epoch + 1
    sampler = GroupSampler(grouped, batch_size=3, seed=1)
    draws = np.concatenate([sampler.next_indices() for _ in range(8)])  # 24 draws = 3 epochs
    assert all(len(b) == 3 for b in np.split(draws, 8))
    for e in range(3):
        assert sorted(group_of(grouped, draws[8 * e:8 * e + 8])) == list(range(8))


def test_group_sampler_seeded_resumable_and_rank_sliced(grouped):
    a, b = GroupSampler(grouped, 5, seed=7), GroupSampler(grouped, 5, seed=7)
    assert all(np.array_equal(a.next_indices(), b.next_indices()) for _ in range(4))
    other = GroupSampler(grouped, 5, seed=8)
    assert not all(np.array_equal(GroupSampler(grouped, 5, seed=7).next_indices(), other.next_indices())
                   for _ in range(2))
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch() for _ in range(3)]
    resumed = GroupSampler(grouped, 5, seed=7)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(LMForgeError, match="seed"):
        GroupSampler(grouped, 5, seed=9).load_state_dict(state)

    whole = GroupSampler(grouped, 6, seed=3)
    ranks = [GroupSampler(grouped, 3, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        assert np.array_equal(whole.next_indices(), np.concatenate([r.next_indices() for r in ranks]))


def test_sampler_maps_ignore_label_to_minus_100(tmp_path):
    labels = np.full((4, 81), 5)
    labels[:, :3] = 0  # ignore_label_id
    write_hrm_split(tmp_path / "train", np.ones((4, 81)), labels, [0, 1, 2, 3, 4], [0, 2, 4])
    batch = GroupSampler(PuzzleSplit(tmp_path, "train"), 2, seed=0).next_batch()
    assert (batch["labels"][:, :3] == -100).all() and (batch["labels"][:, 3:] == 5).all()


def test_eval_loader_order_limit_ranks(grouped):
    loader = PuzzleEvalLoader(grouped, batch_size=5)
    batches = list(loader.iter_eval_batches())
    assert loader.num_examples == 24 and [len(b["inputs"]) for b in batches] == [5, 5, 5, 5, 4]
    assert np.array_equal(torch.cat([b["inputs"] for b in batches]).numpy(), np.asarray(grouped.inputs))
    assert torch.cat([b["ratings"] for b in batches]).tolist() == grouped.ratings.tolist()
    assert len(list(loader.iter_eval_batches(max_batches=2))) == 2
    limited = PuzzleEvalLoader(grouped, batch_size=4, limit=6)
    assert limited.num_examples == 6 and [len(b["inputs"]) for b in limited.iter_eval_batches()] == [4, 2]
    parts = [PuzzleEvalLoader(grouped, batch_size=4, rank=r, world_size=3) for r in range(3)]
    rows = {r: torch.cat([b["inputs"] for b in p.iter_eval_batches()]) for r, p in enumerate(parts)}
    for r in range(3):
        assert np.array_equal(rows[r].numpy(), np.asarray(grouped.inputs[r::3]))


def test_difficulty_buckets():
    ratings = np.array([0, 1, 2, 3, 9, 10, 500, -1])
    assert difficulty_bucket(ratings).tolist() == [0, 1, 1, 2, 2, 3, 3, -1]
    assert difficulty_bucket(torch.tensor([0, 10])).tolist() == [0, 3]
    assert rating_histogram(ratings) == dict(zip(DIFFICULTY_NAMES, [1, 2, 2, 2]))


# --- subsample and CSV import ----------------------------------------------------------------------------

def test_subsample_is_seeded(puzzles):
    a, b = subsample(puzzles, 5, seed=1), subsample(puzzles, 5, seed=1)
    assert len(a) == 5 and same_puzzles(a, b)
    assert not same_puzzles(a, subsample(puzzles, 5, seed=2))
    with pytest.raises(LMForgeError, match="larger than the 12"):
        subsample(puzzles, 13, seed=0)


def csv_rows(puzzles: list[Puzzle]) -> list[str]:
    return [f"gen,{format_grid(p.question)},{format_grid(p.answer)},{p.rating}" for p in puzzles]


def test_read_csv(tmp_path, puzzles):
    path = tmp_path / "train.csv"
    rows = csv_rows(puzzles[:3])
    rows[1] = rows[1].rsplit(",", 1)[0] + ",4.0"  # float-looking rating
    path.write_text("source,q,a,rating\n" + "\n".join(rows) + "\n")
    read = read_sudoku_csv(path)
    assert len(read) == 3 and read[1].rating == 4 and read[0].source == "gen"
    for got, want in zip(read, puzzles):
        assert np.array_equal(got.question, want.question) and np.array_equal(got.answer, want.answer)


@pytest.mark.parametrize("bad, message", [
    ("gen,{q},{a}", "3 columns, expected 4"),
    ("gen,{q80},{a},0", "question has 80 cells"),
    ("gen,{qx},{a},0", "bad character 'x'"),
    ("gen,{q},{a_wrong},0", "not a solution"),
    ("gen,{q},{a_blank},0", "must be complete"),
    ("gen,{q},{a},hard", "not an integer"),
])
def test_read_csv_rejects_bad_row_with_line_number(tmp_path, puzzles, bad, message):
    p = puzzles[0]
    q, a = format_grid(p.question), format_grid(p.answer)
    wrong = np.array([0, 2, 1, 3, 4, 5, 6, 7, 8, 9])[p.answer]  # a valid grid that breaks the clues
    row = bad.format(q=q, a=a, q80=q[:80], qx="x" + q[1:], a_wrong=format_grid(wrong), a_blank="." + a[1:])
    path = tmp_path / "bad.csv"
    path.write_text("source,q,a,rating\n" + "\n".join(csv_rows(puzzles[1:3])) + "\n" + row + "\n")
    with pytest.raises(LMForgeError, match=message) as err:
        read_sudoku_csv(path)
    assert "line 4" in str(err.value) and str(path) in str(err.value)


def test_read_csv_missing_empty_headerless(tmp_path):
    with pytest.raises(LMForgeError, match="no such file"):
        read_sudoku_csv(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(LMForgeError, match="is empty"):
        read_sudoku_csv(tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text("source,q,a,rating\n")
    with pytest.raises(LMForgeError, match="no puzzles"):
        read_sudoku_csv(tmp_path / "header.csv")
    (tmp_path / "noheader.csv").write_text(f"gen,{HARD_Q},{HARD_A},3\n")
    with pytest.raises(LMForgeError, match="line 1: header"):
        read_sudoku_csv(tmp_path / "noheader.csv")


# --- CLI -------------------------------------------------------------------------------------------------

def test_cli_generated_end_to_end(tmp_path, capsys):
    out = tmp_path / "sudoku"
    argv = ["data", "sudoku", "--out", str(out), "--generate", "20", "--num-aug", "3", "--test-generate", "10",
            "--seed", "2", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "train: 20 puzzles, 80 examples in 20 groups" in printed
    assert "test: 10 puzzles" in printed and "singles" in printed
    train, test = PuzzleSplit(out, "train"), PuzzleSplit(out, "test")
    assert (train.num_examples, train.num_groups, test.num_examples) == (80, 20, 10)
    train_questions = {bytes(r) for r in np.asarray(train.inputs)}
    assert not any(bytes(r) in train_questions for r in np.asarray(test.inputs))
    clues = np.count_nonzero(np.asarray(test.inputs) > 1, axis=1)
    assert clues.min() >= 30 and clues.max() <= 36
    record = json.loads((out / "lmforge_sudoku.json").read_text())
    assert record["train_source"] == "generated" and record["seed"] == 2 and record["clue_range"] == [30, 36]

    assert main(argv) == 2  # exists: refused
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--hardest", "5"]) == 0
    assert PuzzleSplit(out, "train").num_groups == 5
    ratings = PuzzleSplit(out, "train").ratings[::4]
    all_ratings = sorted((p.rating for p in generate_puzzles(20, seed=2, show_progress=False, workers=1)),
                         reverse=True)
    assert sorted(ratings.tolist(), reverse=True) == all_ratings[:5]


def test_cli_keeps_the_hardest_test_puzzles_and_no_shared_grid(tmp_path, capsys):
    out = tmp_path / "hard"
    argv = ["data", "sudoku", "--out", str(out), "--generate", "12", "--hardest", "4", "--test-generate", "30",
            "--test-hardest", "6", "--seed", "3", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    assert "test from generated (30 puzzles, hardest 6)" in capsys.readouterr().out
    test = PuzzleSplit(out, "test")
    pool = generate_puzzles(30, seed=3, show_progress=False, workers=1, stream=1)  # the test pool, no repeats
    assert sorted(test.ratings.tolist(), reverse=True) == sorted((p.rating for p in pool), reverse=True)[:6]
    kept = {bytes(r) for r in np.asarray(test.inputs)}
    assert kept <= {bytes(p.question + 1) for p in pool}
    record = json.loads((out / "lmforge_sudoku.json").read_text())
    assert (record["test_pool"], record["test_hardest"]) == (30, 6)

    for bad, expected in (("0", "--test-hardest 0: must be between 1 and the number of test puzzles (30)"),
                          ("31", "--test-hardest 31: must be between 1")):
        target = tmp_path / f"bad{bad}"
        assert main(["data", "sudoku", "--out", str(target), "--generate", "12", "--test-generate", "30",
                     "--test-hardest", bad, "--workers", "1", "--no-progress"]) == 2
        assert expected in capsys.readouterr().err
        assert not target.exists()


def test_a_generated_test_puzzle_sharing_a_solution_with_a_train_puzzle_is_replaced(capsys):
    import argparse

    from lmforge.recipes.puzzles.cli_data import _generated_test_set, _grids

    args = argparse.Namespace(min_clues=30, max_clues=36, seed=5, workers=1, progress=False)
    first = generate_puzzles(1, seed=5, show_progress=False, workers=1, stream=1)[0]
    # a train puzzle with another question but the first test puzzle's solution grid
    other = first.question.copy()
    other[np.flatnonzero(other)[0]] = 0
    train = [Puzzle(other, first.answer, 0, "test")]
    assert b"q" + first.question.tobytes() not in _grids(train)
    test = _generated_test_set(args, 3, _grids(train))
    assert len(test) == 3 and not any(np.array_equal(p.answer, first.answer) for p in test)
    assert "shared a question or solution grid" in capsys.readouterr().out
    # without the train set the same first puzzle is kept
    assert np.array_equal(_generated_test_set(args, 1, set())[0].answer, first.answer)


def test_cli_from_csv(tmp_path, puzzles, capsys):
    train_csv, test_csv = tmp_path / "train.csv", tmp_path / "test.csv"
    train_csv.write_text("source,q,a,rating\n" + "\n".join(csv_rows(puzzles[:8])) + "\n")
    test_csv.write_text("source,q,a,rating\n" + "\n".join(csv_rows(puzzles[8:])) + "\n")
    out = tmp_path / "fromcsv"
    assert main(["data", "sudoku", "--out", str(out), "--csv", str(train_csv), "--test-csv", str(test_csv),
                 "--subsample-size", "6", "--num-aug", "1", "--no-progress"]) == 0
    assert "train: 6 puzzles, 12 examples in 6 groups" in capsys.readouterr().out
    train, test = PuzzleSplit(out, "train"), PuzzleSplit(out, "test")
    kept = subsample(puzzles[:8], 6, seed=0)
    assert np.array_equal(np.asarray(train.inputs[::2]), np.stack([p.question for p in kept]) + 1)
    assert np.array_equal(np.asarray(test.labels), np.stack([p.answer for p in puzzles[8:]]) + 1)
    record = json.loads((out / "lmforge_sudoku.json").read_text())
    assert record["train_source"] == str(train_csv) and record["subsample_size"] == 6

    assert main(["data", "sudoku", "--out", str(tmp_path / "x"), "--csv", str(tmp_path / "missing.csv"),
                 "--test-csv", str(test_csv)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
