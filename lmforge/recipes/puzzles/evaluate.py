"""Score a puzzle model (HRM, TRM, baseline) on a puzzle set: HRM's layout or a Sudoku CSV.

The same model code as training's evaluation: ``halt_max_steps`` segments from a fresh state, the
final answer scored (exact accuracy is the headline), plus the step at which the Q head would halt,
and exact accuracy per difficulty bucket.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lmforge.errors import LMForgeError
from lmforge.checkpoint import resolve_model_dir
from lmforge.device import pick_device


def load_puzzle_model(checkpoint: str | Path, device: str = "auto"):
    from lmforge.models import load_model
    from lmforge.recipes.puzzles.model import PuzzleModel

    directory = resolve_model_dir(checkpoint)
    model = load_model(directory, map_location=pick_device(device))
    if not isinstance(model, PuzzleModel):
        raise LMForgeError(f"{directory} holds a {model.family!r} model, not a puzzle model (hrm, trm, "
                           "puzzle_transformer)")
    model.eval()
    return model, directory


def evaluate_puzzles(checkpoint: str | Path, data: str | Path, split: str = "test", batch_size: int = 256,
                     device: str = "auto", limit: int = 0, show_progress: bool = True) -> dict[str, Any]:
    """Metrics of ``checkpoint`` on ``data``: a dataset directory (``split`` of it) or a Sudoku CSV."""
    from lmforge.recipes.puzzles.data import PuzzleEvalLoader, PuzzleSplit
    from lmforge.recipes.puzzles.training import puzzle_eval_metrics

    model, directory = load_puzzle_model(checkpoint, device)
    data = Path(data)
    with tempfile.TemporaryDirectory() as tmp:
        if data.is_file():
            from lmforge.recipes.puzzles.sudoku import build_sudoku_dataset, read_sudoku_csv

            puzzles = read_sudoku_csv(data)  # written as the test split (the layout needs a train split too)
            build_sudoku_dataset(Path(tmp) / "set", puzzles[:1], puzzles, num_aug=0, seed=0, show_progress=False)
            root, split = Path(tmp) / "set", "test"
        elif (data / split / "dataset.json").is_file():
            root = data
        else:
            raise LMForgeError(f"{data} is neither a Sudoku CSV nor a puzzle dataset with a {split}/ split "
                               "(build one with `lmforge data sudoku`)")
        ds = PuzzleSplit(root, split)
        c = model.config
        if (ds.seq_len, ds.vocab_size) != (c.seq_len, c.vocab_size):
            raise LMForgeError(f"{data} has seq_len {ds.seq_len} and vocab {ds.vocab_size}, the model "
                               f"{c.seq_len} and {c.vocab_size}: it was trained on other puzzles")
        loader = PuzzleEvalLoader(ds, batch_size=batch_size, limit=limit)
        dev = next(model.parameters()).device
        sums: dict[str, float] = {}
        rows = 0
        with torch.no_grad():
            for batch in tqdm(loader.iter_eval_batches(), total=loader.num_batches, desc="eval", unit="batch",
                              disable=not show_progress):
                batch = {k: v.to(dev) for k, v in batch.items()}
                if int(batch["puzzle_identifiers"].max()) >= c.num_puzzle_identifiers:
                    raise LMForgeError(f"{data} uses puzzle identifiers the model has no embedding for")
                loss, metrics = model(batch)
                n = batch["inputs"].shape[0]
                for k, v in {"loss": loss, **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * n
                rows += n
    if rows == 0:
        raise LMForgeError(f"{data} has no puzzles in its {split} split")
    out: dict[str, Any] = puzzle_eval_metrics({k: v / rows for k, v in sums.items()})
    out.update({"puzzles": rows, "checkpoint": str(directory), "data": str(data)})
    return out
