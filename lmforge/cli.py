"""`lmforge <verb>`: a thin command line over the Python API. It parses, loads config, and calls."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmforge.errors import LMForgeError

RECIPE_HELP = "a recipe name from configs/ (e.g. go_coder_tiny) or the path of a YAML file"
OVERRIDES_HELP = ("dotted overrides key=value, applied after the recipe, e.g. training.max_steps=200 "
                  "model.n_layer=4 (values are read as YAML: numbers, true/false, lists)")

PRECISION_HELP = ("weight precision for generation: auto = bf16 on GPUs and CPUs with bf16 units (it halves the "
                  "memory traffic that bounds decoding), else fp32")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is empty (None, []) or the help already states it."""

    def _get_help_string(self, action):
        if action.default in (None, "", [], argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _formatter(prog):
    return _HelpFormatter(prog, max_help_position=32)


# ---- train --------------------------------------------------------------------------------------
def _add_train(sub) -> None:
    from lmforge.config import list_recipes

    p = sub.add_parser("train", help="train a model from a recipe", formatter_class=_formatter,
                       description="Train a model. Resolved config, metrics.jsonl, TensorBoard logs and "
                                   "checkpoints go to OUT_DIR/NAME (defaults runs/<recipe name>). "
                                   f"Recipes: {', '.join(list_recipes())}. Every config key, with its "
                                   "value, is listed by --print-config; the README's table explains them.")
    p.add_argument("recipe", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                   help="continue the run from its latest checkpoint (or from CKPT): model, optimizer, "
                        "scaler, schedule, RNG and data position")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    import yaml

    from lmforge.config import load_config
    from lmforge.train import train

    if args.resume and "=" in args.resume and not Path(args.resume).exists():
        # `--resume training.max_steps=300`: argparse took the override for --resume's CKPT
        args.overrides.append(args.resume)
        args.resume = "latest"
    cfg = load_config(args.recipe, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    result = train(cfg, resume=args.resume or False)
    if result.is_main:
        ev = ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in result.eval_metrics.items())
        print(f"done: step {result.step} ({result.stopped}); train loss {result.train_loss:.4f}"
              + (f"; eval {ev}" if ev else ""))
        print(f"checkpoint: {result.last_checkpoint}" + (f" | best: {result.best_checkpoint}"
                                                          if result.best_checkpoint else ""))
        if result.stopped == "signal":
            print(f"resume with: lmforge train {args.recipe} {' '.join(args.overrides)} --resume".replace("  ", " "))
    return 0


# ---- eval ---------------------------------------------------------------------------------------
def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint",
                       formatter_class=_formatter,
                       description="Evaluate a checkpoint (a step directory, best/, or a run directory) on "
                                   "prepared shards (a `data prepare` directory) or on raw files.")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    p.add_argument("--data", required=True, help="a prepared data directory, or raw sources (dir/JSONL/text/parquet)")
    p.add_argument("--split", default=None, help="split of a prepared data directory (default val; test for "
                   "puzzle datasets)")
    p.add_argument("--include", action="append", default=[], help="glob for files in a raw source directory "
                   "(repeatable; default **/*.go)")
    p.add_argument("--text-field", default="text", help="text field of JSONL/parquet sources")
    p.add_argument("--seq-len", type=int, default=0, help="window length; 0 = the model's context")
    p.add_argument("--batch-size", type=int, default=None, help="windows (default 8) or puzzles (default 256) "
                   "per forward pass")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    p.add_argument("--limit", type=int, default=0, help="puzzle and HRGC models: score only the first N puzzles / "
                   "functions (0 = all)")
    p.add_argument("--max-iterations", type=int, default=0, help="HRGC: attempts per function at most (0 = the "
                   "model's max_refinement_iterations)")
    p.add_argument("--no-compile", action="store_true", help="HRGC: skip the `go build` check of each answer")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args) -> int:
    from lmforge.eval.lm import evaluate
    from lmforge.infer.puzzle import checkpoint_family, is_puzzle_checkpoint

    if is_puzzle_checkpoint(args.checkpoint):
        return _cmd_eval_puzzles(args)
    if checkpoint_family(args.checkpoint) == "hrgc":
        return _cmd_eval_hrgc(args)

    m = evaluate(args.checkpoint, args.data, split=args.split or "val", seq_len=args.seq_len,
                 batch_size=8 if args.batch_size is None else args.batch_size,
                 max_tokens=args.max_tokens, device=args.device, include=tuple(args.include),
                 text_field=args.text_field)
    if args.json:
        print(json.dumps(m))
    else:
        bpb = f"  bits/byte {m['bpb']:.4f}" if "bpb" in m else ""
        print(f"{m['data']}: {int(m['tokens']):,} tokens  loss {m['loss']:.4f}  perplexity {m['ppl']:.3f}{bpb}")
    return 0


