"""mHC's CPU cost, this checkout against another (today's code), eager and compiled, side by side in one run.

    git worktree add --detach /tmp/mhc_before HEAD     # once: the code to compare against
    python benchmarks/mhc_step_cpu.py --before /tmp/mhc_before

Each (checkout, mode, mHC off / n=4) setting runs in its own process on one thread: the recipe's model
(rlm_mhc_tiny: micro-batch 8 x 256, vocabulary 8192 as its trained tokenizer gets) does forward,
backward and an AdamW step on random tokens. Settings alternate within each round. The figure is the
median step's CPU time of the process (``time.process_time``: on a shared machine other programs
stretch wall time but not this process's own CPU time; both are printed), taken after warm-up steps that
include the compile. ``step_metrics`` is False as on the training loop's non-logging steps (today's
code ignores it and computes the Amax metrics every step). Writes benchmarks/results/mhc_step_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import checkout_child_result  # noqa: E402

CHILD = r"""
import json, sys, time
import torch
import lmforge
from lmforge.config import load_config
from lmforge.models.gpt import GPT

recipe, mhc, compile_, steps, warmup = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
cfg = load_config(recipe, ["model.vocab_size=8192", f"model.mhc_enabled={str(mhc).lower()}"])
torch.manual_seed(0)
model = GPT(cfg.model).train()
model.step_metrics = False
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)
fwd = torch.compile(model) if compile_ else model
ids = torch.randint(0, 8192, (cfg.training.micro_batch_size, cfg.data.seq_len))
def step():
    loss, _ = fwd({"input_ids": ids, "labels": ids})
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
t0 = time.perf_counter()
for _ in range(warmup):
    step()
warm = time.perf_counter() - t0
cpu, wall = [], []
for _ in range(steps):
    c0, w0 = time.process_time(), time.perf_counter()
    step()
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - w0)
print(json.dumps({"lmforge": lmforge.__file__, "cpu_s": cpu, "wall_s": wall, "warmup_s": warm,
                  "tokens": ids.numel(), "params": sum(p.numel() for p in model.parameters())}))
"""


def measure(checkout: Path, recipe: str, mhc: bool, compile_: bool, steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, recipe, "1" if mhc else "0", "1" if compile_ else "0",
                          str(steps), str(warmup)], capture_output=True, text=True, env=env, cwd=checkout)
    return checkout_child_result(out, checkout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare against (today's code)")
    ap.add_argument("--recipe", default="rlm_mhc_tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="eager,compile")
    args = ap.parse_args()
    checkouts = {"before": args.before.resolve(), "after": REPO}
    modes = args.modes.split(",")
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(args.rounds):
        for mode in modes:
            for setting in ("mHC off", "mHC n=4"):
                for name, path in checkouts.items():
                    res = measure(path, args.recipe, setting != "mHC off", mode == "compile", args.steps, args.warmup)
                    runs.setdefault((name, mode, setting), []).append(res)
                    print(f"round {r + 1}/{args.rounds} {name:>6} {mode:>7} {setting}: "
                          f"{statistics.median(res['cpu_s']) * 1e3:,.0f} ms CPU per step "
                          f"(wall {statistics.median(res['wall_s']) * 1e3:,.0f} ms, warm-up {res['warmup_s']:.0f} s)",
                          flush=True)
    rows = []
    print(f"\n{args.recipe}, one thread, median step over {args.rounds} rounds x {args.steps} steps")
    print(f"{'checkout':<9}{'mode':<9}{'setting':<10}{'CPU ms/step':>12}{'tokens/CPU s':>14}{'vs off':>8}{'wall ms':>9}")
    for mode in modes:
        for name in checkouts:
            off = None
            for setting in ("mHC off", "mHC n=4"):
                results = runs[(name, mode, setting)]
                cpu = statistics.median(t for r in results for t in r["cpu_s"])
                wall = statistics.median(t for r in results for t in r["wall_s"])
                off = off or cpu
                row = {"checkout": name, "mode": mode, "setting": setting, "cpu_ms": 1e3 * cpu, "wall_ms": 1e3 * wall,
                       "tokens_per_cpu_s": results[0]["tokens"] / cpu, "slowdown": 1 - off / cpu,
                       "warmup_s": [r["warmup_s"] for r in results]}
                rows.append(row)
                print(f"{name:<9}{mode:<9}{setting:<10}{row['cpu_ms']:>12,.0f}{row['tokens_per_cpu_s']:>14,.0f}"
                      f"{-100 * row['slowdown']:>7.1f}%{row['wall_ms']:>9,.0f}")
    dest = REPO / "benchmarks" / "results" / "mhc_step_cpu.json"
    dest.write_text(json.dumps({"recipe": args.recipe, "before": str(args.before), "steps": args.steps,
                                "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
