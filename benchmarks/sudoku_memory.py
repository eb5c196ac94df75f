"""Seed 003's memory table, measured: peak memory of HRM training at the seed's settings.

    python benchmarks/sudoku_memory.py [--data DIR] [--steps 3] [--rows small,medium,...]

Each row trains `hrm_sudoku` with the seed's overrides for a few optimizer steps through the real
loop, in its own process, and reports peak memory: on CUDA `torch.cuda.max_memory_allocated` (what
the seed's table is about), on CPU the process's peak RSS — Python, torch's kernels and thread pools
included, so the smallest rows show that floor (~0.5 GB) more than the model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROWS = {  # seed 003's table: its settings, and the memory it claims
    "tiny": (["arch.hidden_size=16", "global_batch_size=2", "arch.H_layers=1", "arch.L_layers=1",
              "arch.num_heads=1", "arch.expansion=2"], "< 2 GB"),
    "small": (["arch.hidden_size=32", "global_batch_size=4", "arch.H_layers=1", "arch.L_layers=1",
               "arch.num_heads=1", "arch.expansion=2"], "2-5 GB"),
    "medium": (["arch.hidden_size=64", "global_batch_size=8", "arch.H_layers=2", "arch.L_layers=2",
                "arch.num_heads=1"], "5-10 GB"),
    "default": ([], "> 10 GB"),  # hidden 512, 4+4 layers, global batch 768
}


def measure(overrides: list[str], data: str, steps: int, device: str) -> dict:
    import torch

    from lmforge.config import load_config
    from lmforge.device import setup_device
    from lmforge.models import build_model
    from lmforge.recipes.lm.data import build_puzzle_data
    from lmforge.train.distributed import DistInfo
    from lmforge.train.loop import Trainer

    cfg = load_config("hrm_sudoku", [f"data_path={data}", *overrides, f"training.device={device}",
                                     "training.max_steps=1000000"])
    cfg.training.micro_batch_size = cfg.training.global_batch_size
    info = DistInfo()
    dev = setup_device(device, cfg.training.precision, 1.0)
    bundle = build_puzzle_data(cfg, info)
    model = build_model(cfg.model).to(dev.device)
    trainer = Trainer(cfg, model, bundle, dev, info, Path("/nonexistent"))
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step_once()
    seconds = (time.perf_counter() - t0) / steps
    out = {"params": model.num_parameters(), "batch": cfg.training.micro_batch_size, "precision": dev.precision,
           "s_per_step": seconds, "device": str(dev.device)}
    if dev.device.type == "cuda":
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="benchmarks/out/sudoku_cpu/sudoku-1k", help="a `lmforge data sudoku` dataset")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(ROWS[args.one][0], args.data, args.steps, args.device)))
        return 0
    print("| seed's row | settings | params | precision | peak memory | s/step | seed says |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in args.rows.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", row, "--data", args.data, "--steps", str(args.steps),
                               "--device", args.device], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"| {row} | failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else '?'} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        settings = " ".join(ROWS[row][0]) or "recipe defaults (hidden 512, 4+4 layers, batch 768)"
        print(f"| {row} | {settings} | {r['params'] / 1e6:.2f}M | {r['precision']} on {r['device']} | "
              f"{r['peak_mb']:,.0f} MB | {r['s_per_step']:.2f} | {ROWS[row][1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
