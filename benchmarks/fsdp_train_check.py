"""A short real training run, plain and sharded (FSDP over one process, under torchrun), with evaluation.

The first GPU check of the sharded paths the CPU tests reach only on gloo, or not at all: the model built on
the CPU and moved to the GPU block by block by ``fully_shard``, evaluation running the sharded model block by
block on the GPU (on one process: ``fsdp.lockstep``'s collectives need two GPUs or more), and with
``--offload`` the shards kept in CPU memory
(``training.fsdp_offload``, refused on a CPU run). Data: the running Python's standard library (as
``lmforge quickstart`` uses when no Go toolchain is there), a byte-level BPE tokenizer trained on it, packed
windows. Prints one JSON line per run (held-out losses by step, the most memory PyTorch held, the median
tokens/s) and the sharded runs' held-out losses against the plain run's. Usage:

    python benchmarks/fsdp_train_check.py --out DIR [--device cuda] [--steps 60] [--offload]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml


def prepare(out: Path, files: int, vocab: int) -> Path:
    """Token shards of the first ``files`` modules of the standard library (built once in ``out``)."""
    from lmforge.data.prepare import prepare_data
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    data = out / "data"
    if (data / "meta.json").is_file():
        return data
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for path in sorted(stdlib.glob("*.py"))[:files]:
        (corpus / path.name).write_bytes(path.read_bytes())
    texts = (p.read_text(errors="replace") for p in sorted(corpus.glob("*.py")))
    train_tokenizer(texts, vocab_size=vocab, out_dir=out / "tokenizer", show_progress=False, overwrite=True)
    prepare_data([str(corpus)], data, Tokenizer.load(out / "tokenizer"), include=["*.py"], val_fraction=0.1,
                 show_progress=False)
    return data


def recipe(out: Path, data: Path, device: str, steps: int) -> Path:
    gpu = device == "cuda"
    values = {
        "name": "plain", "out_dir": str(out / "runs"), "seed": 1,
        "model": {"family": "gpt", "flavor": "llama", "vocab_size": 0, "n_positions": 512 if gpu else 64,
                  "n_embd": 512 if gpu else 64, "n_layer": 8 if gpu else 2, "n_head": 8 if gpu else 2,
                  "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
        "data": {"path": str(data), "seq_len": 512 if gpu else 64},
        "training": {"max_steps": steps, "micro_batch_size": 16 if gpu else 4, "lr": 1e-3,
                     "warmup_steps": max(1, steps // 10), "eval_interval": max(1, steps // 3), "eval_batches": 8,
                     "save_interval": steps, "log_interval": 5, "device": device,
                     "precision": "bf16" if gpu else "fp32"},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def run(name: str, cmd: list[str], run_dir: Path) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"run": name, "error": done.stderr[-2000:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]
    return {"run": name,
            "eval_loss": {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r},
            "peak_memory_mb": max((r.get("train/peak_memory_mb", 0.0) for r in rows), default=None),
            "gathered_mb": max((r.get("train/gathered_mb", 0.0) for r in rows), default=0.0),
            "median_tokens_per_s": statistics.median(speeds[1:] or speeds) if speeds else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--files", type=int, default=200, help="standard-library modules in the corpus")
    parser.add_argument("--offload", action="store_true", help="a third run with training.fsdp_offload (GPU only)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    data = prepare(out, args.files, 4096 if args.device == "cuda" else 512)
    config = recipe(out, data, args.device, args.steps)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "lmforge",
                "train", str(config)]
    runs = [("plain", [sys.executable, "-m", "lmforge", "train", str(config), "name=plain"]),
            ("fsdp", [*torchrun, "name=fsdp", "training.parallel=fsdp"])]
    if args.offload:
        runs.append(("offload", [*torchrun, "name=offload", "training.parallel=fsdp", "training.fsdp_offload=true"]))
    results = {}
    for name, cmd in runs:
        results[name] = run(name, cmd, out / "runs" / name)
        print(json.dumps(results[name]), flush=True)
    plain = results["plain"].get("eval_loss", {})
    for name in results:
        if name != "plain" and "eval_loss" in results[name]:
            gaps = [abs(results[name]["eval_loss"][s] - plain[s]) / plain[s] for s in plain
                    if s in results[name]["eval_loss"]]
            print(f"{name}: held-out loss against the plain run's, largest relative gap "
                  f"{max(gaps) if gaps else float('nan'):.2e} over {len(gaps)} evaluations", flush=True)
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