def _cmd_eval_hrgc(args) -> int:
    from lmforge.eval.hrgc import evaluate_hrgc

    if args.limit < 0 or args.max_iterations < 0:
        raise LMForgeError("--limit and --max-iterations must be >= 0")
    m = evaluate_hrgc(args.checkpoint, args.data, split=args.split or "test", limit=args.limit, device=args.device,
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


def _cmd_eval_puzzles(args) -> int:
    from lmforge.eval.puzzles import evaluate_puzzles

    batch_size = 256 if args.batch_size is None else args.batch_size
    if batch_size < 1 or args.limit < 0:
        raise LMForgeError("--batch-size must be >= 1 and --limit >= 0")
    m = evaluate_puzzles(args.checkpoint, args.data, split=args.split or "test",
                         batch_size=batch_size, device=args.device, limit=args.limit)
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"{m['data']}: {m['puzzles']} puzzles  exact accuracy {100 * m['exact_accuracy']:.2f}%  "
          f"cell accuracy {100 * m['accuracy']:.2f}%  loss {m['loss']:.4f}")
    print(f"  Q head would halt after {m['steps']:.2f} steps on average; exact accuracy there "
          f"{100 * m['exact_accuracy_at_halt']:.2f}%")
    for name in ("singles", "easy", "medium", "hard"):
        if f"exact_accuracy_{name}" in m:
            print(f"  {name:8s} {round(m[f'share_{name}'] * m['puzzles']):5d} puzzles  exact "
                  f"{100 * m[f'exact_accuracy_{name}']:.2f}%")
    return 0


# ---- solve --------------------------------------------------------------------------------------
def _add_solve(sub) -> None:
    p = sub.add_parser("solve", help="solve a Sudoku with a trained HRM/TRM checkpoint", formatter_class=_formatter,
                       description="Run a puzzle model on one Sudoku (81 characters, row by row; '.' or '0' "
                                   "for blanks). Prints the grid it produced, whether it is a valid solution "
                                   "of the puzzle, and the reasoning steps (ACT segments) it used.")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    p.add_argument("--puzzle", required=True, help="81 characters: digits 1-9, '.' or '0' for blanks")
    p.add_argument("--max-steps", type=int, default=0, help="segments at most (0 = the model's halt_max_steps)")
    p.add_argument("--no-early-halt", action="store_true", help="run every segment instead of stopping "
                   "where the Q head halts")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.set_defaults(func=_cmd_solve)


def _cmd_solve(args) -> int:
    from lmforge.data.sudoku import pretty_grid
    from lmforge.infer.puzzle import solve_sudoku

    if args.max_steps < 0:
        raise LMForgeError("--max-steps must be >= 0")
    r = solve_sudoku(args.checkpoint, args.puzzle, max_steps=args.max_steps or None,
                     early_halt=not args.no_early_halt, device=args.device)
    print(pretty_grid(r["grid"]))
    verdict = "yes" if r["valid"] else f"no ({r['wrong_cells']} cells differ from the solution)"
    print(f"valid solution: {verdict}")
    print(f"steps used: {r['steps']} of {r['max_steps']}")
    if r["note"]:
        print(f"note: {r['note']}")
    return 0 if r["valid"] else 1


