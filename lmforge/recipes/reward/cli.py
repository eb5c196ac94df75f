"""The reward kind's command line: `lmforge eval CKPT --preferences DIR_OR_FILE` (held-out pair accuracy,
per kind of rejected reply)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmforge.errors import LMForgeError


def add_eval_args(group) -> None:
    group.add_argument("--preferences", default=None, metavar="DIR_OR_FILE",
                       help="score held-out preference pairs: a file of pairs, or a directory's --split (default "
                            "test) file such as DIR/test.jsonl of `lmforge data preferences`; prints pair accuracy "
                            "and mean margin overall and per kind of rejected reply")


def held_out_pairs(path: Path, split: str) -> list:
    """The pairs of a file as given, of a directory's ``SPLIT.jsonl`` (.json / .parquet), or of a
    ``datasets`` directory's split."""
    from lmforge.posttrain.formats import FILE_SUFFIXES
    from lmforge.posttrain.preferences import read_preferences

    if not path.exists():
        raise LMForgeError(f"--preferences {path} does not exist")
    if not path.is_dir():
        return read_preferences(path)
    for suffix in FILE_SUFFIXES:
        if (path / f"{split}{suffix}").is_file():
            return read_preferences(path / f"{split}{suffix}")
    if (path / "dataset_dict.json").is_file():
        return read_preferences(path, split=split)
    raise LMForgeError(f"--preferences {path} has no {split}.jsonl (nor .json / .parquet); pass the file of held-out "
                       "pairs, or --split NAME for another split of the directory")


def run_eval(args) -> int:
    from lmforge.infer.loading import load_for_inference
    from lmforge.models.reward import RewardModel
    from lmforge.posttrain.pairs import PairStats, render_pairs
    from lmforge.posttrain.render import check_chat_tokenizer
    from lmforge.recipes.reward.data import format_pair_report, pair_report, score_pairs

    if not args.preferences:
        raise LMForgeError("pass --preferences DIR_OR_FILE (held-out preference pairs) to score a reward model")
    source = Path(args.preferences)
    pairs = held_out_pairs(source, args.split or "test")
    if args.limit:
        pairs = pairs[:args.limit]
    model, tokenizer, _ = load_for_inference(args.checkpoint, device=args.device, model_class=RewardModel)
    check_chat_tokenizer(tokenizer, f"of {args.checkpoint}")
    seq_len = 2 * model.config.n_positions  # a row holds both sides of a pair, each within the context
    stats = PairStats()
    store = render_pairs(tokenizer, pairs, seq_len, stats, model.config.n_positions)
    if not len(store):
        raise LMForgeError(f"no pair of {source} can be scored: {stats.summary(seq_len)}")
    report = pair_report(store, score_pairs(model, store, seq_len, args.batch_size or 8))
    report["skipped"] = len(pairs) - len(store)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.checkpoint} on {source}: {stats.summary(seq_len)}", file=sys.stderr)
        print(format_pair_report(report))
    return 0
