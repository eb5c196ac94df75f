"""`lmforge pipeline run|status|serve FILE`: argument wiring over ``lmforge.pipeline``."""

from __future__ import annotations

import json

from lmforge.cli_common import formatter

FILE_HELP = ("a pipeline YAML file, or the name of one in configs/pipelines/ (e.g. code_assistant_tiny)")


def _common(p) -> None:
    p.add_argument("file", help=FILE_HELP)
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="set one of the file's vars (repeatable), e.g. --var tinystories=/data/tinystories")
    p.add_argument("--out-dir", default=None, help="write the stages here instead of the file's out_dir")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pipeline", help="run a staged pipeline (tokenizer -> pretraining -> fine-tuning -> eval -> export -> serve)",
        formatter_class=formatter,
        description="Run the stages of a pipeline file in order; each training stage is an ordinary run in "
                    "OUT_DIR/STAGE. A stage whose config and inputs (init weights, data, tokenizer: by content "
                    "hash) are unchanged since it finished is skipped; a changed one runs again (its earlier "
                    "output moved aside to OUT_DIR/STAGE.old-N) and so do the stages after it; an interrupted "
                    "training stage resumes from its last checkpoint. The format: docs/pipeline.md.")
    verbs = p.add_subparsers(dest="pipeline_verb", metavar="VERB")
    verbs.required = True
    run = verbs.add_parser("run", formatter_class=formatter, help="run the stages that are not up to date",
                           description="Validate the whole file, then run each stage that is not up to date. "
                                       "Ends by printing the `lmforge serve` command of the serve stage.")
    _common(run)
    run.add_argument("--force", action="append", default=[], metavar="STAGE",
                     help="run this stage again even if it is up to date (repeatable); later stages run again "
                          "where its new output differs")
    run.add_argument("--until", default=None, metavar="STAGE", help="stop after this stage")
    run.add_argument("--only", default=None, metavar="STAGE",
                     help="run only this stage (the stages it reads must have run)")
    run.add_argument("--serve", action="store_true", help="then start the serve stage's API server (blocks)")
    run.set_defaults(func=_cmd_run)
    status = verbs.add_parser("status", formatter_class=formatter, help="where each stage stands",
                              description="A table of the stages: state (done, stale, pending, partial "
                                          "(resumable, at step N), running, failed), headline metric, wall time and "
                                          "output. Runs nothing.")
    _common(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=_cmd_status)
    serve = verbs.add_parser("serve", formatter_class=formatter, help="serve the final model (the serve stage)",
                             description="Start the OpenAI-compatible API (`lmforge serve`) on the model of the "
                                         "pipeline's serve stage; its stage must be done.")
    _common(serve)
    serve.add_argument("--host", default=None, help="address to bind (default: the stage's host, else 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="TCP port (default: the stage's port, else 8000)")
    serve.set_defaults(func=_cmd_serve)


def _vars(args):
    from lmforge.pipeline.spec import parse_var_overrides

    return parse_var_overrides(args.var)


def _cmd_run(args) -> int:
    import signal
    import sys

    from lmforge.pipeline import Terminated, run_pipeline

    try:
        summary = run_pipeline(args.file, force=args.force, until=args.until, only=args.only, vars=_vars(args),
                               out_dir=args.out_dir, serve=args.serve)
    except Terminated as e:  # a SIGTERM outside training: the stage is recorded as interrupted
        print("lmforge: terminated (SIGTERM); `lmforge pipeline run` again goes on from there", file=sys.stderr)
        return 128 + e.signum  # the shell's status for a process a SIGTERM ended (143)
    # a training stage stopped at a checkpoint: the status of the signal that stopped it (143 SIGTERM, 130 Ctrl-C)
    return 128 + (summary.signal or signal.SIGINT) if summary.interrupted else 0


def _cmd_status(args) -> int:
    from lmforge.pipeline import (
        format_status,
        load_pipeline,
        pipeline_status,
        status_json,
    )

    pipe = load_pipeline(args.file, vars=_vars(args), out_dir=args.out_dir)
    rows = pipeline_status(pipe)
    if args.json:
        print(json.dumps(status_json(rows, pipe), indent=2))
    else:
        print(format_status(rows, pipe.name, str(pipe.out_dir)))
    return 0


def _cmd_serve(args) -> int:
    from lmforge.pipeline import serve_pipeline

    serve_pipeline(args.file, vars=_vars(args), out_dir=args.out_dir, host=args.host, port=args.port)
    return 0
