"""`lmforge data preferences`: preference pairs built offline from the synthetic tool-calling set."""

from __future__ import annotations

import argparse
from collections import Counter


def cmd_data_preferences(args: argparse.Namespace) -> int:
    from lmforge.posttrain.preferences import write_preference_dataset

    meta = write_preference_dataset(args.out, n_train=args.n_train, n_val=args.n_val, n_test=args.n_test,
                                    seed=args.seed, overwrite=args.overwrite)
    counts = ", ".join(f"{split} {n:,}" for split, n in meta["counts"].items())
    kinds: Counter = Counter()
    for per_split in meta["kinds"].values():
        kinds.update(per_split)
    print(f"wrote {args.out}: {counts} pairs (meta.json says what is in them)")
    print("rejected replies, all splits: " + ", ".join(f"{kind} {n:,}" for kind, n in sorted(kinds.items())))
    return 0


def add_data_verbs(verbs) -> None:
    from lmforge.cli_common import formatter

    p = verbs.add_parser("preferences", formatter_class=formatter,
                         help="write synthetic preference pairs for tool calling (train / val / held-out test)",
                         description="Pairs built from the conversations of `lmforge data tool-calls` (same seed, "
                                     "same prompts): the chosen reply is the right last turn, the rejected one a "
                                     "typical mistake (wrong_tool, wrong_arguments, missed_call, false_call, "
                                     "ignored_result; the `kind` of each row). Argument values are split so that "
                                     "none used in val/test appears in train.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train", "--n-train", dest="n_train", type=int, default=2000, help="training pairs")
    p.add_argument("--val", "--n-val", dest="n_val", type=int, default=200,
                   help="validation pairs (evaluation while training)")
    p.add_argument("--test", "--n-test", dest="n_test", type=int, default=300,
                   help="held-out pairs (`lmforge eval CKPT --preferences DIR`)")
    p.add_argument("--seed", type=int, default=0, help="another seed gives another set")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier set at --out")
    p.set_defaults(func=cmd_data_preferences)
