"""GRPO throughput: lmforge's grpo kind against TRL's GRPOTrainer, same model, prompts and reward, one run.

Both improve the same llama-flavor checkpoint (lmforge's own, and its HF export for TRL) on the same
tool-calling prompts (``lmforge data tool-calls``: each row's messages but its last, assistant, turn,
which is the reference reply), scored by the same reward, lmforge's built-in ``tool_call``
(``lmforge.posttrain.rewards``; for TRL it is wrapped in TRL's ``reward_func(prompts, completions,
**kwargs)`` signature and reads the whole row from an extra dataset column, which TRL passes as a
keyword). Same settings on both sides: ``--prompts`` prompts x ``--group`` completions per optimizer
step (one rollout per step, all decoded in one batch), sampled at ``--temperature`` (top-p 1, no top-k)
up to ``--max-new-tokens``, the clipped-ratio loss averaged over the step's completion tokens
(lmforge ``loss_aggregation: token``, TRL ``loss_type="dapo"``), advantages scaled by the group's
std, KL to the frozen starting model at ``--beta`` (both keep a reference copy and run it on every
rollout), one update per rollout (on-policy: neither spends a forward on old log-probs), fp32, AdamW
at the same constant learning rate (no weight decay), gradient norm clipped at 1, ``--micro``
completions per forward and backward (``training.micro_batch_size`` / ``per_device_train_batch_size``,
gradient accumulation making up the rest of the rollout), on this machine's threads.

Generation: lmforge samples with its own KV-cached, continuously batched engine (the server's);
TRL, without vLLM (not on a CPU), with transformers' ``generate`` -- each system's honest default.
The prompts go to TRL as text, rendered with the exported tokenizer's chat template (lmforge's) and
each row's tools, preceded by ``</s>``: the same token ids lmforge prompts with. (TRL 1.16's GRPOTrainer
renders conversational prompts with trainer-wide tool *callables*, not a row's tool schemas, so
conversational rows would have shown the model no tools.) Prompts longer than ``--seq-len`` minus
``--max-new-tokens`` are left out on both sides, as lmforge does. Each system draws its prompts in
its own shuffled order.

Reported per system, over the timed steps (from the end of the last warm-up step to the end of the
last timed step: sampling, reward, reference and policy forwards, backward and optimizer step all
inside): completions per second, and generated tokens per second (each completion's tokens, its
closing eos included). The freshly seeded model writes noise, so nearly every completion runs to
``--max-new-tokens`` on both sides (the "tokens/completion" column shows it), and its only reward is
the credit ``tool_call`` gives any plain, non-empty reply on rows that need no tool (a group mostly
agrees, so most advantages are 0; the work per step is the same): a test of the machinery's speed,
not of learning.

TRL runs without activation checkpointing (``gradient_checkpointing=False``; lmforge does not
checkpoint either) and reports nowhere.

    pip install 'lmforge[bench]'      # TRL
    OMP_NUM_THREADS=2 python benchmarks/grpo_vs_trl.py --steps 10 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import add_model_args, cpu_name, cpu_run, seeded_checkpoint, trl_step_window


def prepare(work: Path, args) -> tuple[Path, Path, Path]:
    """Tool-calling prompts, a tokenizer trained on them, a seeded llama checkpoint and its HF export."""
    from lmforge.chat import render_chat
    from lmforge.posttrain.toolcalls import write_tool_call_dataset

    data = work / "data"
    # No held-out prompts: neither side evaluates here.
    write_tool_call_dataset(data, n_train=args.rows, n_val=0, n_test=0, seed=0)
    (data / "val.jsonl").unlink()  # empty; lmforge refuses an empty file, and reads no val.jsonl as none held out
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    texts = [render_chat(r["messages"], "<s>", "</s>", tools=r["tools"], add_generation_prompt=False) for r in rows]
    ckpt, hf = seeded_checkpoint(work, texts, args)
    return data, ckpt, hf


def run_lmforge(data: Path, ckpt: Path, work: Path, args) -> dict:
    from lmforge.config import load_config
    from lmforge.models.losses import IGNORE_INDEX
    from lmforge.train.loop import Trainer

    per_step = args.prompts * args.group
    cfg = load_config(values={
        "kind": "grpo", "name": "bench", "out_dir": str(work / "runs"),
        "recipe": {"rewards": ["tool_call"], "group_size": args.group, "prompts_per_rollout": args.prompts,
                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": 1.0, "top_k": 0,
                   "beta": args.beta, "epsilon": 0.2, "iterations": 1, "scale_rewards": True,
                   "loss_aggregation": "token", "generation_batch_size": per_step},
        "data": {"train_path": str(data), "seq_len": args.seq_len},
        "training": {"init_from": str(ckpt), "micro_batch_size": args.micro, "grad_accum_steps": per_step // args.micro,
                     "lr": args.lr, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0, "beta2": 0.999,
                     "max_steps": args.warmup + args.steps,
                     "device": "cpu", "precision": "fp32", "peak_flops": 1e12, "grad_clip": 1.0},
        "logging": {"tensorboard": False, "progress_bar": False}})
    model, data_, devinfo, dist = cpu_run(cfg, ckpt)
    trainer = Trainer(cfg, model, data_, devinfo, dist, work / "runs" / "bench")
    loader = data_.train
    seen = {"completions": 0, "tokens": 0, "reward": 0.0, "rollouts": 0}
    draw = loader.next_batch

    def counted():
        batch = draw()
        seen["completions"] += int(batch["num_examples"])
        seen["tokens"] += int((batch["labels"] != IGNORE_INDEX).sum())
        if loader.handed == 1:  # the first micro-batch of a new rollout
            seen["reward"] += batch["rollout_stats"]["reward"]
            seen["rollouts"] += 1
        return batch

    loader.next_batch = counted
    for _ in range(args.warmup):
        trainer.step_once()
    seen.update(completions=0, tokens=0, reward=0.0, rollouts=0)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step_once()
    seconds = time.perf_counter() - t0
    return {"system": "lmforge grpo (KV-cached engine)", "completions_per_s": seen["completions"] / seconds,
            "tokens_per_s": seen["tokens"] / seconds, "completions_per_step": seen["completions"] / args.steps,
            "tokens_per_completion": seen["tokens"] / seen["completions"],
            "reward": seen["reward"] / max(seen["rollouts"], 1), "seconds": seconds, "prompts": len(loader.prompts.ids)}


def trl_rows(data: Path, hf: Path, args) -> list[dict]:
    """TRL's rows: the prompt as text, exactly the ids lmforge prompts with; the whole row for the reward."""
    from transformers import AutoTokenizer

    from lmforge.posttrain.rollout import prompt_messages

    tokenizer = AutoTokenizer.from_pretrained(hf)
    out = []
    for line in (data / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        text = tokenizer.apply_chat_template(prompt_messages(row), tools=row.get("tools") or None,
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.eos_token + text  # lmforge prompts with [eos] + the rendered template
        if len(tokenizer(prompt)["input_ids"]) <= args.seq_len - args.max_new_tokens:
            out.append({"prompt": prompt, "row": json.dumps(row)})  # JSON: datasets would null-fill ragged dicts
    return out


def run_trl(data: Path, hf: Path, work: Path, args) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lmforge.posttrain.rewards import tool_call as lmforge_tool_call

    rows = trl_rows(data, hf, args)
    ds = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    marks: dict[str, float] = {}
    seen = {"completions": 0, "tokens": 0, "reward": 0.0, "rollouts": 0}

    def tool_call(prompts, completions, completion_ids, row, **kwargs):
        """lmforge's tool_call reward in TRL's signature: ``row`` is the dataset column, one per completion."""
        scores = lmforge_tool_call([json.loads(r) for r in row], completions)
        if "t0" in marks and "t1" not in marks:  # a rollout of a timed step (the reward runs inside the step)
            seen["completions"] += len(completions)
            seen["tokens"] += sum(len(ids) for ids in completion_ids)
            seen["reward"] += sum(scores) / len(scores)
            seen["rollouts"] += 1
        return scores


    per_step = args.prompts * args.group
    config = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=args.micro,
                        gradient_accumulation_steps=per_step // args.micro, num_generations=args.group,
                        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
                        beta=args.beta, epsilon=0.2, num_iterations=1, scale_rewards="group", loss_type="dapo",
                        max_steps=args.warmup + args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=10_000,
                        save_strategy="no", report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0,
                        seed=0, disable_tqdm=True, log_completions=False,
                        gradient_checkpointing=False)  # TRL's default is on (saves memory, costs time)
    trainer = GRPOTrainer(model=model, reward_funcs=tool_call, args=config, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[trl_step_window(marks, args.warmup, args.steps)])
    trainer.train()
    seconds = marks["t1"] - marks["t0"]
    return {"system": "TRL GRPOTrainer (transformers generate)", "completions_per_s": seen["completions"] / seconds,
            "tokens_per_s": seen["tokens"] / seconds, "completions_per_step": seen["completions"] / args.steps,
            "tokens_per_completion": seen["tokens"] / seen["completions"],
            "reward": seen["reward"] / max(seen["rollouts"], 1), "seconds": seconds, "prompts": len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--rows", type=int, default=500, help="training prompts written")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (both systems)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (group size / num_generations)")
    p.add_argument("--micro", type=int, default=0,
                   help="completions per forward and backward (default: the whole step, prompts x group)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (> 0: a reference model on both sides)")
    p.add_argument("--lr", type=float, default=1e-5)
    add_model_args(p, 512, "the model's context; prompt + completion must fit")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    per_step = args.prompts * args.group
    args.micro = args.micro or per_step
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the timed window starts at the end of the last warm-up step)")
    if per_step % args.micro:
        p.error(f"--micro {args.micro} must divide the completions per step, --prompts x --group = {per_step}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, ckpt, hf = prepare(work, args)
        results = [run_lmforge(data, ckpt, work, args), run_trl(data, hf, work, args)]
    print(f"\nGRPO throughput, {args.layers}x{args.width} llama, vocab {args.vocab}, {args.prompts} prompts x "
          f"{args.group} completions/step, {args.micro} per forward, up to {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature:g}, beta {args.beta:g}, fp32, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"{'system':<42} {'completions/step':>16} {'tokens/completion':>17} {'completions/s':>13} "
          f"{'gen tokens/s':>12} {'reward':>7}")
    for r in results:
        print(f"{r['system']:<42} {r['completions_per_step']:>16.0f} {r['tokens_per_completion']:>17.1f} "
              f"{r['completions_per_s']:>13.2f} {r['tokens_per_s']:>12,.0f} {r['reward']:>7.3f}")
    print(f"(prompts that fit: {results[0]['prompts']:,} lmforge / {results[1]['prompts']:,} TRL)")
    print(f"lmforge / TRL, completions/s including generation: "
          f"{results[0]['completions_per_s'] / results[1]['completions_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "cpu": cpu_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
