"""How long ``lmforge.models.load_model`` takes, and the memory it holds, for a recipe's model.

    python benchmarks/load_time.py rlm_mhc_1b model.mhc_enabled=false [--dir /tmp/load_1b] [--rounds 2]

Builds the model once (random weights) and saves it to ``--dir`` (kept, reused by later runs), then loads it
``--rounds`` times, each in a fresh process: wall seconds of the load, the process's peak resident memory right
after it, and after reading every weight once (a load that maps the file reads it only when used)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import resource, sys, time
t = time.perf_counter()
from lmforge.models import load_model
model = load_model(sys.argv[1])
seconds = time.perf_counter() - t
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
loaded = peak()
total = sum(float(p.detach().double().sum()) for p in model.parameters())  # reads every weight
print(f"{seconds:.2f} {loaded:.2f} {peak():.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--dir", default=None, help="where the model is saved (default /tmp/lmforge_load_RECIPE)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    directory = Path(args.dir or f"/tmp/lmforge_load_{args.recipe}")
    if not (directory / "model.safetensors").is_file():
        from lmforge.config import load_config
        from lmforge.models import build_model

        build_model(load_config(args.recipe, args.overrides).model).save_pretrained(directory)
    size = (directory / "model.safetensors").stat().st_size / 2**30
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", PROBE, str(directory)], capture_output=True, text=True,
                             check=True).stdout.split()
        seconds, loaded, touched = map(float, out)
        print(json.dumps({"model": str(directory), "file_gib": round(size, 2), "load_s": seconds,
                          "peak_rss_gib_after_load": loaded, "peak_rss_gib_after_reading_all": touched}))


if __name__ == "__main__":
    main()
