"""The grpo kind's command line: `lmforge eval CKPT --rewards NAMES --prompts PATH`, the held-out reward
of a checkpoint's greedy replies, and of the model before fine-tuning (`--baseline`, by default the
run's training.init_from), to see what training changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from lmforge.checkpoint import fine_tuned_from, run_values
from lmforge.cli_common import BASELINE, check_reply_tokens
from lmforge.errors import LMForgeError

DEFAULT_REPLY_TOKENS = 64


def add_eval_args(group) -> None:
    group.add_argument("--rewards", default=None, metavar="NAMES",
                       help="reward functions, comma-separated: built-ins (tool_call, exact_match, go_parses, "
                            "go_builds, go_vet, reward_model:PATH) or module:function")
    group.add_argument("--prompts", default=None, metavar="PATH",
                       help="held-out prompt rows: a .jsonl file, or a directory's SPLIT.jsonl (--split, default "
                            "test)")


def _run_reply_tokens(checkpoint: str) -> int:
    """The held-out reply length the checkpoint's run evaluated with, if its config says."""
    recipe = run_values(checkpoint).get("recipe") or {}
    return int(recipe.get("eval_max_new_tokens") or recipe.get("max_new_tokens") or DEFAULT_REPLY_TOKENS)


def score_checkpoint(path: str, rows: list[dict], rewards, max_new_tokens: int, batch_size: int,
                     device: str) -> dict[str, float]:
    """Mean rewards of a checkpoint's greedy replies to ``rows`` (prompts that do not fit its context with
    the reply are left out and counted)."""
    from lmforge.infer.loading import load_for_inference
    from lmforge.posttrain.rollout import encode_prompt, sample

    model, tokenizer, dev = load_for_inference(path, device=device)
    rewards.to(dev)
    ids = [encode_prompt(tokenizer, row) for row in rows]
    fits = [i for i, p in enumerate(ids) if len(p) + max_new_tokens <= model.config.n_positions]
    if not fits:
        raise LMForgeError(f"no prompt fits the context of {path} ({model.config.n_positions} tokens) with "
                           f"{max_new_tokens} reply tokens; lower --max-new-tokens")
    done = sample(model, [ids[i] for i in fits], tokenizer.eos_id, max_new_tokens, temperature=0,
                  batch_size=batch_size)
    scores = rewards.score([rows[i] for i in fits], [tokenizer.decode(c.tokens) for c in done])
    out = {"reward": float(rewards.total(scores).mean())}
    out.update({f"reward/{label}": float(scores[:, j].mean()) for j, label in enumerate(rewards.labels)})
    out.update(eos_rate=float(np.mean([c.ended for c in done])), rows=len(fits), too_long=len(rows) - len(fits))
    return out


def run_eval(args) -> int:
    from lmforge.posttrain.rewards import load_rewards
    from lmforge.posttrain.rollout import read_prompt_rows

    if not args.rewards or not args.prompts:
        raise LMForgeError("pass --rewards NAMES and --prompts PATH to score a checkpoint's replies, e.g. "
                           "--rewards tool_call --prompts DIR (its test.jsonl)")
    reply_tokens = check_reply_tokens(args.max_new_tokens) or _run_reply_tokens(args.checkpoint)
    rewards = load_rewards([name.strip() for name in args.rewards.split(",") if name.strip()], where="--rewards")
    path = Path(args.prompts)
    rows = read_prompt_rows(path / f"{args.split or 'test'}.jsonl" if path.is_dir() else path)
    if args.limit:
        rows = rows[:args.limit]
    rewards.check(rows)  # a reward that cannot score these rows fails before any model is loaded
    models = {"checkpoint": args.checkpoint}
    baseline = None if args.no_baseline else (args.baseline or fine_tuned_from(args.checkpoint))
    if baseline:
        models[BASELINE] = baseline
    results = {}
    for label, checkpoint in models.items():
        print(f"{label}: {checkpoint}", file=sys.stderr)
        results[label] = score_checkpoint(checkpoint, rows, rewards, reply_tokens, args.batch_size or 64,
                                          args.device)
    if args.json:
        print(json.dumps(results))
        return 0
    keys = list(next(iter(results.values())))
    width = max(len(k) for k in keys)
    print(f"{'metric':<{width}}  " + "  ".join(f"{label:>12}" for label in results))
    for key in keys:
        cells = [results[label][key] for label in results]
        print(f"{key:<{width}}  " + "  ".join(f"{c:>12.4f}" if isinstance(c, float) else f"{c:>12}" for c in cells))
    return 0