# ---- generate -----------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint, streaming", formatter_class=_formatter,
                       description="Continue a prompt with a checkpoint (a step directory, best/, or a run "
                                   "directory), streaming tokens to the terminal as they are sampled, with a "
                                   "KV cache. Sampling: temperature (0 = greedy), top-k, top-p, seed.")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    p.add_argument("--prompt", default="", help="text to continue; the two-character sequences \\n and \\t "
                   "become a newline and a tab. Use --prompt-file for prompts to be taken literally")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible samples")
    p.add_argument("--no-stop-at-eos", action="store_true", help="keep going past the end-of-document token")
    p.add_argument("--spec", default=None, help="HRGC models: a Go doc comment and signature to implement "
                   "(\\n for newlines), run through plan -> code -> parse -> head -> refine")
    p.add_argument("--spec-file", default=None, help="HRGC models: read the spec from this file")
    p.add_argument("--max-iterations", type=int, default=0, help="HRGC: attempts at most (0 = the model's "
                   "max_refinement_iterations)")
    _add_inference_device(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from pathlib import Path

    from lmforge.infer.generate import generate_text
    from lmforge.infer.loading import load_for_inference

    from lmforge.infer.puzzle import checkpoint_family

    if args.max_new_tokens < 1:
        raise LMForgeError("--max-new-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise LMForgeError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    if args.spec is not None or args.spec_file or checkpoint_family(args.checkpoint) == "hrgc":
        return _generate_go_function(args)
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")  # shells pass "\n" literally
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise LMForgeError(f"cannot read --prompt-file {args.prompt_file}: {e}") from e
    model, tokenizer, _ = load_for_inference(args.checkpoint, args.device, args.precision)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    generate_text(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_at_eos=not args.no_stop_at_eos,
                  stream=stream)
    sys.stdout.write("\n")
    return 0


def _generate_go_function(args) -> int:
    """`generate --spec`: an HRGC model's plan, each attempt with the validator's and the head's
    verdicts, and the iterations used."""
    from pathlib import Path

    from lmforge.infer.hrgc import Writer
    from lmforge.infer.loading import load_for_inference

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
    model, tokenizer, _ = load_for_inference(args.checkpoint, args.device, args.precision, family="hrgc")
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


# ---- plot ---------------------------------------------------------------------------------------
def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="PNG of train/val loss and learning rate", formatter_class=_formatter)
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output image: .png, .svg or .pdf (default RUN_DIR/loss.png)")
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args) -> int:
    from lmforge.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


# ---- bench --------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="training throughput (tokens/s, MFU, memory) of a recipe's model",
                       formatter_class=_formatter,
                       description="Time training steps of a recipe's model on random tokens through the "
                                   "lmforge loop; optionally the same GPT-2 config in transformers + AdamW.")
    p.add_argument("recipe", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator warm-up)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary when the recipe takes it from a tokenizer")
    p.add_argument("--compare-transformers", action="store_true",
                   help="also time transformers.GPT2LMHeadModel with a plain AdamW loop (gpt2 flavor only), "
                        "each system in its own process")
    p.add_argument("--same-allocator", action="store_true",
                   help="with --compare-transformers on CPU: run transformers with lmforge's C-allocator setting "
                        "too (isolates the model code; by default it runs with the allocator's defaults)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    from lmforge.bench import run_bench

    results = run_bench(args.recipe, args.overrides, steps=args.steps, warmup=args.warmup,
                        vocab_size=args.vocab_size, compare_transformers=args.compare_transformers,
                        same_allocator=args.same_allocator)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


# ---- quickstart ---------------------------------------------------------------------------------
def _add_quickstart(sub) -> None:
    p = sub.add_parser("quickstart", help="the whole job on real code found on this machine",
                       formatter_class=_formatter,
                       description="Find real code (the Go standard library of a local Go toolchain, else "
                                   "the Python standard library), train a tokenizer, prepare data, train "
                                   "go_coder_tiny, evaluate against a unigram baseline, plot, and sample.")
    p.add_argument("--data", default=None, help="use this source directory instead of the one found")
    p.add_argument("--include", action="append", default=[], help="glob for --data files (default by language)")
    p.add_argument("--out", default="lmforge_quickstart", help="working directory for every artifact")
    p.add_argument("--minutes", type=float, default=6.0, help="training time budget (the whole job adds ~1 min)")
    p.add_argument("--max-bytes", type=int, default=24_000_000,
                   help="cap on the text the tokenizer is trained on (bytes); the data stage tokenizes the whole corpus")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary size")
    p.add_argument("overrides", nargs="*", help="overrides for the go_coder_tiny recipe, " + OVERRIDES_HELP)
    p.set_defaults(func=_cmd_quickstart)


def _cmd_quickstart(args) -> int:
    from lmforge.quickstart import quickstart

    quickstart(data=args.data, include=tuple(args.include), out=args.out, minutes=args.minutes,
               max_bytes=args.max_bytes, vocab_size=args.vocab_size, overrides=args.overrides)
    return 0


# ---- serve / chat -------------------------------------------------------------------------------
def _add_inference_device(p) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help=PRECISION_HELP)


