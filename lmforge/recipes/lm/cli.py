"""`lmforge eval` and `lmforge generate` for language models (the gpt family)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmforge.cli_common import add_quantize_arg, require_data
from lmforge.errors import LMForgeError


def add_eval_args(group) -> None:
    group.add_argument("--include", action="append", default=[], help="glob for files in a raw source "
                       "directory (repeatable; default **/*.go)")
    group.add_argument("--text-field", default="text", help="text field of JSONL/parquet sources")
    group.add_argument("--seq-len", type=int, default=0, help="window length; 0 = the model's context")
    # lmforge 0.1 spelled --limit this way for language models.
    group.add_argument("--max-tokens", type=int, default=None, dest="limit", help=argparse.SUPPRESS)


def run_eval(args) -> int:
    from lmforge.eval.lm import evaluate

    data = require_data(args, "a directory written by `lmforge data prepare`, or raw sources (a file or directory)")
    if any((Path(data) / split / "dataset.json").is_file() for split in ("train", "test")):
        raise LMForgeError(f"--data {data} is a puzzle dataset (`lmforge data sudoku`), but {args.checkpoint} holds a "
                           "language model: pass its text data (a directory written by `lmforge data prepare`, or "
                           "raw sources), or evaluate a puzzle checkpoint (HRM/TRM) on this dataset")
    m = evaluate(args.checkpoint, data, split=args.split or "val", seq_len=args.seq_len,
                 batch_size=8 if args.batch_size is None else args.batch_size,
                 max_tokens=args.limit or None, device=args.device, include=tuple(args.include),
                 text_field=args.text_field)
    if args.json:
        print(json.dumps(m))
    else:
        bpb = f"  bits/byte {m['bpb']:.4f}" if "bpb" in m else ""
        print(f"{m['data']}: {int(m['tokens']):,} tokens  loss {m['loss']:.4f}  perplexity {m['ppl']:.3f}{bpb}")
    return 0


def add_generate_args(group) -> None:
    group.add_argument("--prompt", default="", help="text to continue; the two-character sequences \\n and \\t "
                       "become a newline and a tab. Use --prompt-file for prompts to be taken literally")
    group.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    group.add_argument("--no-stop-at-eos", action="store_true", help="keep going past the end-of-document token")
    add_quantize_arg(group)


def run_generate(args) -> int:
    from lmforge.infer.generate import generate_text
    from lmforge.infer.loading import load_for_inference
    from lmforge.tokenizer import check_text

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")  # shells pass "\n" literally
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise LMForgeError(f"cannot read --prompt-file {args.prompt_file}: {e}") from e
    check_text(prompt)  # before loading: --prompt in another encoding than UTF-8
    model, tokenizer, _ = load_for_inference(args.checkpoint, args.device, args.precision, quantize=args.quantize)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    generate_text(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_at_eos=not args.no_stop_at_eos,
                  stream=stream, note=lambda message: print(f"note: {message}", file=sys.stderr, flush=True))
    sys.stdout.write("\n")
    return 0
