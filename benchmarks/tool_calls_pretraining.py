"""Does pretraining (seed 004's stages 1-2) help tool calling? Held-out tool-call figures of the tiny
pipeline's stage 3 (SFT) started from the code model and from random weights of the same shape, over
seeds, beside the code model before fine-tuning.

Run the tiny pipeline first (it leaves the tokenizer, the code model and the tool-calling data):

    lmforge pipeline run code_assistant_tiny --out-dir runs/code_assistant_tiny
    python benchmarks/tool_calls_pretraining.py --pipeline-out runs/code_assistant_tiny --seeds 0 1 2

Each SFT run uses the pipeline's own stage-3 settings (its `tools` run's config.yaml: steps, rows,
learning rate, sequence length); only the starting weights and the seed differ. The held-out rows
are the tool data's test split, whose argument values never appear in training: a model has to copy
them from the prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import yaml

METRICS = ("parse_rate", "tool_name_acc", "exact_args", "arg_f1", "abstention", "answer_mentions_result")


def evaluate(checkpoint: Path, rows: list[dict], max_new_tokens: int) -> dict:
    from lmforge.infer.loading import load_for_inference
    from lmforge.posttrain.toolcalls import evaluate_tool_calls

    model, tokenizer, _ = load_for_inference(checkpoint, device="cpu")
    result = evaluate_tool_calls(model, tokenizer, rows, max_new_tokens=max_new_tokens, progress=False)
    return {k: v for k, v in result.items() if k not in ("replies", "examples")}


def fine_tune(out: Path, name: str, stage_config: dict, seed: int, start: str, code: Path) -> tuple[Path, float]:
    """The pipeline's stage-3 config, from the code model (`pretrained`) or random weights (`scratch`)."""
    from lmforge.config import config_from_dict
    from lmforge.models.base import read_model_config
    from lmforge.train import train

    values = json.loads(json.dumps(stage_config))
    values.update(name=name, out_dir=str(out), seed=seed)
    values["logging"] = {**values.get("logging", {}), "tensorboard": False, "progress_bar": False}
    if start == "scratch":
        _, model = read_model_config(code)
        values["model"] = {"family": "gpt", **dataclasses.asdict(model)}
        values["training"]["init_from"] = ""
        values["data"]["tokenizer"] = str(code / "tokenizer.json")
    else:
        values["training"]["init_from"] = str(code)
    t0 = time.perf_counter()
    train(config_from_dict(values))
    return out / name / "checkpoints" / "best", time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline-out", default="runs/code_assistant_tiny", help="a finished code_assistant_tiny run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--limit", type=int, default=300, help="held-out rows scored")
    p.add_argument("--max-steps", type=int, default=0, help="SFT steps (default: the pipeline's tools stage)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--work", default="runs/tool_calls_pretraining", help="where the SFT runs go")
    p.add_argument("--json", default="benchmarks/results/tool_calls_pretraining.json")
    args = p.parse_args()

    from lmforge.checkpoint import resolve_model_dir
    from lmforge.posttrain.toolcalls import load_rows

    root = Path(args.pipeline_out)
    code = resolve_model_dir(root / "code")
    stage_config = yaml.safe_load((root / "tools" / "config.yaml").read_text())
    if args.max_steps:
        stage_config["training"]["max_steps"] = args.max_steps
        stage_config["training"]["warmup_steps"] = min(stage_config["training"]["warmup_steps"], args.max_steps // 10)
    rows = load_rows(root / "tool_data", split="test")[:args.limit]
    results: dict[str, list[dict]] = {"code model (before SFT)": [evaluate(code, rows, args.max_new_tokens)]}
    seconds: dict[str, list[float]] = {}
    work = Path(args.work)
    for seed in args.seeds:
        for start, label in (("pretrained", "SFT from the code model"), ("scratch", "SFT from random weights")):
            name = f"{start}-seed{seed}"
            if (work / name).exists():
                raise SystemExit(f"{work / name} exists: remove {work} or pass --work DIR")
            ckpt, took = fine_tune(work, name, stage_config, seed, start, code)
            results.setdefault(label, []).append(evaluate(ckpt, rows, args.max_new_tokens))
            seconds.setdefault(label, []).append(took)
            print(f"{label}, seed {seed}: " + ", ".join(f"{m} {results[label][-1][m]}" for m in METRICS), flush=True)

    def cell(values: list) -> str:
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"

    print(f"\nheld-out tool calls ({len(rows)} test rows; mean ± sd over seeds {args.seeds}; "
          f"{stage_config['training']['max_steps']} SFT steps)")
    print(f"{'metric':<24}" + "".join(f"{label:>28}" for label in results))
    for metric in METRICS:
        print(f"{metric:<24}" + "".join(f"{cell([r[metric] for r in runs]):>28}" for runs in results.values()))
    for label, took in seconds.items():
        print(f"{label}: {statistics.mean(took):.0f} s per run")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