def _add_sampling(p, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1.0 = off")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible replies")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API over a checkpoint", formatter_class=_formatter,
                       description="Serve a gpt-family checkpoint with OpenAI's API: GET /v1/models, POST "
                                   "/v1/completions, POST /v1/chat/completions (streaming, stop, seed, n, tools), "
                                   "GET /health. Concurrent requests are batched. Any OpenAI client works: "
                                   "base_url=http://HOST:PORT/v1.")
    p.add_argument("checkpoint", help="a checkpoint, best/, or a run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: the "
                   "LMFORGE_API_KEY environment variable, else no key)")
    p.add_argument("--model-name", default=None,
                   help="model id clients use (default RUN-CHECKPOINT, e.g. go_coder_tiny-best)")
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together; more wait in a queue")
    _add_inference_device(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs each request)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    import os

    from lmforge.serve.server import serve

    serve(args.checkpoint, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LMFORGE_API_KEY"),
          model_id=args.model_name, max_batch_size=args.max_batch_size, device=args.device, precision=args.precision,
          log_level=args.log_level)
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with a checkpoint in the terminal", formatter_class=_formatter,
                       description="An interactive chat in the model's chat template, streaming each reply. "
                                   "Type /reset to forget the conversation, /exit or Ctrl-D to quit, Ctrl-C to "
                                   "stop a reply. Reads lines from a pipe too.")
    p.add_argument("checkpoint", help="a checkpoint, best/, or a run directory")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    _add_sampling(p, max_tokens=512)
    _add_inference_device(p)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(args) -> int:
    from lmforge.infer.terminal_chat import chat

    chat(args.checkpoint, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
         top_p=args.top_p, top_k=args.top_k, seed=args.seed, device=args.device, precision=args.precision)
    return 0


# ---- export -------------------------------------------------------------------------------------
def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint to transformers (hf) or llama.cpp (gguf)",
                       formatter_class=_formatter,
                       description="Write a gpt-family checkpoint in another tool's format. --format hf: a "
                                   "transformers model directory (GPT2LMHeadModel or LlamaForCausalLM + tokenizer "
                                   "files) that AutoModelForCausalLM.from_pretrained(OUT) loads. --format gguf: one "
                                   "GGUF file (weights, tokenizer, chat template) for llama.cpp and its bindings. "
                                   "HRM/TRM and mHC models have no such format: their lmforge checkpoint is the "
                                   "export.")
    p.add_argument("checkpoint", help="a checkpoint, best/, or a run directory")
    p.add_argument("--format", required=True, choices=["hf", "gguf"], help="target format")
    p.add_argument("--out", required=True, help="output directory (hf) or file (gguf)")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "q8_0"],
                   help="gguf only: weight type (norms and biases stay f32)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    if args.format == "gguf":
        from lmforge.export.gguf import export_gguf

        out = export_gguf(args.checkpoint, args.out, dtype=args.dtype, overwrite=args.overwrite)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.dtype}): load it with "
              f"llama_cpp.Llama(model_path={str(out)!r}) or llama.cpp's llama-cli -m {out}")
        return 0
    if args.dtype != "f32":
        raise LMForgeError("--dtype is for --format gguf; an hf export keeps the checkpoint's float32 weights")
    from lmforge.export import export_hf

    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


