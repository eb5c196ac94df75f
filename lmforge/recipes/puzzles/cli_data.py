"""`lmforge data sudoku`: Sudoku puzzles (generated or from a CSV) in HRM's dataset layout."""

from __future__ import annotations

import argparse

from lmforge.errors import LMForgeError
from lmforge.recipes.puzzles.data import DIFFICULTY_NAMES
from lmforge.recipes.puzzles.sudoku import (build_sudoku_dataset, check_out_dir, generate_puzzles, hardest,
                                            read_sudoku_csv, subsample)


def _generated_test_set(args: argparse.Namespace, count: int, train_grids: set[bytes]) -> list:
    """``count`` generated test puzzles (RNG stream 1, train uses 0) none of whose question or solution grid
    is in ``train_grids`` (the train pool's questions and solutions) or repeats one: such puzzles are
    dropped and replaced by further ones."""
    test, seen, next_index, dropped = [], set(train_grids), 0, 0
    while len(test) < count:
        want = count - len(test)
        batch = generate_puzzles(want, args.min_clues, args.max_clues, seed=args.seed, workers=args.workers,
                                 show_progress=args.progress, stream=1, start_index=next_index)
        next_index += want
        for p in batch:
            keys = (b"q" + p.question.tobytes(), b"a" + p.answer.tobytes())
            if any(key in seen for key in keys):
                dropped += 1
            else:
                seen.update(keys)
                test.append(p)
        if dropped > 10 * count + 100:
            raise LMForgeError(f"could not generate {count} test puzzles that differ from the train puzzles "
                               f"({dropped} duplicates); widen --min-clues/--max-clues or ask for fewer.")
    if dropped:
        print(f"  dropped {dropped} generated test puzzle(s) that shared a question or solution grid with a train "
              "or test puzzle (replaced)")
    return test


def _grids(puzzles: list) -> set[bytes]:
    """The question and solution grids of ``puzzles``, as ``_generated_test_set`` compares them."""
    return {b"q" + p.question.tobytes() for p in puzzles} | {b"a" + p.answer.tobytes() for p in puzzles}


