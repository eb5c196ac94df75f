"""A small tool-calling chat model for the post-training tests: generated conversations, a tokenizer
trained on them, and a tiny llama model fine-tuned on them with the sft kind (a few hundred steps:
it has learnt the call format and some tool names, not much more, which leaves room for reward
models, DPO and RL to show an effect)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

SEQ_LEN = 512


def make_tool_sft_checkpoint(base: Path, steps: int = 200, seed: int = 0) -> SimpleNamespace:
    """``base/data`` (train/val/test.jsonl from ``write_tool_call_dataset``), ``base/base`` (the untrained
    model with its tokenizer), ``base/runs/sft`` (the sft run; its final checkpoint is ``.checkpoint``)."""
    from lmforge.chat import render_chat
    from lmforge.config import load_config
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.posttrain.toolcalls import write_tool_call_dataset
    from lmforge.tokenizer import Tokenizer, train_tokenizer
    from lmforge.train import train

    data = base / "data"
    write_tool_call_dataset(data, n_train=400, n_val=40, n_test=60, seed=seed)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    texts = [render_chat(r["messages"], "<s>", "</s>", tools=r["tools"], add_generation_prompt=False) for r in rows]
    tokenizer = Tokenizer.load(train_tokenizer(texts, vocab_size=1024, out_dir=base / "tok", show_progress=False))
    torch.manual_seed(seed)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=2,
                          n_positions=SEQ_LEN, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
                          pad_token_id=tokenizer.pad_id))
    model.save_pretrained(base / "base")
    tokenizer.save(base / "base")
    cfg = load_config(values={
        "kind": "sft", "name": "sft", "out_dir": str(base / "runs"), "seed": seed,
        "data": {"train_path": str(data), "seq_len": SEQ_LEN},
        "training": {"init_from": str(base / "base"), "max_steps": steps, "micro_batch_size": 4, "lr": 3e-3,
                     "warmup_steps": 10, "eval_interval": 0, "save_interval": 0, "device": "cpu",
                     "precision": "fp32", "peak_flops": 1e12},
        "logging": {"tensorboard": False, "progress_bar": False}})
    result = train(cfg)
    return SimpleNamespace(data=data, base=base / "base", run=base / "runs" / "sft",
                           checkpoint=result.last_checkpoint, tokenizer=tokenizer)
