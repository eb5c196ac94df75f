"""CLI verbs ``lmforge tokenizer train``, ``lmforge data prepare``, ``lmforge data sudoku`` and
``lmforge data go-functions``: argument wiring and summaries.

The work itself lives in ``lmforge.data.prepare``, ``lmforge.data.sudoku`` and
``lmforge.data.go_functions``; these functions only translate arguments and print.
"""

from __future__ import annotations

import argparse

from lmforge.data.prepare import prepare_data, train_tokenizer_from_sources
from lmforge.data.puzzles import DIFFICULTY_NAMES
from lmforge.data.sources import DEFAULT_INCLUDE
from lmforge.data.sudoku import (build_sudoku_dataset, check_out_dir, generate_puzzles, hardest, read_sudoku_csv,
                                 subsample)
from lmforge.errors import LMForgeError


def _add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="directories (source trees or Hugging Face save_to_disk datasets) and files "
                        "(.jsonl, .parquet, or plain text: one document per file)")
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="glob for files inside directory inputs, relative to each directory; repeatable "
                        f"(default: {' '.join(DEFAULT_INCLUDE)})")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSON field / column holding the text in .jsonl, .parquet and Hugging Face "
                        "datasets (default: text)")
    p.add_argument("--exclude-tests", action="store_true",
                   help="also skip Go *_test.go files (default: keep them)")
    p.add_argument("--seed", type=int, default=1337, metavar="N",
                   help="seed of the per-document split hash (default: 1337)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide progress bars (default: shown)")


def _print_filters(filters: dict) -> None:
    skipped = filters["skipped"]
    detail = ", ".join(f"{reason} {n}" for reason, n in skipped.items()) or "none"
    print(f"  documents kept {filters['kept']}, skipped {sum(skipped.values())} ({detail})")


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    report = train_tokenizer_from_sources(
        args.inputs, args.out, vocab_size=args.vocab_size, include=args.include or DEFAULT_INCLUDE,
        text_field=args.text_field, exclude_tests=args.exclude_tests, min_frequency=args.min_frequency,
        max_bytes=args.max_bytes, heldout_fraction=args.heldout_fraction, seed=args.seed,
        show_progress=args.progress, overwrite=args.overwrite)
    print(f"tokenizer: {report['tokenizer']} (vocab size {report['vocab_size']})")
    _print_filters(report["filters"])
    print(f"  trained on {report['train_documents']} documents, {report['train_bytes']:,} bytes")
    if report["heldout_bytes_per_token"] is None:
        print("  held-out bytes/token: not measured (no held-out documents)")
    else:
        print(f"  held-out bytes/token: {report['heldout_bytes_per_token']:.3f} over "
              f"{report['heldout_documents']} documents, {report['heldout_bytes']:,} bytes")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    meta = prepare_data(
        args.inputs, args.out, args.tokenizer, include=args.include or DEFAULT_INCLUDE,
        text_field=args.text_field, exclude_tests=args.exclude_tests, near_dedup=args.near_dedup,
        val_fraction=args.val_fraction, seed=args.seed, shard_tokens=args.shard_tokens,
        overwrite=args.overwrite, show_progress=args.progress)
    print(f"data: {args.out} ({meta['dtype']}, vocab size {meta['vocab_size']})")
    _print_filters(meta["filters"])
    for name, split in meta["splits"].items():
        per_byte = split["bytes"] / split["tokens"] if split["tokens"] else 0.0
        print(f"  {name}: {split['documents']} documents, {split['tokens']:,} tokens in "
              f"{len(split['shards'])} shards, {split['bytes']:,} bytes ({per_byte:.3f} bytes/token)")
    return 0


