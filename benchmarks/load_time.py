"""How long ``lmforge.models.load_model`` takes, and the memory it holds, for a recipe's model.

    python benchmarks/load_time.py rlm_mhc_1b model.mhc_enabled=false [--dir /tmp/load_1b] [--rounds 2] [--resume]

``--resume`` times instead what a resume does before its first step: build the model and load the checkpoint's
weights into it (``load_checkpoint_weights``), built as a resume builds it now (``build_empty_model``: no values)
and as it did before (``build_model``: random weights, then overwritten), alternating, each in a fresh process.

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

RESUME_PROBE = """
import resource, sys, time
from pathlib import Path
t = time.perf_counter()
from lmforge.config import load_config
from lmforge.models import build_empty_model, build_model
mode, directory, recipe, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
cfg = load_config(recipe, overrides)
model = build_empty_model(cfg.model, "cpu") if mode == "empty" else build_model(cfg.model)
model.load_checkpoint_weights(directory, "cpu")
print(f"{time.perf_counter() - t:.2f} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--dir", default=None, help="where the model is saved (default /tmp/lmforge_load_RECIPE)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--resume", action="store_true", help="time a resume's model: built empty vs random, then loaded")
    args = ap.parse_args()
    directory = Path(args.dir or f"/tmp/lmforge_load_{args.recipe}")
    if not (directory / "model.safetensors").is_file():
        from lmforge.config import load_config
        from lmforge.models import build_model

        build_model(load_config(args.recipe, args.overrides).model).save_pretrained(directory)
    size = (directory / "model.safetensors").stat().st_size / 2**30
    if args.resume:
        for _ in range(args.rounds):
            for mode in ("random", "empty"):
                out = subprocess.run([sys.executable, "-c", RESUME_PROBE, mode, str(directory), args.recipe,
                                      *args.overrides], capture_output=True, text=True, check=True).stdout.split()
                print(json.dumps({"model": str(directory), "built": mode, "build_and_load_s": float(out[0]),
                                  "peak_rss_gib": float(out[1])}))
        return
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", PROBE, str(directory)], capture_output=True, text=True,
                             check=True).stdout.split()
        seconds, loaded, touched = map(float, out)
        print(json.dumps({"model": str(directory), "file_gib": round(size, 2), "load_s": seconds,
                          "peak_rss_gib_after_load": loaded, "peak_rss_gib_after_reading_all": touched}))


if __name__ == "__main__":
    main()
