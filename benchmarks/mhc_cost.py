"""What mHC costs: training tokens/s and peak memory, mHC off vs on (n = 4 flows), same model otherwise.

    python benchmarks/mhc_cost.py                                    # rlm_mhc_tiny on this machine
    python benchmarks/mhc_cost.py --recipe rlm_mhc_125m --compile    # e.g. on a GPU
    python benchmarks/mhc_cost.py --compile --before /tmp/mhc_before # this checkout against another, side by side

Each setting runs `lmforge bench` (random tokens through the real training loop: forward, backward,
clipping, AdamW) in its own process, so peak memory (GPU: max allocated; CPU: process peak RSS) is the
setting's own. Settings are timed in alternating rounds so that drift in the machine's speed falls on
all alike; the table shows the median round. ``--before DIR`` (a second checkout, e.g. today's code from
``git worktree add /tmp/mhc_before HEAD``) runs every setting with that checkout's lmforge too, in the
same alternating rounds. Writes benchmarks/results/mhc_cost_<recipe>_<device>.json.
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


def bench(recipe: str, overrides: list[str], steps: int, warmup: int, checkout: Path = REPO) -> dict:
    cmd = [sys.executable, "-m", "lmforge", "bench", recipe, *overrides, "--steps", str(steps),
           "--warmup", str(warmup), "--json"]
    # `-m` imports from the working directory first: run in the checkout, and say so on the path too
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout,
                         env={**os.environ, "PYTHONPATH": str(checkout)})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="rlm_mhc_tiny")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time with training.compile=true")
    ap.add_argument("--checkpointing", action="store_true", help="also time with activation checkpointing")
    ap.add_argument("--before", type=Path, help="another checkout (today's code) to time in the same rounds")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every setting")
    args = ap.parse_args()
    checkouts = {"": REPO} if args.before is None else {"before": args.before.resolve(), "after": REPO}

    settings = {"mHC off": ["model.mhc_enabled=false"], "mHC n=4": ["model.mhc_enabled=true", "model.mhc_flows=4"]}
    variants = {"eager": ["training.compile=false"]}
    if args.compile:
        variants["compile"] = ["training.compile=true"]
    if args.checkpointing:
        variants["eager + act. ckpt"] = ["training.compile=false", "training.activation_checkpointing=true"]
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(args.rounds):
        for variant, v_over in variants.items():
            for setting, s_over in settings.items():
                for name, checkout in checkouts.items():
                    result = bench(args.recipe, [*args.overrides, *v_over, *s_over], args.steps, args.warmup,
                                   checkout)
                    runs.setdefault((name, variant, setting), []).append(result)
                    print(f"round {r + 1}/{args.rounds} {name:>6} {variant:>18} {setting}: "
                          f"{result['runs'][0]['tokens_per_s']:,.0f} tokens/s", flush=True)
    first = next(iter(runs.values()))[0]
    device, precision = first["device"], first["precision"]
    rows = []
    for (name, variant, setting), results in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        per_round = [r["runs"][0] for r in results]
        tok_s = statistics.median(r["tokens_per_s"] for r in per_round)
        peak = statistics.median(r["peak_memory_mb"] for r in per_round if r["peak_memory_mb"] is not None)
        rows.append({"checkout": name, "variant": variant, "setting": setting, "params": per_round[0]["params"],
                     "tokens_per_s": tok_s, "tokens_per_s_rounds": [r["tokens_per_s"] for r in per_round],
                     "peak_memory_mb": peak})
    cfg = first["config"]
    print(f"\n{args.recipe} on {device} ({precision}), micro-batch {cfg['training']['micro_batch_size']} x seq "
          f"{cfg['data']['seq_len']}, median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'checkout':<9}{'variant':<20}{'setting':<10}{'params':>10}{'tokens/s':>11}{'vs off':>8}{'peak MiB':>9}")
    for row in rows:
        off = next(x for x in rows if x["checkout"] == row["checkout"] and x["variant"] == row["variant"]
                   and x["setting"] == "mHC off")
        row["slowdown"] = 1 - row["tokens_per_s"] / off["tokens_per_s"]
        row["memory_ratio"] = row["peak_memory_mb"] / off["peak_memory_mb"]
        print(f"{row['checkout']:<9}{row['variant']:<20}{row['setting']:<10}{row['params'] / 1e6:>9.2f}M"
              f"{row['tokens_per_s']:>11,.0f}{-100 * row['slowdown']:>7.1f}%{row['peak_memory_mb']:>9.0f}")
    dest = REPO / "benchmarks" / "results" / f"mhc_cost_{args.recipe}_{device.split(':')[0]}.json"
    dest.write_text(json.dumps({"recipe": args.recipe, "device": device, "precision": precision,
                                "torch": first["torch"], "threads": first["threads"], "steps": args.steps,
                                "rounds": args.rounds, "overrides": args.overrides,
                                "before": str(args.before) if args.before else None, "rows": rows}, indent=2) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
