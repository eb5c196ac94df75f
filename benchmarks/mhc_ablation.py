"""Does mHC help at tiny scale? rlm_mhc_tiny with mHC on (n = 4) and off, 3 seeds each, on real code.

    python benchmarks/mhc_ablation.py                  # 6 runs x 600 steps on this machine's Go/Python stdlib
    python benchmarks/mhc_ablation.py --steps 100      # a quick look

Data: the corpus `lmforge quickstart` finds (the Go standard library of a local Go toolchain, else
Python's), a 4096-token BPE trained on it and token shards, built once into OUT/data. Every run uses
the same data, steps, batch (8 x 256) and learning rate schedule; only the seed (initial weights and
data order) and model.mhc_enabled differ. Each final checkpoint is scored on the same 200k held-out
tokens. Prints a table (mean +- sd over seeds), writes results JSON and a PNG of the loss curves to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"mHC off": "false", "mHC n=4": "true"}


def build_data(out: Path) -> Path:
    from lmforge.data import prepare_data, train_tokenizer_from_sources
    from lmforge.quickstart import find_corpus

    data = out / "data"
    if (data / "meta.json").is_file():
        return data
    corpus = find_corpus()
    print(f"corpus: {corpus.path} ({corpus.origin})", flush=True)
    tok = out / "tokenizer"
    train_tokenizer_from_sources([corpus.path], tok, vocab_size=4096, include=corpus.include,
                                 max_bytes=24_000_000, overwrite=True)
    prepare_data([str(corpus.path)], data, tok, include=list(corpus.include), overwrite=True)
    return data


def held_out_loss(checkpoint: Path, data: Path, tokens: int) -> float:
    from lmforge.data.loader import TokenDataset
    from lmforge.eval.lm import nll_of_tokens
    from lmforge.models import load_model

    model = load_model(checkpoint).eval()
    val = TokenDataset(data, "val")
    nll, count = nll_of_tokens(model, val.read(0, min(val.num_tokens, tokens + 1)), model.config.n_positions, 16,
                               next(model.parameters()).device, progress=False)
    return nll / count


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plot(results: list[dict], runs_dir: Path, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    colors = {"mHC off": "tab:blue", "mHC n=4": "tab:red"}
    for r in results:
        log = rows(runs_dir / r["name"])
        train = [(x["step"], x["train/loss"]) for x in log if "train/loss" in x]
        val = [(x["step"], x["eval/loss"]) for x in log if "eval/loss" in x]
        label = r["setting"] if r["seed"] == 0 else None
        ax_train.plot(*zip(*train), color=colors[r["setting"]], alpha=0.6, linewidth=0.8, label=label)
        ax_val.plot(*zip(*val), "o-", color=colors[r["setting"]], alpha=0.7, label=label)
    for ax, title in ((ax_train, "train loss"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_train.set_ylim(top=min(ax_train.get_ylim()[1], 6.0))
    fig.suptitle("rlm_mhc_tiny: mHC on vs off, 3 seeds each")
    fig.tight_layout()
    fig.savefig(dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/mhc_ablation", help="working directory")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens scored per final model")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run (e.g. training.compile=false)")
    args = ap.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(out)
    runs_dir = out / "runs"
    results = []
    for seed in range(args.seeds):
        for setting, enabled in SETTINGS.items():
            name = f"{'mhc' if enabled == 'true' else 'plain'}-seed{seed}-{args.steps}"
            run_dir = runs_dir / name
            if not (run_dir / "checkpoints" / f"step-{args.steps:06d}").is_dir():
                t0 = time.perf_counter()
                cmd = [sys.executable, "-m", "lmforge", "train", "rlm_mhc_tiny", f"data.path={data}",
                       f"out_dir={runs_dir}", f"name={name}", f"seed={seed}", f"model.mhc_enabled={enabled}",
                       f"training.max_steps={args.steps}", f"training.eval_interval={max(1, args.steps // 6)}",
                       "training.eval_batches=25", f"training.save_steps={args.steps}",
                       "logging.progress_bar=false", *args.overrides]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stdout[-2000:], proc.stderr[-3000:])
                    return 1
                print(f"{name}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
            log = rows(run_dir)
            composite = [x["mhc/amax_composite"] for x in log if "mhc/amax_composite" in x]
            results.append({
                "name": name, "setting": setting, "seed": seed,
                "val_loss": held_out_loss(run_dir / "checkpoints" / f"step-{args.steps:06d}", data, args.eval_tokens),
                "final_train_loss": [x["train/loss"] for x in log if "train/loss" in x][-1],
                "tokens_per_s": statistics.median(x["train/tokens_per_s"] for x in log if "train/tokens_per_s" in x),
                "amax_composite_final": composite[-1] if composite else None,
                "amax_composite_max": max(composite) if composite else None,
                "amax_pre_max": max((x["mhc/amax_pre"] for x in log if "mhc/amax_pre" in x), default=None),
                "amax_post_max": max((x["mhc/amax_post"] for x in log if "mhc/amax_post" in x), default=None),
            })
            print(json.dumps(results[-1]), flush=True)

    print(f"\nrlm_mhc_tiny, {args.steps} steps x 8 x 256 tokens, {args.seeds} seeds; held-out loss on "
          f"{args.eval_tokens:,} tokens")
    print(f"{'setting':<10}{'val loss mean':>14}{'sd':>8}{'per seed':>26}{'Amax comp. (max)':>18}{'tok/s':>8}")
    summary = {}
    for setting in SETTINGS:
        mine = [r for r in results if r["setting"] == setting]
        losses = [r["val_loss"] for r in mine]
        sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
        amax = [r["amax_composite_max"] for r in mine if r["amax_composite_max"] is not None]
        summary[setting] = {"val_loss_mean": statistics.mean(losses), "val_loss_sd": sd, "val_losses": losses,
                            "amax_composite_max": max(amax) if amax else None,
                            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine)}
        seeds = ", ".join(f"{v:.4f}" for v in losses)
        print(f"{setting:<10}{statistics.mean(losses):>14.4f}{sd:>8.4f}{seeds:>26}"
              f"{(f'{max(amax):.4f}' if amax else '-'):>18}{summary[setting]['tokens_per_s']:>8,.0f}")
    diff = summary["mHC n=4"]["val_loss_mean"] - summary["mHC off"]["val_loss_mean"]
    print(f"mHC - off: {diff:+.4f} nats/token")
    dest = REPO / "benchmarks" / "results"
    (dest / "mhc_ablation.json").write_text(json.dumps({"steps": args.steps, "seeds": args.seeds,
                                                        "eval_tokens": args.eval_tokens, "overrides": args.overrides,
                                                        "summary": summary, "runs": results}, indent=2) + "\n")
    plot(results, runs_dir, dest / "mhc_ablation.png")
    print(f"wrote {dest / 'mhc_ablation.json'} and {dest / 'mhc_ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
