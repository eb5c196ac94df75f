"""`lmforge <verb>`: a thin command line over the Python API. It parses, loads config, and calls."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lmforge.cli_common import (
    SHARED_OPTIONS,
    add_device_args,
    add_quantize_arg,
    add_sampling_args,
    formatter,
)
from lmforge.errors import LMForgeError

RECIPE_HELP = "a recipe name from configs/ (e.g. go_coder_tiny) or the path of a YAML file"
OVERRIDES_HELP = ("dotted overrides key=value, applied after the recipe, e.g. training.max_steps=200 "
                  "model.n_layer=4 (values are read as YAML: numbers, true/false, lists)")

# ---- train --------------------------------------------------------------------------------------
def _add_train(sub) -> None:
    from lmforge.config import list_recipes

    p = sub.add_parser("train", help="train a model from a recipe", formatter_class=formatter,
                       description="Train a model. Resolved config, metrics.jsonl, TensorBoard logs and "
                                   "checkpoints go to OUT_DIR/NAME (defaults runs/<recipe name>). "
                                   f"Recipes: {', '.join(list_recipes())}. Training kinds (a recipe's `kind`, "
                                   f"default the kind that trains its model.family): {_kinds_summary()}. Every "
                                   "config key, with its value, is listed by --print-config; the README's table "
                                   "explains them.")
    p.add_argument("recipe", help=RECIPE_HELP + "; or, for a kind's defaults, its first override (`lmforge train "
                                  "kind=dpo training.init_from=runs/sft ...`) (not needed with seed 004's --stage S)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                   help="continue the run from its latest checkpoint (or from CKPT): model, optimizer, "
                        "scaler, schedule, RNG and data position")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    from lmforge.staged_guide import add_help as add_guide_help

    add_guide_help(p)  # documented here; main() translates them before parsing
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    import yaml

    from lmforge.config import load_config
    from lmforge.train import train

    if args.resume and "=" in args.resume and not Path(args.resume).exists():
        # `--resume training.max_steps=300`: argparse took the override for --resume's CKPT
        args.overrides.append(args.resume)
        args.resume = "latest"
    # `lmforge train kind=dpo ...`: no recipe, a kind's defaults and the overrides
    key = args.recipe.split("=", 1)[0]  # a path that does not exist (runs/lr=3e-4/x.yaml) stays a recipe
    bare = ("=" in args.recipe and not Path(args.recipe).exists() and "/" not in key
            and not args.recipe.endswith((".yaml", ".yml")))
    cfg = load_config(None if bare else args.recipe, [args.recipe, *args.overrides] if bare else args.overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    result = train(cfg, resume=args.resume or False)
    if result.is_main:
        ev = ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in result.eval_metrics.items())
        loss = "" if math.isnan(result.train_loss) else f"; train loss {result.train_loss:.4f}"  # nan: no step ran
        print(f"done: step {result.step} ({result.stopped}){loss}" + (f"; eval {ev}" if ev else ""))
        print(f"checkpoint: {result.last_checkpoint}" + (f" | best: {result.best_checkpoint}"
                                                          if result.best_checkpoint else ""))
        if result.stopped == "signal":
            print(f"resume with: lmforge train {args.recipe} {' '.join(args.overrides)} --resume".replace("  ", " "))
    # Stopped by a signal, checkpoint saved: the shell's status for that signal (143 for SIGTERM, 130 for
    # Ctrl-C), not success, so that a scheduler or job controller restarts the unfinished run (with --resume).
    # Process 0's only: under torchrun the first process to exit non-zero has the others stopped, which could
    # cut process 0's last lines (all have saved by now)
    if result.stopped == "signal" and result.signal and result.is_main:
        sys.stdout.flush()
        return 128 + result.signal
    return 0


# ---- eval and generate: common options, then each training kind's --------------------------------
# Option sets several kinds share (named in their RecipeSpec's CLIOptions.uses): lmforge.cli_common.SHARED_OPTIONS.
# What makes two declarations of one option string the same option, which kinds may then share.
_SAME_OPTION = ("dest", "nargs", "const", "default", "type", "choices", "required", "metavar")


class _KindGroup:
    """The argument group a kind's ``CLIOptions.add`` is handed: an option string that another kind (or a
    shared set) has already added is shared when it is the same option (same action, dest, type, default,
    choices ...; the first help text is shown), and refused with an ``LMForgeError`` naming both kinds when
    it is not, instead of argparse's bare conflict error, which stopped every command, ``--help`` included."""

    def __init__(self, parser, group, title: str, names: set[str], owners: dict[str, set[str]],
                 added_by: dict[str, str], verb: str):
        self._parser, self._group, self._title, self._names = parser, group, title, names
        self._owners, self._added_by, self._verb = owners, added_by, verb

    def add_argument(self, *args, **kwargs):
        taken = {o: self._parser._option_string_actions[o] for o in args
                 if o in self._parser._option_string_actions}
        if not taken:
            action = self._group.add_argument(*args, **kwargs)
            for option in action.option_strings:
                self._owners.setdefault(option, set()).update(self._names)
                self._added_by[option] = self._title
            return action
        option, existing = next(iter(taken.items()))
        scratch = argparse.ArgumentParser(add_help=False)
        mine = scratch.add_argument(*args, **kwargs)
        shared_by = self._added_by.get(option)
        same = (shared_by is not None and type(mine) is type(existing) and set(args) <= set(existing.option_strings)
                and all(getattr(mine, a) == getattr(existing, a) for a in _SAME_OPTION))
        if not same:
            them = shared_by or f"`lmforge {self._verb}` itself (for every kind)"
            differ = [a for a in ("action", *_SAME_OPTION) if
                      (type(mine) is not type(existing) if a == "action" else getattr(mine, a) != getattr(existing, a))]
            what = (f"differently ({', '.join(differ)})" if differ and shared_by else
                    "differently (other option strings)" if shared_by else "again")
            raise LMForgeError(f"{self._title} adds {option} to `lmforge {self._verb}`, which {them} adds "
                               f"{what}: two kinds may share an option only when they declare the same option "
                               f"({', '.join(('action', *_SAME_OPTION))} alike). Rename the kind's option (e.g. "
                               f"--{min(self._names)}-{option.lstrip('-')}), or declare it exactly as {them} "
                               "does; see docs/adding-a-recipe.md")
        for o in existing.option_strings:  # the same option: it now belongs to this kind too
            self._owners.setdefault(o, set()).update(self._names)
        return existing

    def __getattr__(self, name):  # add_mutually_exclusive_group, title ...: the real group's
        return getattr(self._group, name)


