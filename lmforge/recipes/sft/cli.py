"""The sft kind's command line: `lmforge data sft` (see what is learned), `lmforge data tool-calls`
(a synthetic tool-calling set) and `lmforge eval CKPT --tool-calls DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmforge.checkpoint import fine_tuned_from
from lmforge.cli_common import BASELINE, check_reply_tokens
from lmforge.errors import LMForgeError

DEFAULT_REPLY_TOKENS = 96


# ---- lmforge data sft ------------------------------------------------------------------------------
def cmd_data_sft(args: argparse.Namespace) -> int:
    from lmforge.posttrain.formats import ReadStats
    from lmforge.posttrain.render import (
        RenderStats,
        check_chat_tokenizer,
        render_examples,
        show_example,
    )
    from lmforge.recipes.sft.data import SFTSettings, read_splits
    from lmforge.tokenizer import Tokenizer

    if args.show < 0:
        raise LMForgeError("--show must be >= 0")
    if bool(args.tokenizer) == bool(args.checkpoint):
        raise LMForgeError("pass the tokenizer the model is served with: --checkpoint CKPT (its tokenizer) or "
                           "--tokenizer PATH, one of them")
    if args.checkpoint:
        from lmforge.checkpoint import resolve_model_dir
        from lmforge.infer.loading import find_tokenizer  # imports torch: --tokenizer alone does not

        tokenizer_file = find_tokenizer(resolve_model_dir(args.checkpoint))
    else:
        tokenizer_file = Path(args.tokenizer)
    tokenizer = Tokenizer.load(tokenizer_file)
    check_chat_tokenizer(tokenizer, str(tokenizer_file))
    settings = SFTSettings(format=args.format, assistant_turns=args.assistant_turns, skip_bad_rows=args.skip_bad_rows)
    read_stats = ReadStats()
    train, val = read_splits(Path(args.path), settings, 0.0 if not args.val_fraction else args.val_fraction,
                             args.seed, read_stats)
    stats = RenderStats()
    examples = render_examples(tokenizer, train + val, args.seq_len, settings.assistant_turns, stats)
    color = sys.stdout.isatty() and not args.no_color
    for i, example in enumerate(examples[:args.show]):
        n, sup = len(example.ids), int(example.supervised.sum())
        print(f"--- example {i + 1}: {example.source} ({n} tokens, {sup} supervised) ---")
        print(show_example(tokenizer, example, color))
    if args.show:
        print("--- supervised tokens are " + ("highlighted" if color else "between [[ and ]]") + "; the ids start "
              "with the eos the server puts before every prompt ---")
    by_format = ", ".join(f"{k} {v:,}" for k, v in sorted(read_stats.by_format.items()))
    print(f"{args.path}: {read_stats.rows:,} rows" + (f" ({by_format})" if by_format else "") +
          (f", {read_stats.bad:,} malformed skipped" if read_stats.bad else ""))
    print(stats.summary(args.seq_len))
    return 0


def cmd_data_tool_calls(args: argparse.Namespace) -> int:
    from lmforge.posttrain.toolcalls import write_tool_call_dataset

    meta = write_tool_call_dataset(args.out, n_train=args.n_train, n_val=args.n_val, n_test=args.n_test,
                                   seed=args.seed, overwrite=args.overwrite)
    counts = ", ".join(f"{split} {n:,}" for split, n in meta["counts"].items())
    print(f"wrote {args.out}: {counts} conversations (meta.json says what is in them)")
    return 0


def add_data_verbs(verbs) -> None:
    from lmforge.cli_common import formatter

    p = verbs.add_parser("sft", formatter_class=formatter,
                         help="check conversations for the sft kind: how many fit, and what is learned",
                         description="Read conversations (OpenAI messages + tools, prompt/completion, ShareGPT / "
                                     "Hermes, Glaive, xLAM; JSONL, JSON, parquet or a `datasets` directory), render "
                                     "them with the model's chat template as training does, and print a summary; "
                                     "--show N prints N examples with the supervised tokens marked.")
    p.add_argument("path", help="conversations: a file, a `datasets` directory or a directory with train.jsonl")
    p.add_argument("--checkpoint", default=None, help="take the tokenizer (and its chat template) of this checkpoint")
    p.add_argument("--tokenizer", default=None, help="or this tokenizer.json / tokenizer directory")
    p.add_argument("--show", type=int, default=3, help="examples to print with supervised tokens marked")
    p.add_argument("--seq-len", type=int, default=1024, help="data.seq_len of the run (longer examples are skipped)")
    p.add_argument("--format", default="auto", help="row layout (recipe.format): auto, openai, prompt_completion, "
                   "sharegpt, glaive, xlam")
    p.add_argument("--assistant-turns", default="all", choices=["all", "last"], help="turns the loss covers")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    p.add_argument("--val-fraction", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-color", action="store_true", help="mark supervised tokens with [[ ]] even on a terminal")
    p.set_defaults(func=cmd_data_sft)

    p = verbs.add_parser("tool-calls", formatter_class=formatter,
                         help="write a synthetic tool-calling set (train / val / held-out test)",
                         description="A reproducible set of conversations with tools: calls with typed arguments, "
                                     "multi-turn exchanges with tool results, and prompts that need no tool. Argument "
                                     "values are split so that none used in val/test appears in train.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-train", type=int, default=2000, help="training conversations")
    p.add_argument("--n-val", type=int, default=200, help="validation conversations (evaluation while training)")
    p.add_argument("--n-test", type=int, default=300, help="held-out conversations (`lmforge eval --tool-calls`)")
    p.add_argument("--seed", type=int, default=0, help="another seed gives another set")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier set at --out")
    p.set_defaults(func=cmd_data_tool_calls)


# ---- lmforge eval CKPT --tool-calls DIR -------------------------------------------------------------
def add_eval_args(group) -> None:
    group.add_argument("--tool-calls", default=None, metavar="DIR",
                       help="score tool calling on held-out conversations (DIR/test.jsonl of `lmforge data "
                            "tool-calls`, or a .jsonl file), through the server's parser; also scores the model "
                            "the checkpoint was fine-tuned from, when its run names one")


def run_eval(args) -> int:
    from lmforge.infer.loading import load_for_inference
    from lmforge.posttrain.toolcalls import (
        evaluate_tool_calls,
        format_tool_call_report,
        load_rows,
    )

    if not args.tool_calls:
        raise LMForgeError("pass --tool-calls DIR (held-out conversations with tools) to score tool calling")
    reply_tokens = check_reply_tokens(args.max_new_tokens) or DEFAULT_REPLY_TOKENS
    rows = load_rows(args.tool_calls, split=args.split or "test")
    if args.limit:
        rows = rows[:args.limit]
    models = {"checkpoint": args.checkpoint}
    baseline = None if args.no_baseline else (args.baseline or fine_tuned_from(args.checkpoint))
    if baseline:
        models[BASELINE] = baseline
    results = {}
    for label, path in models.items():
        model, tokenizer, _ = load_for_inference(path, device=args.device)
        print(f"{label}: {path}", file=sys.stderr)
        results[label] = evaluate_tool_calls(model, tokenizer, rows, max_new_tokens=reply_tokens,
                                             batch_size=args.batch_size or 16)
    if args.json:
        print(json.dumps({label: {k: v for k, v in r.items() if k not in ("examples", "replies")}
                          for label, r in results.items()}))
    else:
        print(format_tool_call_report(results))
    return 0
