"""The ``hrgc`` kind: the hierarchical recursive Go coder of seed 000 (a planner, a generator and a
continue / refine / done head, trained on (spec, plan, code) records of real Go functions) and its
plain spec -> code baseline. Layout: ``functions`` (the data builder), ``refinement`` (labelled
states for the head), ``sequences`` (token layout and loaders), ``model``, ``training`` (settings and
the loop's glue), ``writer`` (inference), ``probe``, ``evaluate``, ``cli``. Go syntax itself is
``lmforge.go_syntax``."""

from __future__ import annotations

from lmforge.recipes import CLIOptions, Family, Lazy, RecipeSpec, register
from lmforge.recipes.hrgc import cli
from lmforge.recipes.hrgc.cli_data import add_data_verbs

SPEC = register(RecipeSpec(
    name="hrgc",
    summary="HRGC Go coders (hrgc): parse, compile and AST-similarity rates; write a function from its spec",
    families=(Family("hrgc", "lmforge.recipes.hrgc.model:HRGC"),),
    build_data=Lazy("lmforge.recipes.hrgc.training:build_go_function_data"),
    count=Lazy("lmforge.recipes.hrgc.training:count"),
    settings=Lazy("lmforge.recipes.hrgc.training:HRGCSettings"),
    aliases=Lazy("lmforge.recipes.hrgc.aliases:hrgc_aliases"),  # its module reads the model's (torch) key names
    prepare_model=Lazy("lmforge.recipes.hrgc.training:prepare_model"),
    make_optimizer=Lazy("lmforge.recipes.hrgc.training:make_optimizer"),
    ddp_find_unused_parameters=True,  # before refinement_warmup the head gets no gradient
    eval_weight=Lazy("lmforge.recipes.hrgc.training:eval_weight"),
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args,
                    help="write each held-out function from its spec and score it (--limit N: the first N)"),
    generate=CLIOptions(run=cli.run_generate, add=cli.add_generate_args, uses=("sampling", "precision"),
                        help="write one function body from --spec: plan, attempts, verdicts"),
    add_data_verbs=add_data_verbs,
))