def _add_kind_options(p, verb: str) -> None:
    """Each kind's options for ``verb`` in a group titled with the kind, and the option sets kinds share;
    records which kinds each option string belongs to (checked by ``_check_kind_options``)."""
    from lmforge.recipes import kinds

    owners: dict[str, set[str]] = {}
    added_by: dict[str, str] = {}  # option string -> who added it first, for the error of a clash

    def add(title: str, who: str, names: set[str], adder) -> None:
        group = _KindGroup(p, p.add_argument_group(title), who, names, owners, added_by, verb)
        try:
            adder(group)
        except argparse.ArgumentError as e:  # a clash _KindGroup does not see (a mutually exclusive group's)
            raise LMForgeError(f"{who} adds an option to `lmforge {verb}` that clashes with another's: {e}. "
                               "Rename it; see docs/adding-a-recipe.md") from e

    specs = [s for s in kinds() if getattr(s, verb) is not None]
    for shared, adder in SHARED_OPTIONS.items():
        users = {s.name for s in specs if shared in getattr(s, verb).uses}
        if users:
            add(f"{shared} (kinds: {', '.join(sorted(users))})", f"the shared option set {shared!r} (kinds "
                f"{', '.join(sorted(users))})", users, adder)
    for s in specs:
        add(f"kind {s.name}: {getattr(s, verb).help}", f"kind {s.name!r}", {s.name}, getattr(s, verb).add)
    p.set_defaults(kind_options=owners, verb_name=verb)


def _kinds_summary() -> str:
    from lmforge.recipes import kinds

    return "; ".join(f"{s.name} (families {', '.join(s.family_names())})" for s in kinds())


def _checkpoint_kind(checkpoint: str):
    from lmforge.checkpoint import checkpoint_family
    from lmforge.recipes import kind_of_family

    family = checkpoint_family(checkpoint, strict=True)  # an error says what is wrong with the path
    return family, kind_of_family(family)


