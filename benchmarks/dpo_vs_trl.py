"""DPO throughput: lmforge's dpo kind against TRL's DPOTrainer, same model, same preference pairs, one run.

Both tune the same llama-flavor checkpoint (lmforge's own, and its HF export for TRL) on the same
synthetic tool-calling preference pairs (``lmforge data preferences``: a message-list prompt, one
chosen and one rejected assistant reply, the tools offered), with the sigmoid DPO loss at the same
beta, fp32, AdamW at the same constant learning rate (no weight decay, TRL's default), gradient norm
clipped at 1, on this machine's threads. The tools go to both sides as data: lmforge renders them
into its chat template's system turn, and TRL's DPOTrainer (1.16 reads a ``tools`` column and passes
it to ``apply_chat_template``) renders them with the same template, exported with the tokenizer. The
tools travel as a JSON string: as a list of dicts, ``datasets`` would give every tool the union of all
tools' keys (missing ones as null) and the rendered prompt would no longer be lmforge's.

A sequence is the same on both sides up to one token at each end: lmforge's starts with ``[eos]`` (as
``lmforge serve`` prompts), TRL's carries the template's newline after the closing eos as a completion
token. The "tokens/pair" column shows both.

How a step is made differs, and is the point: lmforge packs whole pairs (chosen and rejected side by
side, no attention between them) into ``--batch`` rows of ``--seq-len`` tokens (also the model's
context), so the number of pairs per step varies; TRL pads each pair's two sequences to the longest of
its batch (``max_length=--seq-len`` per sequence: nothing is cut). TRL's batch is set to lmforge's
measured mean pairs per step, rounded (``--trl-batch`` overrides), so that both take steps of about the
same size, and the figures compared are rates: pairs per second, and real (non-padding) tokens per
second. A pair whose two sides together exceed a row is left out by lmforge and kept by TRL; the
defaults leave none out, and the output says when some were.

The reference: lmforge's default (``recipe.reference: precompute``) scores every training pair once
before the first step, TRL's default keeps a frozen copy and runs it on every batch. Both are timed
both ways: lmforge with ``reference: live`` and TRL with ``precompute_ref_log_probs=True`` as extra
rows. The one-off pass is reported on its own ("ref pass s", over the training pairs: neither side
has held-out pairs here) and folded into "pairs/s, 1 epoch": the training pairs divided by (that
pass + one epoch at the measured step rate). Loading the models and tokenizing are not timed.

TRL runs without activation checkpointing (``gradient_checkpointing=False``; lmforge does not
checkpoint either), reports nowhere, and its real tokens are counted from the attention masks of the
batches its training steps receive. The timed window of both systems runs from the end of the last
warm-up step to the end of the last timed step, data loading included.

    pip install 'lmforge[bench]'      # TRL
    OMP_NUM_THREADS=2 python benchmarks/dpo_vs_trl.py --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import (
    add_model_args,
    cpu_name,
    cpu_run,
    seeded_checkpoint,
    trl_preference_rows,
    trl_step_window,
)


def prepare(work: Path, args) -> tuple[Path, Path, Path]:
    """Preference pairs, a tokenizer trained on them, a seeded llama checkpoint and its HF export."""
    from lmforge.chat import render_chat
    from lmforge.posttrain.preferences import write_preference_dataset

    data = work / "data"
    # No held-out pairs: neither side evaluates, and lmforge's reference pass scores the training pairs only.
    write_preference_dataset(data, n_train=args.rows, n_val=0, n_test=0, seed=0)
    (data / "val.jsonl").unlink()  # empty: no val.jsonl means no held-out pairs
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    texts = [render_chat(r["prompt"] + r[side], "<s>", "</s>", tools=r["tools"], add_generation_prompt=False)
             for r in rows for side in ("chosen", "rejected")]
    ckpt, hf = seeded_checkpoint(work, texts, args)
    return data, ckpt, hf


def amortised(pairs_per_s: float, n_pairs: int, setup_s: float) -> float:
    """Pairs per second over one epoch of ``n_pairs`` at ``pairs_per_s``, with a one-off ``setup_s`` added."""
    return n_pairs / (setup_s + n_pairs / pairs_per_s)


def run_lmforge(data: Path, ckpt: Path, work: Path, args, reference: str) -> dict:
    import lmforge.recipes.dpo.reference as dpo_reference
    from lmforge.config import load_config
    from lmforge.train.loop import Trainer

    cfg = load_config(values={
        "kind": "dpo", "name": f"bench_{reference}", "out_dir": str(work / "runs"),
        "recipe": {"beta": args.beta, "reference": reference},
        "data": {"train_path": str(data), "seq_len": args.seq_len},
        "training": {"init_from": str(ckpt), "micro_batch_size": args.batch, "lr": args.lr, "warmup_steps": 0,
                     "schedule": "constant", "weight_decay": 0.0, "beta2": 0.999,
                     "max_steps": args.warmup + args.steps,
                     "device": "cpu", "precision": "fp32", "peak_flops": 1e12, "grad_clip": 1.0},
        "logging": {"tensorboard": False, "progress_bar": False}})
    model, data_, devinfo, dist = cpu_run(cfg, ckpt)

    # The reference pass runs while the Trainer is built (TrainData.bind_model): time it per split.
    passes: dict[str, float] = {}
    score_all = dpo_reference.precompute_reference_logps

    def timed_pass(reference_model, store, seq_len, micro_batch_size, devinfo_, distinfo, desc, progress):
        t0 = time.perf_counter()
        table = score_all(reference_model, store, seq_len, micro_batch_size, devinfo_, distinfo, desc, progress)
        passes[desc] = time.perf_counter() - t0
        return table

    dpo_reference.precompute_reference_logps = timed_pass
    try:
        trainer = Trainer(cfg, model, data_, devinfo, dist, work / "runs" / f"bench_{reference}")
    finally:
        dpo_reference.precompute_reference_logps = score_all
    loader = data_.train
    n_pairs = len(loader.store)
    seen = {"pairs": 0, "real": 0, "positions": 0}
    draw = loader.next_batch

    def counted():
        batch = draw()
        seen["pairs"] += int(batch["num_examples"])
        seen["real"] += int((batch["document_ids"] >= 0).sum())
        seen["positions"] += batch["document_ids"].numel()
        return batch

    loader.next_batch = counted
    for _ in range(args.warmup):
        trainer.step_once()
    seen.update(pairs=0, real=0, positions=0)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step_once()
    seconds = time.perf_counter() - t0
    pairs_per_s = seen["pairs"] / seconds
    ref_s = sum(passes.values())  # the training pairs: there are no held-out ones
    return {"system": f"lmforge dpo (reference {reference}, packed)", "pairs_per_s": pairs_per_s,
            "tokens_per_s": seen["real"] / seconds, "padding": 1 - seen["real"] / seen["positions"],
            "pairs_per_step": seen["pairs"] / args.steps, "tokens_per_pair": seen["real"] / seen["pairs"],
            "seconds": seconds, "train_pairs": n_pairs, "ref_pass_s": ref_s,
            "epoch_pairs_per_s": amortised(pairs_per_s, n_pairs, ref_s)}


def run_trl(data: Path, hf: Path, work: Path, args, batch: int, precompute: bool) -> dict:
    from trl import DPOConfig, DPOTrainer

    # Conversational rows: TRL renders prompt, prompt + chosen and prompt + rejected with the tokenizer's chat
    # template (lmforge's, exported) and the row's tools, and scores the replies' tokens.
    ds, tokenizer, model = trl_preference_rows(data, hf)
    marks: dict[str, float] = {}
    counted = {"pairs": 0, "real": 0, "positions": 0}
    passes: dict[str, float] = {}


    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            passes[name] = time.perf_counter() - t0
            return out

    config = DPOConfig(output_dir=str(work / f"trl{int(precompute)}"), max_length=args.seq_len, beta=args.beta,
                       loss_type=["sigmoid"], per_device_train_batch_size=batch,
                       max_steps=args.warmup + args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                       warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=10_000, save_strategy="no",
                       report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True,
                       precompute_ref_log_probs=precompute,
                       gradient_checkpointing=False)  # TRL's default is on (saves memory, costs time)
    trainer = TimedDPOTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer,
                              callbacks=[trl_step_window(marks, args.warmup, args.steps)])
    n_pairs = len(trainer.train_dataset)
    step = trainer.training_step

    def counting_step(model_, inputs, *a, **kw):
        if "t0" in marks and "t1" not in marks:  # the batches of the timed steps, as the step receives them
            mask = inputs["attention_mask"]
            counted["pairs"] += mask.shape[0] // 2  # chosen rows, then rejected rows
            counted["real"] += int(mask.sum())
            counted["positions"] += mask.numel()
        return step(model_, inputs, *a, **kw)

    trainer.training_step = counting_step
    trainer.train()
    seconds = marks["t1"] - marks["t0"]
    pairs_per_s = counted["pairs"] / seconds
    ref_s = passes.get("train", 0.0)
    return {"system": "TRL DPOTrainer (" + ("precompute_ref_log_probs" if precompute else "default, live reference")
            + ", padded)", "pairs_per_s": pairs_per_s, "tokens_per_s": counted["real"] / seconds,
            "padding": 1 - counted["real"] / counted["positions"], "pairs_per_step": counted["pairs"] / args.steps,
            "tokens_per_pair": counted["real"] / counted["pairs"], "seconds": seconds, "train_pairs": n_pairs,
            "ref_pass_s": ref_s, "epoch_pairs_per_s": amortised(pairs_per_s, n_pairs, ref_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (at least 1)")
    p.add_argument("--rows", type=int, default=1000, help="training preference pairs")
    p.add_argument("--batch", type=int, default=4, help="lmforge's packed rows per step")
    p.add_argument("--trl-batch", type=int, default=0,
                   help="TRL's pairs per step (default: lmforge's measured mean pairs per step, rounded)")
    add_model_args(p, 1024, "lmforge's row (holds a pair's two sides); TRL's max_length per sequence")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-live", action="store_true", help="skip lmforge's reference: live row")
    p.add_argument("--no-trl-precompute", action="store_true", help="skip TRL's precompute_ref_log_probs row")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the timed window starts at the end of the last warm-up step)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, ckpt, hf = prepare(work, args)
        ours = run_lmforge(data, ckpt, work, args, "precompute")
        results = [ours]
        if not args.no_live:
            results.append(run_lmforge(data, ckpt, work, args, "live"))
        trl_batch = args.trl_batch or max(1, round(ours["pairs_per_step"]))
        trl_default = run_trl(data, hf, work, args, trl_batch, precompute=False)
        results.append(trl_default)
        trl_pre = None
        if not args.no_trl_precompute:
            trl_pre = run_trl(data, hf, work, args, trl_batch, precompute=True)
            results.append(trl_pre)
    print(f"\nDPO throughput, {args.layers}x{args.width} llama, vocab {args.vocab}, beta {args.beta:g}, "
          f"lmforge {args.batch} rows of {args.seq_len}/step, TRL {trl_batch} pairs/step, fp32, "
          f"{torch.get_num_threads()} threads, {cpu_name()}")
    skipped = ours["train_pairs"] < args.rows
    print(f"{'system':<58} {'pairs/step':>10} {'tokens/pair':>11} {'pairs/s':>8} {'tokens/s':>9} {'padding':>8} "
          f"{'ref pass s':>10} {'pairs/s, 1 epoch':>16}")
    for r in results:
        ref = f"{r['ref_pass_s']:.1f}" if r["ref_pass_s"] else "-"
        print(f"{r['system']:<58} {r['pairs_per_step']:>10.1f} {r['tokens_per_pair']:>11.0f} {r['pairs_per_s']:>8.2f} "
              f"{r['tokens_per_s']:>9,.0f} {r['padding']:>8.1%} {ref:>10} {r['epoch_pairs_per_s']:>16.2f}")
    print(f"(1 epoch = {ours['train_pairs']:,} lmforge / {trl_default['train_pairs']:,} TRL training pairs)")
    if skipped:
        print(f"note: lmforge kept {ours['train_pairs']:,} of {args.rows:,} pairs (longer than --seq-len on their two "
              "sides together); raise --seq-len to train on all of them")
    base = trl_default["pairs_per_s"]
    print(f"lmforge (precompute) / TRL default, pairs/s over the steps: {ours['pairs_per_s'] / base:.2f}x; "
          f"over one epoch, reference pass included: {ours['epoch_pairs_per_s'] / trl_default['epoch_pairs_per_s']:.2f}x")
    if not args.no_live:
        print(f"lmforge (live) / TRL default (both run the reference every step): "
              f"{results[1]['pairs_per_s'] / base:.2f}x")
    if trl_pre is not None:
        print(f"lmforge (precompute) / TRL precompute_ref_log_probs: {ours['pairs_per_s'] / trl_pre['pairs_per_s']:.2f}x "
              f"over the steps, {ours['epoch_pairs_per_s'] / trl_pre['epoch_pairs_per_s']:.2f}x over one epoch")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "trl_batch": trl_batch, "cpu": cpu_name(),
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