def cmd_data_sudoku(args: argparse.Namespace) -> int:
    for flag, value in (("--generate", args.generate), ("--test-generate", args.test_generate)):
        if value is not None and value < 1:
            raise LMForgeError(f"{flag} {value}: ask for at least 1 puzzle.")
    if args.num_aug < 0:
        raise LMForgeError(f"--num-aug {args.num_aug}: must be 0 or more.")
    for flag, value in (("--hardest", args.hardest), ("--subsample-size", args.subsample_size)):
        if value is not None and not 1 <= value <= (args.generate or value):
            raise LMForgeError(f"{flag} {value}: must be between 1 and the number of train puzzles"
                               + (f" ({args.generate})." if args.generate else "."))
    if args.test_hardest is not None and not 1 <= args.test_hardest <= (args.test_generate or args.test_hardest):
        raise LMForgeError(f"--test-hardest {args.test_hardest}: must be between 1 and the number of test puzzles"
                           + (f" ({args.test_generate}): generate a larger pool with --test-generate."
                              if args.test_generate else "."))
    check_out_dir(args.out, args.overwrite)  # before generating: fail fast
    if args.generate is not None:
        train = generate_puzzles(args.generate, args.min_clues, args.max_clues, seed=args.seed,
                                 workers=args.workers, show_progress=args.progress, stream=0)
        train_source = "generated"
    else:
        train = read_sudoku_csv(args.csv)
        train_source = str(args.csv)
    pool_size = len(train)
    train_grids = _grids(train)
    if args.hardest is not None:
        train = hardest(train, args.hardest)
    if args.subsample_size is not None:
        train = subsample(train, args.subsample_size, args.seed)

    if args.test_csv is not None:
        test = read_sudoku_csv(args.test_csv)
        test_source = str(args.test_csv)
        overlap = sum(bool(_grids([p]) & train_grids) for p in test)
        if overlap:
            print(f"  note: {overlap} test puzzle(s) of {args.test_csv} share a question or solution grid with "
                  "the train set")
    else:
        count = args.test_generate if args.test_generate is not None else min(1000, max(1, pool_size // 10))
        test = _generated_test_set(args, count, train_grids)
        test_source = "generated"
    test_pool = len(test)
    if args.test_hardest is not None:
        test = hardest(test, args.test_hardest, "--test-hardest")

    generated = args.generate is not None or args.test_csv is None
    provenance = {
        "train_source": train_source, "test_source": test_source, "seed": args.seed,
        "clue_range": [args.min_clues, args.max_clues] if generated else None,
        "num_aug": args.num_aug, "train_pool": pool_size, "hardest": args.hardest,
        "subsample_size": args.subsample_size, "test_pool": test_pool, "test_hardest": args.test_hardest}
    summary = build_sudoku_dataset(args.out, train, test, num_aug=args.num_aug, seed=args.seed,
                                   overwrite=args.overwrite, show_progress=args.progress, provenance=provenance)
    print(f"sudoku: {summary['out']}")
    print(f"  train from {train_source} ({pool_size} puzzles"
          + (f", hardest {args.hardest}" if args.hardest is not None else "")
          + (f", subsample {args.subsample_size}" if args.subsample_size is not None else "")
          + f"), test from {test_source}"
          + (f" ({test_pool} puzzles, hardest {args.test_hardest})" if args.test_hardest is not None else ""))
    for name, split in summary["splits"].items():
        buckets = ", ".join(f"{b} {split['rating_buckets'][b]}" for b in DIFFICULTY_NAMES)
        print(f"  {name}: {split['puzzles']} puzzles, {split['examples']} examples in {split['groups']} groups; "
              f"clues {split['clues'][0]}-{split['clues'][1]}; ratings {split['ratings'][0]}-"
              f"{split['ratings'][1]} ({buckets})")
    return 0


def add_data_verbs(data_verbs: argparse._SubParsersAction) -> None:
    p = data_verbs.add_parser(
        "sudoku", help="generate or import Sudoku puzzles into HRM's dataset layout",
        description="Write a Sudoku dataset for the HRM/TRM models in HRM's on-disk layout (train/ and test/ "
                    "with dataset.json and all__*.npy). Train puzzles are generated (--generate) or read from a "
                    "Sudoku-Extreme style CSV (--csv, header source,q,a,rating); --hardest and "
                    "--subsample-size select among them, --num-aug adds augmented copies (digit relabelling, "
                    "transposition, band/row/stack/column shuffles). Test puzzles come from --test-csv or are "
                    "generated with other seeds than the train puzzles and share no question or solution grid "
                    "with a train puzzle; --test-hardest keeps the hardest of them. Ratings: the solver's "
                    "guesses for generated puzzles (0 = naked singles suffice), the "
                    "CSV's rating column for imported ones.")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output dataset directory; must be new or empty unless --overwrite (required)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--generate", type=int, metavar="N", help="generate N train puzzles")
    source.add_argument("--csv", metavar="TRAIN.csv",
                        help="read the train puzzles from a CSV (header source,q,a,rating)")
    test = p.add_mutually_exclusive_group()
    test.add_argument("--test-csv", metavar="TEST.csv", help="read the test puzzles from a CSV")
    test.add_argument("--test-generate", type=int, metavar="M",
                      help="generate M test puzzles, none sharing a question or solution grid with a train "
                           "puzzle (default when no --test-csv: "
                           "a tenth of the train puzzles, at least 1 and at most 1000)")
    p.add_argument("--min-clues", type=int, default=30, metavar="N",
                   help="fewest clues of a generated puzzle, at least 17 (default: 30)")
    p.add_argument("--max-clues", type=int, default=36, metavar="N",
                   help="most clues of a generated puzzle, at most 80 (default: 36)")
    p.add_argument("--hardest", type=int, metavar="K",
                   help="keep only the K train puzzles with the highest rating (default: keep all)")
    p.add_argument("--test-hardest", type=int, metavar="K",
                   help="keep only the K test puzzles with the highest rating, e.g. the hardest 1,000 of "
                        "--test-generate 100000 (default: keep all)")
    p.add_argument("--subsample-size", type=int, metavar="K",
                   help="keep a seeded random subset of K train puzzles, after --hardest (default: keep all)")
    p.add_argument("--num-aug", type=int, default=0, metavar="A",
                   help="augmented copies per train puzzle, each its own puzzle in the puzzle's group "
                        "(default: 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of generation, subsampling and augmentation (default: 0)")
    p.add_argument("--workers", type=int, default=0, metavar="W",
                   help="processes generating puzzles; 0 = all CPU cores (default: 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset in --out once the new one is complete (default: refuse)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide progress bars (default: shown)")
    p.set_defaults(func=cmd_data_sudoku)