def _pick_kind(args, argv: list[str], family: str, owner) -> object:
    """The kind that runs the verb: the family's own, or another kind that trains the family when options
    only that kind has are given (``eval --tool-calls`` is the sft kind's, for gpt checkpoints). An option
    no kind able to run it has is an error (it would be ignored), naming the kinds it belongs to."""
    from lmforge.recipes import kinds

    able = [owner] + [s for s in kinds() if s is not owner and family in s.family_names()
                      and getattr(s, args.verb_name) is not None]
    given = [(token.split("=", 1)[0], args.kind_options.get(token.split("=", 1)[0])) for token in argv]
    given = [(option, owners) for option, owners in given if owners]
    for spec in able:
        if all(spec.name in owners for _, owners in given):
            return spec
    names = {s.name for s in able}
    for option, owners in given:
        if not owners & names:
            raise LMForgeError(f"{option} is for {', '.join(sorted(owners))} checkpoints; {args.checkpoint} holds a "
                               f"{family!r} model (kind {owner.name}). See `lmforge {args.verb_name} --help`.")
    mixed = ", ".join(f"{option} ({'/'.join(sorted(owners & names))})" for option, owners in given)
    raise LMForgeError(f"these options belong to different kinds and cannot be combined: {mixed}. See "
                       f"`lmforge {args.verb_name} --help`.")


def _run_for_kind(args) -> int:
    family, owner = _checkpoint_kind(args.checkpoint)
    spec = _pick_kind(args, args.argv, family, owner)
    options = getattr(spec, args.verb_name)
    if options is None:
        raise LMForgeError(f"`lmforge {args.verb_name}` does not apply to {family!r} models (kind {spec.name})")
    return int(options.run(args) or 0)


