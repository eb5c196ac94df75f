"""How long `torch.compile` takes to get an mHC model's first training step ready, for two checkouts side by side.

    python benchmarks/mhc_compile_time.py --before /tmp/mhc_before            # rlm_mhc_125m, this checkout vs another
    python benchmarks/mhc_compile_time.py --recipe rlm_mhc_tiny --timeout 600

Each measurement runs in its own process with an empty Inductor cache (a cold compile, as on a fresh
machine): build the recipe's model, `torch.compile` it, and time the first forward + backward of one
`[batch, seq]` training batch until the gradients exist. Compile is host work (tracing, graph passes,
code generation, C++/Triton builds), so the figure is meaningful on a CPU; the batch is small so the
step itself is a negligible part. ``--before DIR`` (e.g. ``git worktree add /tmp/mhc_before HEAD``)
runs that checkout's lmforge the same way; the settings alternate between the two checkouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import checkout_child_result  # noqa: E402

# Runs in the child process, with PYTHONPATH at the checkout under test.
CHILD = r"""
import json, sys, time
import torch
import lmforge
from lmforge.config import load_config
from lmforge.models.gpt import GPT

recipe, batch, seq, mhc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
cfg = load_config(recipe, [f"model.mhc_enabled={str(mhc).lower()}"])
torch.manual_seed(0)
if cfg.model.vocab_size == 0:  # presets whose vocabulary comes from their data's tokenizer
    cfg.model.vocab_size = 8192
model = GPT(cfg.model).train()
ids = torch.randint(0, cfg.model.vocab_size, (batch, seq))
compiled = torch.compile(model)
t0 = time.perf_counter()
loss, _ = compiled({"input_ids": ids, "labels": ids})
t1 = time.perf_counter()
loss.backward()
t2 = time.perf_counter()
print(json.dumps({"lmforge": lmforge.__file__, "forward_s": t1 - t0, "backward_s": t2 - t1, "total_s": t2 - t0,
                  "params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads()}))
"""


def measure(checkout: Path, recipe: str, batch: int, seq: int, mhc: bool, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: nothing from an earlier run
        env["TRITON_CACHE_DIR"] = str(Path(cache) / "triton")
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, recipe, str(batch), str(seq), "1" if mhc else "0"],
                                 capture_output=True, text=True, env=env, cwd=cache, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"total_s": None, "note": f"not ready after {timeout:.0f} s (stopped)"}
    return checkout_child_result(out, checkout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="rlm_mhc_125m")
    ap.add_argument("--before", type=Path, help="another checkout to time the same way (today's code)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a compile is stopped and reported as such")
    ap.add_argument("--no-off", action="store_true", help="skip the mHC-off model (the plain compile for reference)")
    args = ap.parse_args()

    checkouts = {"after": REPO} if args.before is None else {"before": args.before, "after": REPO}
    settings = [("mHC n=4", True)] + ([] if args.no_off else [("mHC off", False)])
    rows = []
    for setting, mhc in settings:
        for name, path in checkouts.items():
            r = measure(path, args.recipe, args.batch, args.seq, mhc, args.timeout)
            rows.append({"checkout": name, "path": str(path), "setting": setting, **r})
            shown = f"{r['total_s']:.1f} s (forward {r['forward_s']:.1f} s + backward {r['backward_s']:.1f} s)" \
                if r["total_s"] is not None else r["note"]
            print(f"{args.recipe} {setting:<8} {name:<7} compile + first step: {shown}", flush=True)
    dest = REPO / "benchmarks" / "results" / f"mhc_compile_time_{args.recipe}_cpu.json"
    dest.write_text(json.dumps({"recipe": args.recipe, "batch": args.batch, "seq": args.seq, "rows": rows}, indent=2)
                    + "\n")
    print(f"wrote {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
