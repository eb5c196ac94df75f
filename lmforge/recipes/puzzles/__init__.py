"""The ``puzzles`` kind: HRM, TRM and the plain transformer baseline on Sudoku-style grids in HRM's
dataset layout (seed 003). Deep supervision with adaptive halting, AdamATan2 + sign-SGD for the
puzzle embeddings, exact accuracy picks `best/`."""

from __future__ import annotations

from lmforge.recipes import CLIOptions, Family, Lazy, RecipeSpec, register
from lmforge.recipes.puzzles import cli
from lmforge.recipes.puzzles.aliases import hrm_aliases
from lmforge.recipes.puzzles.cli_data import add_data_verbs

SPEC = register(RecipeSpec(
    name="puzzles",
    summary="puzzle models (hrm, trm, puzzle_transformer): exact accuracy on Sudoku; solve one puzzle",
    families=(Family("hrm", "lmforge.recipes.puzzles.hrm:HRM"), Family("trm", "lmforge.recipes.puzzles.trm:TRM"),
              Family("puzzle_transformer", "lmforge.recipes.puzzles.baseline:PuzzleTransformer")),
    build_data=Lazy("lmforge.recipes.puzzles.training:build_puzzle_data"),
    count=Lazy("lmforge.recipes.puzzles.training:count"),
    settings=Lazy("lmforge.recipes.puzzles.training:PuzzleSettings"),
    aliases=hrm_aliases,
    make_optimizer=Lazy("lmforge.recipes.puzzles.training:make_optimizer"),
    own_optimizer="AdamATan2SignSGD",  # HRM's and TRM's: 8-bit AdamW moments do not apply
    best_metric="eval/exact_accuracy",
    best_higher_is_better=True,
    eval_weight=Lazy("lmforge.recipes.puzzles.training:eval_weight"),
    eval=CLIOptions(run=cli.run_eval, uses=("batch-size",), help="exact and cell accuracy on a puzzle dataset or a Sudoku CSV "
                                           "(--limit N: the first N puzzles)"),
    generate=CLIOptions(run=cli.run_solve, add=cli.add_solve_args, help="solve one Sudoku (also `lmforge solve`)"),
    add_data_verbs=add_data_verbs,
    add_verbs=cli.add_verbs,
))