# ---- checkpoint ---------------------------------------------------------------------------------
def _add_checkpoint(sub) -> None:
    p = sub.add_parser("checkpoint", help="maintain training checkpoints (convert older ones)",
                       formatter_class=_formatter)
    verbs = p.add_subparsers(dest="checkpoint_verb", metavar="VERB")
    verbs.required = True
    c = verbs.add_parser("convert", formatter_class=_formatter,
                         help="rewrite checkpoints of older lmforge versions without pickle files",
                         description="lmforge <= 0.1 saved a checkpoint's optimizer and random-number state as "
                                     "pickles (optimizer.pt, rng_state.pt). This reads them with PyTorch's "
                                     "restricted loader (tensors and plain data only; anything that could run "
                                     "code is refused) and rewrites them as optimizer.safetensors and "
                                     "rng_state.safetensors. Resume reads either form; converted checkpoints "
                                     "are the ones to share.")
    c.add_argument("paths", nargs="+", metavar="PATH",
                   help="a step checkpoint, or a run directory / its checkpoints/ (every step checkpoint in it)")
    c.set_defaults(func=_cmd_checkpoint_convert)


def _cmd_checkpoint_convert(args) -> int:
    from lmforge.train.checkpoint import STATE_FILE, convert_legacy, list_checkpoints

    for raw in args.paths:
        path = Path(raw)
        if (path / STATE_FILE).is_file():
            found = [path]
        else:
            found = [p for root in (path / "checkpoints", path) for _, p in list_checkpoints(root)]
        if not found:
            raise LMForgeError(f"{path} holds no training checkpoint (a directory with {STATE_FILE}); pass "
                               "runs/NAME, runs/NAME/checkpoints or runs/NAME/checkpoints/step-NNNNNN")
        for ckpt in found:
            done = convert_legacy(ckpt)
            print(f"{ckpt}: " + (", ".join(done) if done else "already in the current format"))
    return 0


# ---- entry point ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from lmforge import __version__
    from lmforge.cli_data import register as register_data

    parser = argparse.ArgumentParser(prog="lmforge", formatter_class=_formatter,
                                     description="Train small language and reasoning models from scratch.")
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    _add_quickstart(sub)
    register_data(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_generate(sub)
    _add_solve(sub)
    _add_plot(sub)
    _add_bench(sub)
    _add_export(sub)
    _add_checkpoint(sub)
    _add_serve(sub)
    _add_chat(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides given after an option (`train RECIPE --resume training.lr=1e-4`) are
    # overrides too: argparse alone takes the positional list only before the first option.
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra and (len(late) < len(extra) or not hasattr(args, "overrides")):
        parser.parse_args(argv)  # reports the unrecognised arguments and exits, as argparse does
    if late:
        args.overrides = list(args.overrides or []) + late
    try:
        return int(args.func(args) or 0)
    except LMForgeError as e:
        print(f"lmforge: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or a permission problem that no verb reported itself
        import errno

        from lmforge.files import write_fault

        if e.errno in (errno.EACCES, errno.EPERM) and e.filename:  # a read as likely as a write
            print(f"lmforge: error: {e.strerror or 'permission denied'}: {e.filename}: check its permissions "
                  "and run the command again", file=sys.stderr)
            return 2
        fault = write_fault(e, Path(e.filename or "."), fix="and run the command again")
        if fault is None:
            raise
        print(f"lmforge: error: {fault}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