def _kinds_text(verb: str) -> str:
    from lmforge.recipes import kinds

    return " ".join(f"{s.name} ({', '.join(s.family_names())}): {getattr(s, verb).help}."
                    for s in kinds() if getattr(s, verb) is not None)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="score a checkpoint on held-out data (what is scored depends on its kind)",
                       formatter_class=formatter, allow_abbrev=False,
                       description="Evaluate a checkpoint (a step directory, best/, or a run directory). What is "
                                   "scored depends on the training kind of its model; options under a kind's "
                                   f"heading apply to that kind only. {_kinds_text('eval')} With --tasks, "
                                   "language models (gpt family) run lm-evaluation-harness tasks instead "
                                   "(docs/eval.md).")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    p.add_argument("--data", default=None, help="held-out data: a prepared directory of the checkpoint's kind, or "
                   "raw sources (language models) / a Sudoku CSV (puzzle models)")
    p.add_argument("--split", default=None, help="split of the data directory (default: val for language models, "
                   "test otherwise)")
    p.add_argument("--limit", type=int, default=0, help="score only the first N items: tokens (language models), "
                   "puzzles, functions, examples of each task (--tasks) (0 = all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    harness = p.add_argument_group("lm-evaluation-harness (language models; pip install 'lmforge[eval]')")
    harness.add_argument("--tasks", default=None, metavar="NAME[,NAME]",
                         help="run these lm-evaluation-harness tasks, groups or tags (hellaswag, arc_easy, piqa, "
                              "lambada_openai ...; `lm-eval ls tasks` lists them) in this process, and print "
                              "their table; the results JSON goes to RUN_DIR/eval/. Also takes --limit, "
                              "--batch-size (rows of the model's context per forward; default 8 on CPUs, 32 "
                              "on GPUs), --device and --json")
    harness.add_argument("--num-fewshot", type=int, default=None, metavar="N",
                         help="few-shot examples in each context (default: each task's own, else 0)")
    harness.add_argument("--include-path", action="append", default=[], metavar="DIR",
                         help="a directory of task YAML files of your own (repeatable)")
    harness.add_argument("--no-cache", action="store_true",
                         help="do not reuse or store model answers (RUN_DIR/eval/lm_eval_cache/)")
    harness.add_argument("--log-samples", action="store_true",
                         help="keep every sample's prompt, answers and scores in the results JSON file under "
                              "RUN_DIR/eval/ (--json prints the results without them)")
    harness.add_argument("--confirm-run-unsafe-code", action="store_true",
                         help="allow tasks that execute the model's code (HumanEval, MBPP)")
    _add_kind_options(p, "eval")
    p.set_defaults(func=_cmd_eval)


HARNESS_OPTIONS = ("--num-fewshot", "--include-path", "--no-cache", "--log-samples", "--confirm-run-unsafe-code")
# Kind options that name the held-out data themselves: --data beside them would be ignored.
DATA_OPTIONS = ("--tool-calls", "--preferences", "--prompts")


def _cmd_eval(args) -> int:
    """`lmforge eval`: the checkpoint kind's own evaluation, or lm-evaluation-harness tasks (--tasks)."""
    given = {token.split("=", 1)[0] for token in args.argv if token.startswith("--")}
    if (args.limit or 0) < 0:  # for every kind: a slice [:-N] would silently drop the last N items
        raise LMForgeError(f"--limit must be >= 0 (0 = all), got {args.limit}")
    if args.tasks is None:
        stray = [o for o in HARNESS_OPTIONS if o in given]
        if stray:
            raise LMForgeError(f"{', '.join(stray)} go with --tasks (lm-evaluation-harness tasks)")
        own = [o for o in DATA_OPTIONS if o in given]
        if "--data" in given and own:
            raise LMForgeError(f"--data cannot be combined with {', '.join(own)}: {own[0]} names the held-out data "
                               "itself; drop --data")
        return _run_for_kind(args)
    other = sorted(o for o in given if o in ("--data", "--split")
                   or (o in args.kind_options and o != "--batch-size"))
    if other:
        raise LMForgeError(f"{', '.join(other)} cannot be combined with --tasks: --tasks runs lm-evaluation-harness "
                           "tasks on their own data (see `lmforge eval --help`)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise LMForgeError("--num-fewshot must be >= 0")
    from lmforge.eval.harness import run_tasks

    out = run_tasks(args.checkpoint, args.tasks, limit=args.limit or None, device=args.device,
                    batch_size=args.batch_size, num_fewshot=args.num_fewshot, include_path=args.include_path,
                    use_cache=not args.no_cache, log_samples=args.log_samples,
                    confirm_run_unsafe_code=args.confirm_run_unsafe_code)
    if args.json:
        print(json.dumps({k: v for k, v in out.results.items() if k != "samples"}, indent=2))
    else:
        print(out.table)
        computed = ", ".join(f"{n} {kind}" for kind, n in out.results["lmforge"]["computed_requests"].items() if n)
        cache = out.results["lmforge"]["cache"]
        print(f"results: {out.path}\nmodel answers computed: {computed or 'none'}"
              + (f" (the others from the cache {cache})" if cache else ""))
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run a checkpoint on one input: continue text, write a Go function, "
                       "solve a Sudoku", formatter_class=formatter, allow_abbrev=False,
                       description="Run a checkpoint (a step directory, best/, or a run directory) on one input; "
                                   "what it takes depends on the training kind of its model, and options under a "
                                   f"kind's heading apply to that kind only. {_kinds_text('generate')}")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    add_device_args(p, precision=False)
    _add_kind_options(p, "generate")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    if getattr(args, "max_new_tokens", 1) < 1:
        raise LMForgeError("--max-new-tokens must be >= 1")
    if hasattr(args, "temperature") and (args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0):
        raise LMForgeError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    return _run_for_kind(args)


# ---- plot ---------------------------------------------------------------------------------------
def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="PNG of train/val loss and learning rate", formatter_class=formatter)
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
                       formatter_class=formatter,
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
                       formatter_class=formatter,
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

    done = quickstart(data=args.data, include=tuple(args.include), out=args.out, minutes=args.minutes,
                      max_bytes=args.max_bytes, vocab_size=args.vocab_size, overrides=args.overrides)
    return 128 + done["signal"] if done.get("signal") else 0  # stopped by a signal: its status, as train's


