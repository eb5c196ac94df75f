"""HRGC against the plain decoder at the same parameter count and the same training compute.

    python benchmarks/hrgc_vs_plain.py                    # 20 minutes of training each on this machine
    python benchmarks/hrgc_vs_plain.py --minutes 3 --eval-limit 50     # a quick look

Data: `lmforge data go-functions` over the local Go standard library (built once into OUT/data). Both
models use the same tokenizer (a 4,096-token BPE trained on the train split), the same batch, learning
rate schedule and seed: `hrgc_go_tiny` (planner + generator + head, ~3.2M parameters) and
`hrgc_go_plain_tiny` (one GPT over `spec <code> code`, ~3.2M parameters).

Equal compute means equal training time on this CPU: each run stops after --minutes of training
(`training.max_time_minutes`; probes and the final evaluation count in it). So that the learning
rate schedule fits that time, each model's seconds per step are measured first (a 10-step and a
60-step run; their difference cancels the start-up), with HRGC's refinement rows on, and max_steps
set to 0.8x the steps that fit, so that the cosine schedule ends inside the time limit (the
calibration leaves out the probes and the model's own failure rows; at 1.1x, the first recorded
run, both schedules were cut at 82-87%); HRGC's refinement_warmup is a quarter of max_steps. Pin the benchmark to
cores (`taskset -c 0 env OMP_NUM_THREADS=1 python ...`) to keep other work on the machine from
shifting the budget between the two models.
Both checkpoints are then scored by `lmforge eval` on the held-out test packages with the same
--eval-limit functions, and the plain one once more with `--max-iterations 5`: resampling
(temperature 0.8) until the parser accepts an attempt, the control for what HRGC's parser-in-the-loop
alone buys. Writes benchmarks/results/hrgc_vs_plain.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"HRGC": "hrgc_go_tiny", "plain decoder": "hrgc_go_plain_tiny"}


def build_data(out: Path) -> Path:
    from lmforge.recipes.hrgc.functions import extract_go_functions

    data = out / "data"
    if (data / "meta.json").is_file():
        return data
    go = shutil.which("go")
    if go is None:
        raise SystemExit("this benchmark needs Go's standard library: install Go (apt-get install golang-go)")
    goroot = subprocess.run([go, "env", "GOROOT"], capture_output=True, text=True, check=True).stdout.strip()
    extract_go_functions(Path(goroot) / "src", data, overwrite=True)
    return data


def build_tokenizer(data: Path, out: Path) -> Path:
    """The 4,096-token BPE both models use, trained as `lmforge train` trains one for HRGC data."""
    from lmforge.recipes.hrgc.functions import read_go_functions
    from lmforge.tokenizer import train_tokenizer

    if not (out / "tokenizer.json").is_file():
        texts = (f"{f.spec}\n{f.plan}\n{f.code}" for f in read_go_functions(data / "train.jsonl"))
        train_tokenizer(texts, 4096, out, overwrite=True)
    return out / "tokenizer.json"


def train(recipe: str, name: str, runs: Path, data: Path, overrides: list[str]) -> float:
    """Train in a subprocess; returns the wall time in seconds."""
    cmd = [sys.executable, "-m", "lmforge", "train", recipe, f"name={name}", f"out_dir={runs}", f"data.path={data}",
           "logging.progress_bar=false", *overrides]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def seconds_per_step(recipe: str, runs: Path, data: Path, extra: list[str]) -> float:
    quiet = ["training.eval_interval=0", "training.save_interval=0", "recipe.validation_frequency=0",
             "recipe.refinement_warmup=0", "training.warmup_steps=5"]
    times = {}
    for steps in (10, 60):
        name = f"calibrate-{recipe}-{steps}"
        shutil.rmtree(runs / name, ignore_errors=True)
        times[steps] = train(recipe, name, runs, data, [*quiet, *extra, f"training.max_steps={steps}"])
        shutil.rmtree(runs / name, ignore_errors=True)
    return (times[60] - times[10]) / 50


def batch_rows(run_dir: Path) -> int:
    import yaml

    t = yaml.safe_load((run_dir / "config.yaml").read_text())["training"]
    return t["micro_batch_size"] * t["grad_accum_steps"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="training time per model")
    ap.add_argument("--eval-limit", type=int, default=200, help="test functions scored per model")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "hrgc"))
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    out = Path(args.out)
    runs = out / "runs"
    data = build_data(out)
    tokenizer = build_tokenizer(data, out / "tokenizer")
    results: dict[str, dict] = {}
    for label, recipe in MODELS.items():
        shutil.rmtree(runs / label, ignore_errors=True)
        shared = [f"seed={args.seed}", f"data.tokenizer={tokenizer}"]
        step_s = seconds_per_step(recipe, runs, data, shared)
        steps = max(20, int(0.8 * args.minutes * 60 / step_s))
        overrides = [*shared, f"training.max_steps={steps}", f"training.eval_interval={steps}",
                     f"training.save_interval={steps}", f"training.max_time_minutes={args.minutes}",
                     f"training.warmup_steps={max(5, steps // 20)}"]
        if label == "HRGC":
            overrides.append(f"recipe.refinement_warmup={steps // 4}")
        print(f"{label}: {step_s:.3f} s/step measured -> max_steps {steps} for {args.minutes:g} minutes", flush=True)
        wall = train(recipe, label, runs, data, overrides)
        print(f"{label}: trained in {wall / 60:.1f} min; evaluating {args.eval_limit} test functions", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "lmforge", "eval", str(runs / label), "--data", str(data),
                               "--split", "test", "--limit", str(args.eval_limit), "--json"],
                              cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"eval of {label} failed:\n{done.stderr[-3000:]}")
        metrics = json.loads(done.stdout.strip().splitlines()[-1])
        metrics_log = [json.loads(line) for line in (runs / label / "metrics.jsonl").read_text().splitlines()
                       if line.strip()]
        probes = [(r["step"], r["probe/parse_rate"]) for r in metrics_log if "probe/parse_rate" in r]
        from lmforge.models import load_model

        params = load_model(runs / label / "checkpoints" / "best").num_parameters()
        state = json.loads(next((runs / label / "checkpoints").glob("step-*/trainer_state.json")).read_text())
        results[label] = {"recipe": recipe, "parameters": params, "seconds_per_step": step_s, "max_steps": steps,
                          "steps": state["step"], "functions_seen": state["step"] * batch_rows(runs / label),
                          "train_minutes": wall / 60, "eval_minutes": (time.perf_counter() - t0) / 60,
                          "probe_parse_rate": probes, **metrics}
    # The control for HRGC's loop: the plain decoder with the same parser and attempt budget,
    # resampling (temperature 0.8) until an attempt parses.
    control = subprocess.run([sys.executable, "-m", "lmforge", "eval", str(runs / "plain decoder"), "--data", str(data),
                              "--split", "test", "--limit", str(args.eval_limit), "--max-iterations", "5", "--json"],
                             cwd=REPO, capture_output=True, text=True)
    if control.returncode != 0:
        raise SystemExit(f"eval of the resampling control failed:\n{control.stderr[-3000:]}")
    results["plain + resampling"] = {**{k: results["plain decoder"][k] for k in ("recipe", "parameters", "steps",
                                                                                 "train_minutes")},
                                     **json.loads(control.stdout.strip().splitlines()[-1])}
    dest = REPO / "benchmarks" / "results" / "hrgc_vs_plain.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"minutes": args.minutes, "eval_limit": args.eval_limit, "seed": args.seed,
                                "results": results}, indent=2))
    keys = [("parameters", "{:,}"), ("steps", "{}"), ("train_minutes", "{:.1f}"), ("parse_rate", "{:.1%}"),
            ("first_attempt_parse_rate", "{:.1%}"), ("compile_rate", "{:.1%}"), ("code_exact", "{:.1%}"),
            ("ast_similarity", "{:.3f}"), ("avg_iterations", "{:.2f}"), ("plan_exact", "{:.1%}"),
            ("plan_token_accuracy", "{:.3f}"), ("head_accuracy", "{:.1%}")]
    print("\n| metric | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for key, fmt in keys:
        cells = [fmt.format(r[key]) if key in r else "—" for r in results.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")
    print(f"\nwrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
