"""The quickstart's held-out bits per byte on an idle machine and with every core busy at the start.

    python benchmarks/quickstart_busy.py --minutes 6 --out /tmp/qs_busy          # idle, then busy
    python benchmarks/quickstart_busy.py --minutes 1 --out /tmp/qs_busy --only busy

The idle run comes first and prepares the tokenizer and data in --out, so the busy run reuses them
and starts training within seconds: its busy loop (one spinning process per core, --busy-seconds long)
then covers the first minute of training, as when another program was busy in issue 14. Each run
prints one line: held-out bpb, steps, tokens/s over its training time, and whole-job minutes.
Extra key=value arguments go to the quickstart's recipe (e.g. training.schedule_over=steps).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path


def spin(until: float) -> None:
    while time.time() < until:
        pass


def run_quickstart(out: Path, minutes: float, busy_seconds: float, overrides: list[str]) -> dict:
    from lmforge.checkpoint import latest_checkpoint
    from lmforge.quickstart import quickstart

    cores = (os.cpu_count() or 1) if busy_seconds > 0 else 0
    spinners = [mp.Process(target=spin, args=(time.time() + busy_seconds,)) for _ in range(cores)]
    for p in spinners:
        p.start()
    try:
        result = quickstart(out=str(out), minutes=minutes, overrides=overrides)
    finally:
        for p in spinners:
            p.terminate()  # already gone unless the quickstart ended first
            p.join()
    if result.get("signal"):  # stopped by Ctrl-C / SIGTERM: no held-out figures to report
        raise SystemExit(128 + result["signal"])
    last = latest_checkpoint(Path(result["run_dir"]) / "checkpoints")
    state = json.loads((last / "trainer_state.json").read_text())
    return {"bpb": result["bpb"], "unigram_bpb": result["unigram_bpb"], "steps": state["step"],
            "tokens_per_s": state["tokens_seen"] / state["train_seconds"], "train_seconds": state["train_seconds"],
            "job_minutes": result["seconds"] / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=6.0, help="the quickstart's training budget")
    ap.add_argument("--out", default="/tmp/qs_busy", help="the quickstart's working directory (data reused)")
    ap.add_argument("--busy-seconds", type=float, default=60.0, help="how long every core is kept busy")
    ap.add_argument("--only", choices=("idle", "busy"), help="run only one of the two")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the quickstart's recipe")
    args = ap.parse_args()
    rows = {}
    for mode in ("idle", "busy"):
        if args.only in (None, mode):
            rows[mode] = run_quickstart(Path(args.out), args.minutes, args.busy_seconds if mode == "busy" else 0,
                                        args.overrides)
    print(f"\nquickstart --minutes {args.minutes:g} on {os.cpu_count()} cores; busy: {args.busy_seconds:g} s "
          f"of one spinning process per core from the start")
    for mode, r in rows.items():
        print(f"{mode:>5}: held-out bpb {r['bpb']:.3f} (unigram {r['unigram_bpb']:.3f}), {r['steps']} steps, "
              f"{r['tokens_per_s']:,.0f} tokens/s over {r['train_seconds']:.0f} s of training, "
              f"whole job {r['job_minutes']:.1f} min")


if __name__ == "__main__":
    main()