# ---- serve / chat -------------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API over a checkpoint", formatter_class=formatter,
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
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per step between decode "
                   "steps: a long prompt delays running replies by one chunk's forward")
    p.add_argument("--prefix-cache", type=int, default=4, help="prompts whose keys and values are kept for prompts "
                   "that start the same way (0 = off)")
    p.add_argument("--trace-steps", default=None, metavar="FILE", help="write one JSON line per engine step (its "
                   "prefill and decode seconds, prompt tokens, rows) to FILE, to find where latency goes")
    add_device_args(p)
    add_quantize_arg(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs each request)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    import os

    from lmforge.serve.server import serve

    serve(args.checkpoint, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LMFORGE_API_KEY"),
          model_id=args.model_name, max_batch_size=args.max_batch_size, device=args.device, precision=args.precision,
          log_level=args.log_level, quantize=args.quantize, prefill_chunk=args.prefill_chunk,
          prefix_cache=args.prefix_cache, trace_steps=args.trace_steps)
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with a checkpoint in the terminal", formatter_class=formatter,
                       description="An interactive chat in the model's chat template, streaming each reply. "
                                   "Type /reset to forget the conversation, /exit or Ctrl-D to quit, Ctrl-C to "
                                   "stop a reply. Reads lines from a pipe too.")
    p.add_argument("checkpoint", help="a checkpoint, best/, or a run directory")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_sampling_args(p, max_new_tokens=512)
    p.add_argument("--max-tokens", type=int, dest="max_new_tokens", help=argparse.SUPPRESS)  # lmforge 0.1
    add_device_args(p)
    add_quantize_arg(p)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(args) -> int:
    from lmforge.infer.terminal_chat import chat

    if args.max_new_tokens < 1:
        raise LMForgeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}: pass the longest reply in "
                           "tokens, e.g. 512")
    chat(args.checkpoint, system=args.system, max_tokens=args.max_new_tokens, temperature=args.temperature,
         top_p=args.top_p, top_k=args.top_k, seed=args.seed, device=args.device, precision=args.precision,
         quantize=args.quantize)
    return 0


