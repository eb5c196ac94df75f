"""Does post-training help? DPO, GRPO and PPO from one SFT model, held-out tool-call figures over seeds,
with the KL to the starting model beside them.

Starting from the tiny pipeline's tool model (`lmforge pipeline run code_assistant_tiny`: its `tools`
stage, with the `tool_data`, `preferences` and `reward` stages' outputs), each method trains for a
fixed number of steps with each seed; each result is scored on the held-out test rows of the
tool-calling set (greedy, through the server's parser: the same figures as `lmforge eval --tool-calls`),
and its KL to the SFT model is estimated on held-out prompts (replies sampled from the trained model
at temperature 1; KL = mean over replies of the summed log-ratio, the k1 estimator). The SFT model
itself is the baseline row. A method whose training reward rises while these held-out figures fall
is reward hacking; the table shows both.

    lmforge pipeline run code_assistant_tiny --out-dir runs/pipe
    OMP_NUM_THREADS=2 python benchmarks/posttrain_proof.py --pipeline runs/pipe --seeds 0 1 2 \
        --json benchmarks/results/posttrain_proof.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

FIGURES = ("parse_rate", "tool_name_acc", "exact_args", "arg_f1", "abstention", "answer_mentions_result")


def method_values(method: str, seed: int, sft: Path, pipe: Path, out: Path, args) -> dict:
    common = {"name": f"{method}_s{seed}", "out_dir": str(out), "seed": seed,
              "logging": {"tensorboard": False, "progress_bar": False}}
    training = {"init_from": str(sft), "device": "cpu", "precision": "fp32", "peak_flops": 1e12, "warmup_steps": 0,
                "save_interval": 0, "eval_interval": 0, "schedule": "constant"}
    if method == "dpo":
        return {**common, "kind": "dpo", "recipe": {"beta": args.dpo_beta},
                "data": {"train_path": str(pipe / "preferences"), "seq_len": 2048},  # both sides in a row
                "training": {**training, "max_steps": args.dpo_steps, "micro_batch_size": 4, "lr": args.dpo_lr}}
    if method == "grpo":
        return {**common, "kind": "grpo",
                "recipe": {"rewards": ["tool_call"], "group_size": 8, "prompts_per_rollout": 4, "max_new_tokens": 64,
                           "temperature": 0.7, "beta": 0.04},
                "data": {"train_path": str(pipe / "tool_data"), "seq_len": 1024},
                "training": {**training, "max_steps": args.grpo_steps, "micro_batch_size": 32, "lr": args.grpo_lr}}
    if method in ("ppo", "ppo_rm"):
        recipe = {"prompts_per_rollout": 32, "ppo_epochs": 2, "max_new_tokens": 64, "temperature": 0.7,
                  "kl_coef": 0.02}
        if method == "ppo":
            recipe["rewards"] = ["tool_call"]
        else:
            recipe["reward_model"] = str(pipe / "reward")
        return {**common, "kind": "ppo", "recipe": recipe,
                "data": {"train_path": str(pipe / "tool_data"), "seq_len": 1024},
                "training": {**training, "max_steps": args.ppo_steps, "micro_batch_size": 16, "lr": args.ppo_lr}}
    raise ValueError(method)


@torch.no_grad()
def kl_to(policy, reference, prompts: list[list[int]], eos_id: int, seed: int, max_new_tokens: int = 64) -> float:
    """Mean over held-out prompts of sum_t log pi(y_t) - log ref(y_t), replies sampled from pi at T=1."""
    from lmforge.posttrain.logprobs import token_logprobs
    from lmforge.posttrain.rollout import (
        completion_seed,
        pack_sequences,
        per_sequence,
        sample,
    )

    seeds = [completion_seed(seed, 99, i) for i in range(len(prompts))]
    done = sample(policy, prompts, eos_id, max_new_tokens, temperature=1.0, seeds=seeds)
    completions = [c.tokens + [eos_id] if c.ended else c.tokens for c in done]
    total = []
    for start in range(0, len(prompts), 16):
        batch = pack_sequences(prompts[start:start + 16], completions[start:start + 16], 1024)
        lp = per_sequence(token_logprobs(policy, batch), batch)
        lr = per_sequence(token_logprobs(reference, batch), batch)
        total += [float(a.sum() - b.sum()) for a, b in zip(lp, lr)]
    return statistics.fmean(total)


def score(model_dir: Path, sft, tokenizer, rows, prompts, seed: int) -> dict:
    from lmforge.models import load_model
    from lmforge.posttrain.toolcalls import evaluate_tool_calls

    model = load_model(model_dir).eval()
    figures = evaluate_tool_calls(model, tokenizer, rows, max_new_tokens=64, progress=False)
    out = {k: figures[k] for k in FIGURES}
    out["kl"] = kl_to(model, sft, prompts, tokenizer.eos_id, seed)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True, help="the tiny pipeline's output directory")
    p.add_argument("--methods", nargs="+", default=["dpo", "grpo", "ppo", "ppo_rm"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--limit", type=int, default=100, help="held-out test rows scored")
    p.add_argument("--dpo-steps", type=int, default=100)
    p.add_argument("--dpo-lr", type=float, default=2e-5)
    p.add_argument("--dpo-beta", type=float, default=0.1)
    p.add_argument("--grpo-steps", type=int, default=30)
    p.add_argument("--grpo-lr", type=float, default=2e-5)
    p.add_argument("--ppo-steps", type=int, default=32)
    p.add_argument("--ppo-lr", type=float, default=2e-5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    from lmforge.checkpoint import resolve_model_dir
    from lmforge.config import load_config
    from lmforge.infer.loading import find_tokenizer
    from lmforge.models import load_model
    from lmforge.posttrain.rollout import encode_prompt
    from lmforge.posttrain.toolcalls import load_rows
    from lmforge.tokenizer import Tokenizer
    from lmforge.train import train

    pipe = Path(args.pipeline)
    sft_dir = resolve_model_dir(pipe / "tools")
    tokenizer = Tokenizer.load(find_tokenizer(sft_dir))
    sft = load_model(sft_dir).eval()
    rows = load_rows(pipe / "tool_data", "test")[:args.limit]
    prompts = [encode_prompt(tokenizer, r) for r in rows]
    results: dict[str, list[dict]] = {"sft": [score(sft_dir, sft, tokenizer, rows, prompts, 0)]}
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            for seed in args.seeds:
                cfg = load_config(values=method_values(method, seed, sft_dir, pipe, Path(tmp), args))
                t0 = time.perf_counter()
                result = train(cfg)
                seconds.setdefault(method, []).append(time.perf_counter() - t0)
                figures = score(result.last_checkpoint, sft, tokenizer, rows, prompts, seed)
                results.setdefault(method, []).append(figures)
                print(f"{method} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)

    print(f"\nheld-out tool calls ({len(rows)} test rows, greedy), mean ± std over seeds {args.seeds}; KL to the SFT model")
    print(f"{'method':<8} " + " ".join(f"{k:>22}" for k in (*FIGURES, "kl")) + f" {'train s':>8}")
    for method, runs in results.items():
        cells = []
        for k in (*FIGURES, "kl"):
            vals = [r[k] for r in runs if r[k] is not None]
            if not vals:
                cells.append(f"{'-':>22}")
                continue
            sd = statistics.pstdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.fmean(vals):>15.3f} ± {sd:.3f}")
        t = statistics.fmean(seconds[method]) if method in seconds else 0.0
        print(f"{method:<8} " + " ".join(cells) + f" {t:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "results": results, "seconds": seconds},
                                              indent=2))


if __name__ == "__main__":
    main()
