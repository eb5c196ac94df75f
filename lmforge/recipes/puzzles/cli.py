"""`lmforge eval`, `lmforge generate` (= `lmforge solve`) for puzzle models (HRM, TRM, the baseline)."""

from __future__ import annotations

import json

from lmforge.cli_common import require_data
from lmforge.errors import LMForgeError


def run_eval(args) -> int:
    from lmforge.recipes.puzzles.evaluate import evaluate_puzzles

    batch_size = 256 if args.batch_size is None else args.batch_size
    if batch_size < 1:
        raise LMForgeError("--batch-size must be >= 1")
    m = evaluate_puzzles(args.checkpoint, require_data(args, "a puzzle dataset directory (`lmforge data sudoku`) or a Sudoku CSV"), split=args.split or "test",
                         batch_size=batch_size, device=args.device, limit=args.limit or 0)
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"{m['data']}: {m['puzzles']} puzzles  exact accuracy {100 * m['exact_accuracy']:.2f}%  "
          f"cell accuracy {100 * m['accuracy']:.2f}% (blank cells {100 * m['blank_accuracy']:.2f}%)  "
          f"loss {m['loss']:.4f}")
    print(f"  Q head would halt after {m['steps']:.2f} steps on average; exact accuracy there "
          f"{100 * m['exact_accuracy_at_halt']:.2f}%")
    for name in ("singles", "easy", "medium", "hard"):
        if f"exact_accuracy_{name}" in m:
            print(f"  {name:8s} {round(m[f'share_{name}'] * m['puzzles']):5d} puzzles  exact "
                  f"{100 * m[f'exact_accuracy_{name}']:.2f}%")
    return 0


def add_solve_args(group, required: bool = False) -> None:
    group.add_argument("--puzzle", required=required, default=None,
                       help="81 characters: digits 1-9, '.' or '0' for blanks")
    group.add_argument("--max-steps", type=int, default=0,
                       help="segments at most (0 = the model's halt_max_steps); more than the model was trained "
                            "with lets it think longer, but above 100x halt_max_steps is refused: each segment is "
                            "a full pass of the model, so such a run takes that many times as long")
    group.add_argument("--no-early-halt", action="store_true", help="run every segment instead of stopping "
                       "where the Q head halts")


def run_solve(args) -> int:
    from lmforge.recipes.puzzles.solve import solve_sudoku
    from lmforge.recipes.puzzles.sudoku import pretty_grid

    if args.puzzle is None:
        raise LMForgeError(f"{args.checkpoint} is a puzzle model: give it a Sudoku with --puzzle "
                           "'53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79' "
                           "(81 characters, '.' or '0' for blanks)")
    if args.max_steps < 0:
        raise LMForgeError("--max-steps must be >= 0")
    r = solve_sudoku(args.checkpoint, args.puzzle, max_steps=args.max_steps or None,
                     early_halt=not args.no_early_halt, device=args.device)
    print(pretty_grid(r["grid"]))
    if r["valid"]:
        verdict = "yes"
    elif r["wrong_cells"] is None:  # several solutions: no single one to compare with
        verdict = "no (it breaks the Sudoku rules or changes a clue)"
    else:
        verdict = f"no ({r['wrong_cells']} cells differ from the solution)"
    print(f"valid solution: {verdict}")
    print(f"steps used: {r['steps']} of {r['max_steps']}")
    if r["note"]:
        print(f"note: {r['note']}")
    return 0 if r["valid"] else 1


def add_verbs(sub) -> None:
    """`lmforge solve CKPT --puzzle ...`: the same as `lmforge generate CKPT --puzzle ...`."""
    from lmforge.cli_common import formatter

    p = sub.add_parser("solve", help="solve a Sudoku with a trained HRM/TRM checkpoint (= generate --puzzle)",
                       formatter_class=formatter,
                       description="Run a puzzle model on one Sudoku (81 characters, row by row; '.' or '0' "
                                   "for blanks). Prints the grid it produced, whether it is a valid solution "
                                   "of the puzzle, and the reasoning steps (ACT segments) it used. The same as "
                                   "`lmforge generate CKPT --puzzle ...`.")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    add_solve_args(p, required=True)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.set_defaults(func=run_solve)
