"""CLI verbs ``lmforge tokenizer train`` and ``lmforge data prepare``: argument wiring and summaries.

The work itself lives in ``lmforge.data.prepare``; these functions only translate arguments and print.
Each training kind adds its own ``data`` builders (``lmforge/recipes/<kind>/cli_data.py``).
"""

from __future__ import annotations

import argparse

from lmforge.data.prepare import VAL_LEAK, prepare_data, train_tokenizer_from_sources
from lmforge.data.sources import DEFAULT_INCLUDE


def _add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="directories (source trees or Hugging Face save_to_disk datasets) and files "
                        "(.jsonl, .parquet, or plain text: one document per file, or per story between "
                        "<|endoftext|> lines)")
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


def _print_filters(filters: dict, what: str = "documents") -> None:
    skipped = filters["skipped"]
    detail = ", ".join(f"{reason} {n}" for reason, n in skipped.items()) or "none"
    print(f"  {what} kept {filters['kept']}, skipped {sum(skipped.values())} ({detail})")


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
        overwrite=args.overwrite, show_progress=args.progress, val_sources=args.val or ())
    print(f"data: {args.out} ({meta['dtype']}, vocab size {meta['vocab_size']})")
    if "val_filters" in meta:  # meta's filters count both; each side on its own line
        val = meta["val_filters"]
        train = {"kept": meta["filters"]["kept"] - val["kept"],
                 "skipped": {reason: n - val["skipped"].get(reason, 0) for reason, n in meta["filters"]["skipped"].items()
                             if n - val["skipped"].get(reason, 0)}}
        _print_filters(train)
        _print_filters(val, "--val documents")
        leaked = val["skipped"].get(VAL_LEAK, 0)
        if leaked:
            copies = "exact or near copies" if args.near_dedup else "exact copies"
            print(f"  warning: {leaked} documents of --val duplicate training documents ({copies}) "
                  "and were left out of val: the inputs hold part of the validation set")
    else:
        _print_filters(meta["filters"])
    for name, split in meta["splits"].items():
        per_byte = split["bytes"] / split["tokens"] if split["tokens"] else 0.0
        print(f"  {name}: {split['documents']} documents, {split['tokens']:,} tokens in "
              f"{len(split['shards'])} shards, {split['bytes']:,} bytes ({per_byte:.3f} bytes/token)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> dict[str, argparse._SubParsersAction]:
    """Add ``tokenizer train``, ``data prepare`` and each training kind's data builders (``data sudoku``,
    ``data go-functions`` ...); returns the sub-actions."""
    from lmforge.recipes import kinds

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
                    "document, tokenize and pack the tokens into shards with a meta.json. With --val, "
                    "the inputs are all train and the --val inputs all val (no hash split); a --val "
                    "document that duplicates a training one is dropped from val and counted.")
    _add_source_options(prepare)
    prepare.add_argument("--tokenizer", required=True, metavar="PATH",
                         help="tokenizer.json or its directory (required)")
    prepare.add_argument("--out", required=True, metavar="DIR",
                         help="output data directory; must be new or empty unless --overwrite (required)")
    prepare.add_argument("--near-dedup", action="store_true",
                         help="also drop near-duplicates (MinHash, Jaccard >= 0.8) (default: off)")
    prepare.add_argument("--val", action="append", metavar="INPUT",
                         help="your own validation set: a directory or file like INPUT (a DatasetDict's split "
                              "directory, e.g. my_ds/validation, works); repeatable. Every --val document goes to "
                              "val, every input document to train (default: split the inputs by --val-fraction)")
    prepare.add_argument("--val-fraction", type=float, default=None, metavar="F",
                         help="share of documents in the val split, at least one; not with --val (default: 0.05)")
    prepare.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                         help="tokens per shard file (default: 100000000)")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty --out directory once the new data is complete "
                              "(default: refuse)")
    prepare.set_defaults(func=cmd_data_prepare)
    from lmforge.data.stories import add_cli as add_stories

    add_stories(data_verbs)  # `lmforge data stories`: a stand-in for TinyStories (seed 004's stage 1)
    for spec in kinds():
        if spec.add_data_verbs is not None:
            spec.add_data_verbs(data_verbs)
    return {"tokenizer": tokenizer_verbs, "data": data_verbs}
