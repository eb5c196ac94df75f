"""What the side-by-side benchmarks against TRL share: the CPU's name for the record, and the seeded
llama checkpoint (with its own tokenizer and HF export) both systems start from.

The scripts import it as ``common`` (``python benchmarks/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name and whether it has bf16 units (which decide lmforge's precision=auto)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in text.splitlines():
        if line.startswith("model name"):
            bf16 = "avx512_bf16" in text or "amx_bf16" in text
            return f"{line.split(':', 1)[1].strip()} ({'bf16 units' if bf16 else 'no bf16 units'})"
    return platform.processor() or "unknown CPU"


def seeded_checkpoint(work: Path, texts: list[str], args) -> tuple[Path, Path]:
    """A tokenizer trained on ``texts`` (``args.vocab`` entries) and a freshly seeded llama-flavor model
    of ``args.layers`` x ``args.width`` with context ``args.seq_len``: lmforge's checkpoint directory
    and its HF export, the same weights on both sides."""
    from lmforge.export.hf import export_hf
    from lmforge.models.gpt import GPT, GPTConfig
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    tokenizer = Tokenizer.load(train_tokenizer(texts, vocab_size=args.vocab, out_dir=work / "tok", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_layer=args.layers, n_embd=args.width,
                          n_head=args.width // 64, n_inner=4 * args.width, n_positions=args.seq_len,
                          eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id))
    ckpt = model.save_pretrained(work / "ckpt")
    tokenizer.save(ckpt)
    return ckpt, export_hf(ckpt, work / "hf")
