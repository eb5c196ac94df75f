"""SFT throughput: lmforge's sft kind against TRL's SFTTrainer, same model, same conversations, one run.

Both fine-tune the same llama-flavor checkpoint (lmforge's own, and its HF export for TRL) on the same
tool-calling conversations (``lmforge data tool-calls``), loss on the final assistant reply (lmforge
``recipe.assistant_turns=last``; TRL prompt/completion rows, its completion-only loss), fp32, AdamW,
the same micro-batch rows and learning rate, on this machine's threads. Reported per system: real
(non-padding) tokens per second over the timed steps, and the share of the positions the model
computed on that were padding.

TRL runs without activation checkpointing (its default turns it on, which saves memory and costs
time; lmforge does not checkpoint here either), in its default layout (each row one conversation, padded to the longest of its batch) and,
with ``--trl-packing``, in its packed ``bfd`` layout as well (which on CPU, without flash attention's
varlen kernels, lets packed conversations attend to each other: faster, but not the same training).

    pip install 'lmforge[bench]'      # TRL
    python benchmarks/sft_vs_trl.py --steps 30 --warmup 5 --trl-packing
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
    """Tool-calling data, a tokenizer trained on it, a seeded llama checkpoint and its HF export."""
    from lmforge.chat import render_chat
    from lmforge.posttrain.toolcalls import write_tool_call_dataset

    data = work / "data"
    write_tool_call_dataset(data, n_train=args.rows, n_val=50, n_test=50, seed=0)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    texts = [render_chat(r["messages"], "<s>", "</s>", tools=r["tools"], add_generation_prompt=False) for r in rows]
    ckpt, hf = seeded_checkpoint(work, texts, args)
    return data, ckpt, hf


def run_lmforge(data: Path, ckpt: Path, work: Path, args) -> dict:
    from lmforge.config import load_config
    from lmforge.train.loop import Trainer

    cfg = load_config(values={
        "kind": "sft", "name": "bench", "out_dir": str(work / "runs"),
        "recipe": {"assistant_turns": "last", "packing": not args.lmforge_unpacked},
        "data": {"train_path": str(data), "seq_len": args.seq_len},
        "training": {"init_from": str(ckpt), "micro_batch_size": args.lmforge_batch or args.batch, "lr": 1e-4,
                     "warmup_steps": 0,
                     "device": "cpu", "precision": "fp32", "peak_flops": 1e12, "grad_clip": 1.0},
        "logging": {"tensorboard": False, "progress_bar": False}})
    model, data_, devinfo, dist = cpu_run(cfg, ckpt)
    trainer = Trainer(cfg, model, data_, devinfo, dist, work / "runs" / "bench")
    loader = data_.train
    seen = {"real": 0, "positions": 0}
    draw = loader.next_batch

    def counted():
        batch = draw()
        seen["real"] += int((batch["document_ids"] >= 0).sum())
        seen["positions"] += batch["document_ids"].numel()
        return batch

    loader.next_batch = counted
    for _ in range(args.warmup):
        trainer.step_once()
    seen.update(real=0, positions=0)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step_once()
    seconds = time.perf_counter() - t0
    return {"system": "lmforge sft" + (" (unpacked)" if args.lmforge_unpacked else " (packed)"),
            "tokens_per_s": seen["real"] / seconds, "padding": 1 - seen["real"] / seen["positions"],
            "rows_per_step": args.lmforge_batch or args.batch, "seconds": seconds,
            "tokens_per_step": seen["real"] / args.steps}


def run_trl(data: Path, hf: Path, work: Path, args, packing: bool) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    # Prompt/completion in conversational form: TRL renders both with the tokenizer's chat template and
    # computes the loss on the completion only, as lmforge's assistant_turns=last does.
    # The tools travel as a JSON string: as a list of dicts, `datasets` gives every tool the union of all
    # tools' keys (missing ones as null) and TRL's rendered prompts would be longer than lmforge's.
    ds = datasets.Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:],
                                      "tools": json.dumps(r["tools"])} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32, attn_implementation="sdpa")
    marks: dict[str, float] = {}
    counted = {"real": 0, "positions": 0}


    config = SFTConfig(output_dir=str(work / f"trl{int(packing)}"), max_length=args.seq_len,
                       per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps, learning_rate=1e-4,
                       lr_scheduler_type="constant", warmup_steps=0, logging_steps=10_000, save_strategy="no",
                       report_to=[], use_cpu=True, bf16=False, max_grad_norm=1.0, dataloader_num_workers=0,
                       packing=packing, completion_only_loss=True, seed=0, disable_tqdm=True,
                       gradient_checkpointing=False)  # TRL's default is on (saves memory, costs time)
    trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer,
                         callbacks=[trl_step_window(marks, args.warmup, args.steps)])
    step = trainer.training_step

    def counting_step(model_, inputs, *a, **kw):
        # The batches of the timed steps, as each step receives them (transformers collates a step's
        # batches before its callbacks run, so counting in the collator would be off by a step).
        if "t0" in marks and "t1" not in marks:
            if "attention_mask" in inputs:
                counted["real"] += int(inputs["attention_mask"].sum())
            else:  # padding-free packing: every position is a token
                counted["real"] += inputs["input_ids"].numel()
            counted["positions"] += inputs["input_ids"].numel()
        return step(model_, inputs, *a, **kw)

    trainer.training_step = counting_step
    trainer.train()
    seconds = marks["t1"] - marks["t0"]
    return {"system": "TRL SFTTrainer" + (" (packing=bfd, cross-attending)" if packing else " (default, padded)"),
            "tokens_per_s": counted["real"] / seconds, "padding": 1 - counted["real"] / counted["positions"],
            "rows_per_step": args.batch, "seconds": seconds, "tokens_per_step": counted["real"] / args.steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rows", type=int, default=2000, help="training conversations")
    p.add_argument("--batch", type=int, default=8, help="rows per step (both systems)")
    p.add_argument("--lmforge-batch", type=int, default=0, help="lmforge's packed rows per step (default --batch)")
    add_model_args(p, 512)
    p.add_argument("--trl-packing", action="store_true", help="also time TRL's packed (bfd) layout")
    p.add_argument("--lmforge-unpacked", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, ckpt, hf = prepare(work, args)
        results = [run_lmforge(data, ckpt, work, args), run_trl(data, hf, work, args, packing=False)]
        if args.trl_packing:
            results.append(run_trl(data, hf, work, args, packing=True))
    print(f"\nSFT throughput, {args.layers}x{args.width} llama, vocab {args.vocab}, rows of {args.seq_len}, "
          f"{args.batch} rows/step, fp32, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"{'system':<48} {'rows/step':>9} {'tokens/step':>11} {'tokens/s':>10} {'padding':>8}")
    for r in results:
        print(f"{r['system']:<48} {r['rows_per_step']:>9} {r['tokens_per_step']:>11,.0f} {r['tokens_per_s']:>10,.0f} "
              f"{r['padding']:>8.1%}")
    base = results[1]["tokens_per_s"]
    print(f"lmforge / TRL default: {results[0]['tokens_per_s'] / base:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "cpu": cpu_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
