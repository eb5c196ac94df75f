"""The ``hrgc`` kind: the hierarchical recursive Go coder of seed 000 (a planner, a generator and a
continue / refine / done head, trained on (spec, plan, code) records of real Go functions) and its
plain spec -> code baseline. Layout: ``functions`` (the data builder), ``refinement`` (labelled
states for the head), ``sequences`` (token layout and loaders), ``model``, ``training`` (settings and
the loop's glue), ``writer`` (inference), ``probe``, ``evaluate``, ``cli``. Go syntax itself is
``lmforge.go_syntax``."""

from __future__ import annotations

from lmforge.recipes import CLIOptions, RecipeSpec, register
from lmforge.recipes.hrgc import cli
from lmforge.recipes.hrgc.aliases import hrgc_aliases
from lmforge.recipes.hrgc.cli_data import add_data_verbs
from lmforge.recipes.hrgc.model import HRGC
from lmforge.recipes.hrgc.training import (HRGCSettings, build_go_function_data, count, eval_weight, make_optimizer,
                                           prepare_model)

SPEC = register(RecipeSpec(
    name="hrgc",
    summary="HRGC Go coders (hrgc): parse, compile and AST-similarity rates; write a function from its spec",
    families=(HRGC,),
    build_data=build_go_function_data,
    count=count,
    settings=HRGCSettings,
    aliases=hrgc_aliases,
    prepare_model=prepare_model,
    make_optimizer=make_optimizer,
    ddp_find_unused_parameters=True,  # before refinement_warmup the head gets no gradient
    eval_weight=eval_weight,
    eval=CLIOptions(run=cli.run_eval, add=cli.add_eval_args,
                    help="write each held-out function from its spec and score it (--limit N: the first N)"),
    generate=CLIOptions(run=cli.run_generate, add=cli.add_generate_args, uses=("sampling", "precision"),
                        help="write one function body from --spec: plan, attempts, verdicts"),
    add_data_verbs=add_data_verbs,
))