# ---- export -------------------------------------------------------------------------------------
def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint to transformers (hf) or llama.cpp (gguf)",
                       formatter_class=formatter,
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
    p = sub.add_parser("checkpoint", help="maintain training checkpoints (verify, convert, consolidate shards)",
                       formatter_class=formatter)
    verbs = p.add_subparsers(dest="checkpoint_verb", metavar="VERB")
    verbs.required = True
    c = verbs.add_parser("convert", formatter_class=formatter,
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
    c = verbs.add_parser("consolidate", formatter_class=formatter,
                         help="rewrite sharded checkpoints (training.fsdp_checkpoint=sharded) as ordinary ones",
                         description="A run under training.parallel=fsdp/hsdp writes each step checkpoint as "
                                     "shards, one safetensors file per process (shards/, shards.json). Every "
                                     "lmforge verb reads them as they are; this rewrites one as the ordinary "
                                     "directory (model.safetensors, optimizer.safetensors with the full optimizer "
                                     "state, the rest copied), which resumes anywhere and which tools outside "
                                     "lmforge read. Needs the memory of the full training state on this machine.")
    c.add_argument("checkpoint", metavar="DIR",
                   help="a sharded step checkpoint, or a run directory / its checkpoints/ (every sharded one in it)")
    c.add_argument("out", metavar="OUT", nargs="?", default=None,
                   help="write the ordinary checkpoint here (a new directory) instead of replacing DIR in place")
    c.set_defaults(func=_cmd_checkpoint_consolidate)
    c = verbs.add_parser("verify", formatter_class=formatter,
                         help="check checkpoints against the checksums written with them",
                         description="Every checkpoint lmforge writes records the sha256 of its safetensors files "
                                     "(weights, optimizer state, shards) in checksums.json. This reads each file "
                                     "again and names any whose bytes changed since (a failing disk, a copy cut "
                                     "short) or that is missing, and a step checkpoint whose checksums.json "
                                     "is gone; a resume does the same check before it loads, and loading a "
                                     "model checks its weights. Exit status 1 when one is damaged. Checkpoints "
                                     "of an lmforge without checksums are reported as unchecked.")
    c.add_argument("paths", nargs="+", metavar="PATH",
                   help="a checkpoint (step-NNNNNN, best/), or a run directory / its checkpoints/ (every one in it)")
    c.set_defaults(func=_cmd_checkpoint_verify)


def _cmd_checkpoint_verify(args) -> int:
    from lmforge.checkpoint import CHECKSUMS_FILE, REPLACED, has_checksums, list_checkpoints, settled_checksum_mismatch

    damaged = 0
    for raw in args.paths:
        path = Path(raw)
        if not path.is_dir():
            raise LMForgeError(f"{path} {'is a file' if path.exists() else 'does not exist'}: pass a checkpoint "
                               "directory (runs/NAME/checkpoints/step-NNNNNN, .../best) or a run directory")
        if any(path.glob("*.safetensors")) or (path / CHECKSUMS_FILE).is_file() or (path / "shards").is_dir():
            found = [path]
        else:
            roots = (path / "checkpoints", path)
            found = [p for root in roots for _, p in list_checkpoints(root)]
            found += [root / "best" for root in roots if (root / "best").is_dir()]
        if not found:
            raise LMForgeError(f"{path} holds no checkpoint: pass runs/NAME, runs/NAME/checkpoints or a checkpoint")
        for ckpt in found:
            if not has_checksums(ckpt):
                print(f"{ckpt}: unchecked (no {CHECKSUMS_FILE}: written by an lmforge without checksums)")
                continue
            bad = settled_checksum_mismatch(ckpt)
            damaged += bad is not None and bad != REPLACED
            print(f"{ckpt}: " + ("ok" if bad is None else "replaced or removed while verified (by a run that "
                                 "writes there): verify again" if bad == REPLACED else f"DAMAGED: {bad}"))
    return 1 if damaged else 0


def _cmd_checkpoint_convert(args) -> int:
    from lmforge.checkpoint import STATE_FILE, convert_legacy, list_checkpoints

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


def _cmd_checkpoint_consolidate(args) -> int:
    from lmforge.checkpoint import STATE_FILE, WEIGHTS_FILE, consolidate, is_sharded, list_checkpoints

    path = Path(args.checkpoint)
    if any((path / f).is_file() for f in (STATE_FILE, WEIGHTS_FILE)) or is_sharded(path) or not path.is_dir():
        found = [path]  # consolidate says what is wrong with anything else
    else:
        found = [p for root in (path / "checkpoints", path) for _, p in list_checkpoints(root) if is_sharded(p)]
        if not found:
            raise LMForgeError(f"{path} holds no sharded checkpoint (a directory with shards.json); pass "
                               "runs/NAME, runs/NAME/checkpoints or runs/NAME/checkpoints/step-NNNNNN")
    if args.out and len(found) > 1:
        raise LMForgeError(f"{path} holds {len(found)} sharded checkpoints; OUT is for one: pass one step checkpoint")
    for ckpt in found:
        print(f"{ckpt}: consolidated into {consolidate(ckpt, Path(args.out) if args.out else None)}")
    return 0


# ---- entry point ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from lmforge import __version__
    from lmforge.cli_data import register as register_data

    parser = argparse.ArgumentParser(prog="lmforge", formatter_class=formatter,
                                     description="Train small language and reasoning models from scratch.")
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    _add_quickstart(sub)
    register_data(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_generate(sub)
    from lmforge.recipes import kinds

    for spec in kinds():
        if spec.add_verbs is not None:
            spec.add_verbs(sub)  # e.g. `lmforge solve` (puzzles)
    _add_plot(sub)
    _add_bench(sub)
    _add_export(sub)
    _add_checkpoint(sub)
    from lmforge.pipeline.cli import register as register_pipeline

    register_pipeline(sub)  # `lmforge pipeline run|status|serve FILE`
    _add_serve(sub)
    _add_chat(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # anywhere, the imports of the first seconds included
        print("lmforge: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()  # reads every kind's spec: a plug-in's mistake shows here, for every verb
    except LMForgeError as e:
        print(f"lmforge: error: {e}", file=sys.stderr)
        return 2
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["train"]:  # seed 004's `scripts/train.py --stage ...` flags -> a recipe and overrides
        from lmforge.staged_guide import translate_train_argv

        try:
            argv = translate_train_argv(list(argv))
        except LMForgeError as e:
            print(f"lmforge: error: {e}", file=sys.stderr)
            return 2
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides given after an option (`train RECIPE --resume training.lr=1e-4`) are
    # overrides too: argparse alone takes the positional list only before the first option.
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra and (len(late) < len(extra) or not hasattr(args, "overrides")):
        parser.parse_args(argv)  # reports the unrecognised arguments and exits, as argparse does
    if late:
        args.overrides = list(args.overrides or []) + late
    args.argv = list(sys.argv[1:] if argv is None else argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