def _generated_test_set(args: argparse.Namespace, count: int, train_questions: set[bytes]) -> list:
    """``count`` generated test puzzles (RNG stream 1, train uses 0) none of whose questions is in
    ``train_questions`` or repeats: duplicates are dropped and replaced by further puzzles."""
    test, seen, next_index, dropped = [], set(train_questions), 0, 0
    while len(test) < count:
        want = count - len(test)
        batch = generate_puzzles(want, args.min_clues, args.max_clues, seed=args.seed, workers=args.workers,
                                 show_progress=args.progress, stream=1, start_index=next_index)
        next_index += want
        for p in batch:
            key = p.question.tobytes()
            if key in seen:
                dropped += 1
            else:
                seen.add(key)
                test.append(p)
        if dropped > 10 * count + 100:
            raise LMForgeError(f"could not generate {count} test puzzles that differ from the train puzzles "
                               f"({dropped} duplicates); widen --min-clues/--max-clues or ask for fewer.")
    if dropped:
        print(f"  dropped {dropped} generated test puzzle(s) that repeated a train or test puzzle (replaced)")
    return test


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
    check_out_dir(args.out, args.overwrite)  # before generating: fail fast
    if args.generate is not None:
        train = generate_puzzles(args.generate, args.min_clues, args.max_clues, seed=args.seed,
                                 workers=args.workers, show_progress=args.progress, stream=0)
        train_source = "generated"
    else:
        train = read_sudoku_csv(args.csv)
        train_source = str(args.csv)
    pool_size = len(train)
    train_questions = {p.question.tobytes() for p in train}
    if args.hardest is not None:
        train = hardest(train, args.hardest)
    if args.subsample_size is not None:
        train = subsample(train, args.subsample_size, args.seed)

    if args.test_csv is not None:
        test = read_sudoku_csv(args.test_csv)
        test_source = str(args.test_csv)
        overlap = sum(p.question.tobytes() in train_questions for p in test)
        if overlap:
            print(f"  note: {overlap} test puzzle(s) of {args.test_csv} also appear in the train set")
    else:
        count = args.test_generate if args.test_generate is not None else min(1000, max(1, pool_size // 10))
        test = _generated_test_set(args, count, train_questions)
        test_source = "generated"

    generated = args.generate is not None or args.test_csv is None
    provenance = {
        "train_source": train_source, "test_source": test_source, "seed": args.seed,
        "clue_range": [args.min_clues, args.max_clues] if generated else None,
        "num_aug": args.num_aug, "train_pool": pool_size, "hardest": args.hardest,
        "subsample_size": args.subsample_size}
    summary = build_sudoku_dataset(args.out, train, test, num_aug=args.num_aug, seed=args.seed,
                                   overwrite=args.overwrite, show_progress=args.progress, provenance=provenance)
    print(f"sudoku: {summary['out']}")
    print(f"  train from {train_source} ({pool_size} puzzles"
          + (f", hardest {args.hardest}" if args.hardest is not None else "")
          + (f", subsample {args.subsample_size}" if args.subsample_size is not None else "")
          + f"), test from {test_source}")
    for name, split in summary["splits"].items():
        buckets = ", ".join(f"{b} {split['rating_buckets'][b]}" for b in DIFFICULTY_NAMES)
        print(f"  {name}: {split['puzzles']} puzzles, {split['examples']} examples in {split['groups']} groups; "
              f"clues {split['clues'][0]}-{split['clues'][1]}; ratings {split['ratings'][0]}-"
              f"{split['ratings'][1]} ({buckets})")
    return 0


def _add_sudoku(data_verbs: argparse._SubParsersAction) -> None:
    p = data_verbs.add_parser(
        "sudoku", help="generate or import Sudoku puzzles into HRM's dataset layout",
        description="Write a Sudoku dataset for the HRM/TRM models in HRM's on-disk layout (train/ and test/ "
                    "with dataset.json and all__*.npy). Train puzzles are generated (--generate) or read from a "
                    "Sudoku-Extreme style CSV (--csv, header source,q,a,rating); --hardest and "
                    "--subsample-size select among them, --num-aug adds augmented copies (digit relabelling, "
                    "transposition, band/row/stack/column shuffles). Test puzzles come from --test-csv or are "
                    "generated with other seeds than the train puzzles and never repeat a train puzzle. "
                    "Ratings: the solver's guesses for generated puzzles (0 = naked singles suffice), the "
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
                      help="generate M test puzzles, none equal to a train puzzle (default when no --test-csv: "
                           "a tenth of the train puzzles, at least 1 and at most 1000)")
    p.add_argument("--min-clues", type=int, default=30, metavar="N",
                   help="fewest clues of a generated puzzle, at least 17 (default: 30)")
    p.add_argument("--max-clues", type=int, default=36, metavar="N",
                   help="most clues of a generated puzzle, at most 80 (default: 36)")
    p.add_argument("--hardest", type=int, metavar="K",
                   help="keep only the K train puzzles with the highest rating (default: keep all)")
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


def cmd_data_go_functions(args: argparse.Namespace) -> int:
    from lmforge.data.go_functions import extract_go_functions

    meta = extract_go_functions(args.src_dir, args.out, include_tests=args.include_tests,
                                val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                                max_code_chars=args.max_code_chars, overwrite=args.overwrite,
                                show_progress=args.progress)
    counts, packages = meta["functions"], meta["packages"]
    print(f"go functions: {args.out} ({meta['files_read']} files read"
          + (", cross-checked with gofmt)" if meta["gofmt_checked"] else ", gofmt not found: tree-sitter only)"))
    print("  kept " + ", ".join(f"{s} {counts[s]:,} functions in {len(packages[s])} packages" for s in counts))
    skipped = meta["skipped"]
    detail = ", ".join(f"{reason} {n:,}" for reason, n in skipped.items() if n) or "none"
    print(f"  skipped {sum(skipped.values()):,} ({detail})")
    return 0


def _add_go_functions(data_verbs: argparse._SubParsersAction) -> None:
    p = data_verbs.add_parser(
        "go-functions", help="(spec, plan, code) examples from every Go function of a source tree",
        description="Parse every .go file under SRC_DIR with tree-sitter-go (and gofmt where Go is "
                    "installed) and write one JSON record per function or method: its package and file, "
                    "spec (doc comment + signature), plan (an outline of the body's top-level statements) "
                    "and code (the body). Generated files, vendor/, testdata/, functions that do not parse "
                    "and, unless asked, tests are skipped and counted. The split is by package.")
    p.add_argument("src_dir", metavar="SRC_DIR", help="root of a Go source tree, e.g. $(go env GOROOT)/src")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory for train/val/test.jsonl and meta.json (required)")
    p.add_argument("--include-tests", action="store_true", help="also read *_test.go files (default: skip them)")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="share of functions, by whole packages, in val (default: 0.05)")
    p.add_argument("--test-fraction", type=float, default=0.05, metavar="F",
                   help="share of functions, by whole packages, in test (default: 0.05)")
    p.add_argument("--max-code-chars", type=int, default=20_000, metavar="N",
                   help="skip bodies longer than this (default: 20000)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier dataset in --out once the new one is complete (default: refuse)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide progress bars (default: shown)")
    p.set_defaults(func=cmd_data_go_functions)


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse._SubParsersAction]:
    """Add ``tokenizer train``, ``data prepare`` and ``data sudoku``; returns the sub-actions so others can
    add verbs."""
    tokenizer = subparsers.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tokenizer_verbs = tokenizer.add_subparsers(dest="tokenizer_verb", required=True, metavar="VERB")
    train = tokenizer_verbs.add_parser(
        "train", help="train a tokenizer on source trees or text files",
        description="Train a byte-level BPE tokenizer. The training sample is a random subset of the "
                    "filtered, deduplicated documents capped at --max-bytes; --heldout-fraction of the "
                    "documents are kept out of it to report bytes per token.")
    _add_source_options(train)
    train.add_argument("--out", required=True, metavar="DIR",
                       help="directory for tokenizer.json and its Hugging Face config files (required)")
    train.add_argument("--vocab-size", type=int, default=8192, metavar="N",
                       help="vocabulary size including 256 byte tokens and 6 specials (default: 8192)")
    train.add_argument("--min-frequency", type=int, default=2, metavar="N",
                       help="minimum pair count for a BPE merge (default: 2)")
    train.add_argument("--max-bytes", type=int, default=50_000_000, metavar="N",
                       help="cap on the UTF-8 bytes of the training sample; BPE training time and memory "
                            "grow with it (default: 50000000 = 50 MB)")
    train.add_argument("--heldout-fraction", type=float, default=0.01, metavar="F",
                       help="share of documents held out of training to measure bytes per token "
                            "(at least one when there are 2+; 0 = none) (default: 0.01)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an existing tokenizer.json in --out (default: refuse)")
    train.set_defaults(func=cmd_tokenizer_train)

    data = subparsers.add_parser("data", help="prepare training data")
    data_verbs = data.add_subparsers(dest="data_verb", required=True, metavar="VERB")
    prepare = data_verbs.add_parser(
        "prepare", help="filter, dedup, split and tokenize sources into token shards",
        description="Read sources, drop generated/vendored/duplicate documents, split train/val by "
                    "document, tokenize and pack the tokens into shards with a meta.json.")
    _add_source_options(prepare)
    prepare.add_argument("--tokenizer", required=True, metavar="PATH",
                         help="tokenizer.json or its directory (required)")
    prepare.add_argument("--out", required=True, metavar="DIR",
                         help="output data directory; must be new or empty unless --overwrite (required)")
    prepare.add_argument("--near-dedup", action="store_true",
                         help="also drop near-duplicates (MinHash, Jaccard >= 0.8) (default: off)")
    prepare.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                         help="share of documents in the val split, at least one (default: 0.05)")
    prepare.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                         help="tokens per shard file (default: 100000000)")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty --out directory once the new data is complete "
                              "(default: refuse)")
    prepare.set_defaults(func=cmd_data_prepare)
    _add_sudoku(data_verbs)
    _add_go_functions(data_verbs)
    return {"tokenizer": tokenizer_verbs, "data": data_verbs}
