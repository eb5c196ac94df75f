"""Solve one Sudoku with a trained puzzle model (``lmforge solve``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LMForgeError

MAX_STEPS_FACTOR = 100  # --max-steps above this many times the model's halt_max_steps is refused


def solve_sudoku(checkpoint: str | Path, puzzle: str, max_steps: int | None = None, early_halt: bool = True,
                 device: str = "auto") -> dict[str, Any]:
    """The model's answer to ``puzzle`` (81 chars) with its validity and the steps it used. ``wrong_cells``
    counts the cells that differ from the solution; None where the puzzle has several (validity is then
    judged by the rules and the clues alone)."""
    from lmforge.recipes.puzzles.sudoku import is_valid_solution, parse_grid, solve
    from lmforge.recipes.puzzles.evaluate import load_puzzle_model

    grid = parse_grid(puzzle.strip(), where="--puzzle")
    solutions, _ = solve(grid, limit=2)
    if not solutions:
        raise LMForgeError("the puzzle has no solution (a digit repeats in a row, column or box, or the clues "
                           "contradict each other): check the 81 characters")
    model, _ = load_puzzle_model(checkpoint, device)
    c = model.config
    if (c.seq_len, c.vocab_size) != (81, 11):
        raise LMForgeError(f"{checkpoint} was trained on puzzles of {c.seq_len} cells and vocab {c.vocab_size}, "
                           "not Sudoku (81 cells, vocab 11)")
    if max_steps and max_steps > MAX_STEPS_FACTOR * c.halt_max_steps:
        raise LMForgeError(
            f"--max-steps {max_steps} is more than {MAX_STEPS_FACTOR}x the model's halt_max_steps "
            f"({c.halt_max_steps}), the segments it was trained to halt within; each segment is a full pass of the "
            f"model, so the run could take {max_steps // c.halt_max_steps}x as long as a default one: use at most "
            f"{MAX_STEPS_FACTOR * c.halt_max_steps}")
    dev = next(model.parameters()).device
    inputs = torch.as_tensor(grid.astype(np.int64) + 1, device=dev).unsqueeze(0)  # blank=1, digit d = d+1
    ids = torch.zeros(1, dtype=torch.long, device=dev)  # Sudoku datasets use the one blank identifier
    pred, steps = model.solve(inputs, ids, max_steps=max_steps, early_halt=early_halt)
    answer = np.clip(pred[0].cpu().numpy() - 1, 0, 9).astype(np.uint8)  # tokens 0/1 (pad/blank) -> 0
    valid = is_valid_solution(grid, answer)
    note, wrong = "", 0 if valid else int((answer != solutions[0]).sum())
    if len(solutions) > 1:  # no one solution to count differences against: the rules and the clues decide
        note = "this puzzle has more than one solution; validity is checked against the rules and the clues"
        wrong = None
    return {"grid": answer, "valid": valid, "steps": int(steps[0]), "wrong_cells": wrong,
            "max_steps": max_steps or (c.halt_max_steps if model.uses_act else 1), "note": note}
