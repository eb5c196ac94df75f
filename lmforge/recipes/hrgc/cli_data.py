"""`lmforge data go-functions`: (spec, plan, code) records from every Go function of a source tree."""

from __future__ import annotations

import argparse


def cmd_data_go_functions(args: argparse.Namespace) -> int:
    from lmforge.recipes.hrgc.functions import extract_go_functions

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


def add_data_verbs(data_verbs: argparse._SubParsersAction) -> None:
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


