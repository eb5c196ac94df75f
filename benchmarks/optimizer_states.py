"""AdamW's moments in fp32 against 8 bits (training.optimizer_states): held-out loss over seeds, memory, step time.

    python benchmarks/optimizer_states.py                 # go_coder_tiny, 3 seeds x 2 settings x 300 steps
    python benchmarks/optimizer_states.py --steps 100     # a quick look

Data: the corpus `lmforge quickstart` finds, a 4096-token BPE and token shards, built once into OUT/data (as
benchmarks/mhc_ablation.py does). Every run uses go_coder_tiny's model, batch and schedule; only the seed and
training.optimizer_states differ. Each final checkpoint is scored on the same held-out tokens. Also printed:
the bytes of optimizer state each checkpoint holds, the moments' memory computed for the 124M and 1.3B
presets, and one optimizer step's time on this machine for each setting, and for 8bit compiled too
(training.compile=true). A CPU figure: on a GPU the eager 8-bit step is bound by its kernel launches (the
fourth H200 lease: 70.1 against 34.0 ms a GPT-2 124M training step), which the compiled step removes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402
from mhc_ablation import build_data, held_out_loss, rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("fp32", "8bit")


def checkpoint_state_bytes(checkpoint: Path) -> int:
    from lmforge.checkpoint import OPTIMIZER_FILE, load_training_file

    state = load_training_file(checkpoint, OPTIMIZER_FILE, "optimizer state")["optimizer"]["state"]
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values() if torch.is_tensor(v))


def preset_moment_bytes(preset: str) -> dict[str, int]:
    """The moments' bytes of a preset's parameters for each setting, counted from the shapes (meta device)."""
    from lmforge.config import load_config
    from lmforge.models.base import on_meta_device
    from lmforge.train import build_model
    from lmforge.train.optim import moment_bytes

    cfg = load_config(preset, ["model.vocab_size=50304"] if "go_coder" in preset else [])
    with on_meta_device():
        model = build_model(cfg.model)
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params), **{states: moment_bytes(params, states) for states in SETTINGS}}


def step_seconds(states: str, data: Path, repeats: int, compile: bool = False) -> float:
    """Median seconds of one optimizer step over go_coder_tiny's parameters, with gradients in place
    (``compile``: as with training.compile=true, which compiles the 8-bit step; its first steps are not timed)."""
    from lmforge.config import load_config
    from lmforge.train import build_model
    from lmforge.train.optim import default_optimizer

    cfg = load_config("go_coder_tiny", [f"data.path={data}", f"training.optimizer_states={states}",
                                        "model.vocab_size=4096", f"training.compile={str(compile).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = default_optimizer(model, cfg, torch.device("cpu"))
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/optimizer_states", help="working directory")
    ap.add_argument("--data", default="", help="prepared token shards to use (default: build OUT/data)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens scored per final model")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = ap.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else build_data(out)
    runs_dir = out / "runs"
    print(f"CPU: {cpu_name()}", flush=True)
    results = []
    for seed in range(args.seeds):
        for states in SETTINGS:
            name = f"{states}-seed{seed}-{args.steps}"
            run_dir = runs_dir / name
            final = run_dir / "checkpoints" / f"step-{args.steps:06d}"
            if not final.is_dir():
                t0 = time.perf_counter()
                cmd = [sys.executable, "-m", "lmforge", "train", "go_coder_tiny", f"data.path={data}",
                       f"out_dir={runs_dir}", f"name={name}", f"seed={seed}", f"training.optimizer_states={states}",
                       f"training.max_steps={args.steps}", f"training.eval_interval={args.steps}",
                       f"training.save_interval={args.steps}", "logging.progress_bar=false", *args.overrides]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stdout[-2000:], proc.stderr[-3000:])
                    return 1
                print(f"{name}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
            log = rows(run_dir)
            results.append({"name": name, "states": states, "seed": seed,
                            "val_loss": held_out_loss(final, data, args.eval_tokens),
                            "state_bytes": checkpoint_state_bytes(final),
                            "tokens_per_s": statistics.median(x["train/tokens_per_s"] for x in log
                                                              if "train/tokens_per_s" in x)})
            print(json.dumps(results[-1]), flush=True)

    print(f"\ngo_coder_tiny, {args.steps} steps, {args.seeds} seeds; held-out loss (nats/token) on "
          f"{args.eval_tokens:,} tokens")
    print(f"{'states':<8}{'val loss mean':>14}{'sd':>8}{'per seed':>28}{'state MB':>10}{'tok/s':>8}{'step ms':>9}")
    summary = {}
    for states in SETTINGS:
        mine = [r for r in results if r["states"] == states]
        losses = [r["val_loss"] for r in mine]
        summary[states] = {"val_loss_mean": statistics.mean(losses),
                           "val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                           "val_losses": losses, "state_mb": mine[0]["state_bytes"] / 2**20,
                           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                           "optimizer_step_ms": 1000 * step_seconds(states, data, 10)}
        if states == "8bit":
            summary[states]["optimizer_step_ms_compiled"] = 1000 * step_seconds(states, data, 10, compile=True)
        s = summary[states]
        print(f"{states:<8}{s['val_loss_mean']:>14.4f}{s['val_loss_sd']:>8.4f}"
              f"{', '.join(f'{v:.4f}' for v in losses):>28}{s['state_mb']:>10.2f}{s['tokens_per_s']:>8,.0f}"
              f"{s['optimizer_step_ms']:>9.1f}"
              + (f" (compiled: {s['optimizer_step_ms_compiled']:.1f})" if "optimizer_step_ms_compiled" in s else ""))
    diff = summary["8bit"]["val_loss_mean"] - summary["fp32"]["val_loss_mean"]
    print(f"8bit - fp32: {diff:+.4f} nats/token (seed sd {summary['fp32']['val_loss_sd']:.4f})")
    presets = {p: preset_moment_bytes(p) for p in ("go_coder_125m", "rlm_mhc_1b")}
    for preset, b in presets.items():
        print(f"{preset}: {b['params'] / 1e6:,.0f}M parameters, AdamW moments fp32 {b['fp32'] / 2**30:.2f} GiB, "
              f"8bit {b['8bit'] / 2**30:.2f} GiB")
    dest = REPO / "benchmarks" / "results" / "optimizer_states.json"
    dest.write_text(json.dumps({"cpu": cpu_name(), "steps": args.steps, "seeds": args.seeds, "overrides": args.overrides,
                                "summary": summary, "runs": results, "presets": presets}, indent=2) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
