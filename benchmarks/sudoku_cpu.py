"""Sudoku on this CPU: TRM, HRM and the plain-transformer baseline, 20 minutes of training each.

    python benchmarks/sudoku_cpu.py                 # data (if missing) + 3 runs x 20 min + evaluation
    python benchmarks/sudoku_cpu.py --minutes 2     # a quick look

Data: 1,000 generated training puzzles with 30-36 clues (+1,000 augmentations each) and 1,000
held-out generated puzzles (no question shared with training), `lmforge data sudoku --seed 0`.
Each model trains through `lmforge train <recipe>` in its own process (peak RSS measured there) for
the same wall time; its *final* checkpoint (EMA weights for TRM) is then scored on all 1,000
held-out puzzles (the 256 puzzles scored during training pick `best/`, so `best/` would be a biased
choice). Prints a table, writes results.json and a PNG of held-out exact accuracy over time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"trm": "trm_sudoku_tiny", "hrm": "hrm_sudoku_tiny", "baseline": "sudoku_baseline_tiny"}


def run_one(recipe: str, overrides: list[str], rss_file: Path) -> int:
    """Train in this process; record its peak RSS."""
    from lmforge.cli import main

    code = main(["train", recipe, *overrides])
    rss_file.write_text(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return code


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/sudoku_cpu", help="working directory")
    ap.add_argument("--data", default=None, help="dataset directory (default OUT/sudoku-1k, built if missing)")
    ap.add_argument("--minutes", type=float, default=20.0, help="training wall time per model")
    ap.add_argument("--models", default="trm,hrm,baseline", help="comma-separated subset of trm,hrm,baseline")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every model's run, e.g. model.mlp_t=false (repeatable)")
    ap.add_argument("--run-one", nargs=3, metavar=("RECIPE", "OVERRIDES_JSON", "RSS_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        recipe, overrides, rss = args.run_one
        return run_one(recipe, json.loads(overrides), Path(rss))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "sudoku-1k"
    if not (data / "dataset.json").exists() and not (data / "train" / "dataset.json").exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lmforge", "data", "sudoku", "--out", str(data), "--generate", "1000",
                        "--test-generate", "1000", "--min-clues", "30", "--max-clues", "36", "--num-aug", "1000",
                        "--seed", "0"], check=True)
        print(f"data built in {time.perf_counter() - t0:.0f} s")

    from lmforge.checkpoint import latest_checkpoint
    from lmforge.models import load_model
    from lmforge.recipes.puzzles.evaluate import evaluate_puzzles

    results = {}
    for key in args.models.split(","):
        recipe = MODELS[key]
        run_dir = out / "runs" / recipe
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        overrides = [f"data.path={data}", f"out_dir={out / 'runs'}", f"name={recipe}",
                     f"training.max_time_minutes={args.minutes}", "logging.progress_bar=false", *args.set]
        rss_file = out / f"{recipe}.rss.json"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--run-one", recipe, json.dumps(overrides), str(rss_file)], check=True)
        wall = time.perf_counter() - t0
        final = latest_checkpoint(run_dir / "checkpoints")
        metrics = evaluate_puzzles(final, data, split="test", device="cpu", show_progress=False)
        rows = read_metrics(run_dir)
        speeds = sorted(r["train/examples_per_s"] for r in rows if "train/examples_per_s" in r)
        curve = [(r["step"], r["eval/exact_accuracy"]) for r in rows if "eval/exact_accuracy" in r]
        results[key] = {
            "recipe": recipe, "params": load_model(final).num_parameters(), "steps": int(final.name.split("-")[1]),
            "wall_s": wall, "rows_per_s_median": speeds[len(speeds) // 2] if speeds else 0.0,
            "peak_rss_mb": json.loads(rss_file.read_text())["peak_rss_mb"], "heldout": metrics,
            "curve_256": curve, "checkpoint": str(final),
        }
        print(json.dumps({key: {k: v for k, v in results[key].items() if k != "curve_256"}}, indent=1), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))

    print("\n| model | recipe | params | steps | rows/s | peak RSS | held-out exact | token acc | Q-halt steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        h = r["heldout"]
        print(f"| {key} | {r['recipe']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['rows_per_s_median']:.0f} | "
              f"{r['peak_rss_mb']:.0f} MB | {100 * h['exact_accuracy']:.1f}% | {100 * h['accuracy']:.1f}% | "
              f"{h['steps']:.2f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key, r in results.items():
            steps, acc = zip(*r["curve_256"]) if r["curve_256"] else ((), ())
            ax.plot(steps, [100 * a for a in acc], marker=".", label=f"{key} ({r['recipe']})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("exact accuracy, 256 held-out puzzles (%)")
        ax.set_title(f"Sudoku 30-36 clues, {args.minutes:g} min each on this CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sudoku_cpu.png", dpi=120)
        plt.close(fig)
        print(f"plot: {out / 'sudoku_cpu.png'}")
    except Exception as e:  # the figures above are the result; the plot is a convenience
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
