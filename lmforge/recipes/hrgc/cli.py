"""`lmforge eval` and `lmforge generate` for HRGC checkpoints (and the plain baseline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmforge.cli_common import require_data
from lmforge.errors import LMForgeError


def add_eval_args(group) -> None:
    group.add_argument("--max-iterations", type=int, default=0, help="attempts per function at most (0 = the "
                       "model's max_refinement_iterations)")
    group.add_argument("--no-compile", action="store_true", help="skip the `go build` check of each answer")


def run_eval(args) -> int:
    from lmforge.recipes.hrgc.evaluate import evaluate_hrgc

    if args.max_iterations < 0:
        raise LMForgeError("--max-iterations must be >= 0")
    m = evaluate_hrgc(args.checkpoint, require_data(args, "a directory written by `lmforge data go-functions`"), split=args.split or "test", limit=args.limit or 0, device=args.device,
                      max_iterations=args.max_iterations or None, compile_check=not args.no_compile)
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"{m['data']}: {m['functions']} functions" + (f" ({m['skipped']} skipped: their spec does not fit the "
                                                         "model's contexts)" if m["skipped"] else ""))
    rows = [("parses", "parse_rate"), ("parses at the first attempt", "first_attempt_parse_rate"),
            ("compiles in its package", "compile_rate"), ("follows its plan", "plan_follow_rate"),
            ("code exact match", "code_exact"), ("plan exact match", "plan_exact")]
    for label, key in rows:
        if key in m:
            print(f"  {label:30s} {100 * m[key]:6.2f}%")
    for label, key in (("AST similarity", "ast_similarity"), ("plan token accuracy", "plan_token_accuracy"),
                       ("average iterations", "avg_iterations")):
        if key in m:
            print(f"  {label:30s} {m[key]:6.3f}")
    if "head_accuracy" in m:
        print(f"  {'refinement-head accuracy':30s} {100 * m['head_accuracy']:6.2f}% ({m['head_states']} labelled states)")
    return 0


def add_generate_args(group) -> None:
    group.add_argument("--spec", default=None, help="a Go doc comment and signature to implement (\\n for "
                       "newlines), run through plan -> code -> parse -> head -> refine")
    group.add_argument("--spec-file", default=None, help="read the spec from this file")
    group.add_argument("--max-iterations", type=int, default=0, help="attempts at most (0 = the model's "
                       "max_refinement_iterations)")


def run_generate(args) -> int:
    """`generate --spec`: an HRGC model's plan, each attempt with the validator's and the head's
    verdicts, and the iterations used."""
    from lmforge.infer.loading import load_for_inference
    from lmforge.recipes.hrgc.model import HRGC
    from lmforge.recipes.hrgc.writer import Writer

    if args.spec_file:
        try:
            spec = Path(args.spec_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise LMForgeError(f"cannot read --spec-file {args.spec_file}: {e}") from e
    elif args.spec is not None:
        spec = args.spec.replace("\\n", "\n").replace("\\t", "\t")
    else:
        raise LMForgeError(f"{args.checkpoint} is an HRGC model: give it a Go spec with --spec '// doc\\nfunc "
                           "name(args) results' or --spec-file FILE")
    if args.max_iterations < 0:
        raise LMForgeError("--max-iterations must be >= 0")
    model, tokenizer, _ = load_for_inference(args.checkpoint, args.device, args.precision, model_class=HRGC)
    writer = Writer(model, tokenizer, max_iterations=args.max_iterations or None, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    shown = []

    def show(kind: str, value) -> None:
        if kind == "plan":
            if model.config.hierarchical:
                print(f"plan: {value or '(empty)'}")
            return
        if any(a is value for a in shown):
            return
        shown.append(value)
        print(f"\n--- attempt {len(shown)} ---\n{value.code}")
        print(f"validator: {value.verdict or 'ok (parses' + (', follows the plan)' if model.config.hierarchical else ')')}")
        if value.head:
            probs = ", ".join(f"{n} {p:.2f}" for n, p in zip(("continue", "refine", "done"), value.head_probs))
            print(f"head: {value.head} ({probs}) -> {value.action}")
        elif value.action == "resample":
            print("-> resample")
        sys.stdout.flush()

    written = writer.write(spec, max_new_tokens=args.max_new_tokens, on_event=show)
    answer = written.answer
    print(f"\niterations used: {written.iterations} of {writer.max_iterations} "
          f"({written.stopped})")
    print(f"answer: attempt {written.attempts.index(answer) + 1} "
          f"({'parses' if answer.parses else 'does not parse'})")
    print(f"{spec.rstrip()} {answer.code}")
    return 0
