"""Single-stream generation speed: lmforge vs transformers ``generate`` on the same exported model.

For each model size, a seeded random lmforge checkpoint is exported with ``lmforge export --format
hf`` and loaded by ``AutoModelForCausalLM``. Both then greedy-decode ``--new-tokens`` tokens (eos
ignored, so both produce exactly that many) after a ``--prompt-tokens`` prompt, batch 1, with their
KV caches, in the same process and thread settings, in alternating rounds; the median round counts.
Three ways are timed: lmforge's ``generate_tokens`` (``lmforge generate``), lmforge's batching
``Engine`` with one request (``lmforge serve``/``chat``), and transformers
``model.generate(do_sample=False)``; each in fp32 and, where the hardware has bf16 units, with both
models' weights in bf16 (what lmforge's ``--precision auto`` picks there). Usage:

    python benchmarks/generation_speed.py [--sizes tiny,small] [--flavors gpt2,llama] [--rounds 3]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmforge.export import export_hf
from lmforge.infer.engine import Engine, SamplingParams
from lmforge.infer.generate import generate_tokens
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import train_tokenizer

SIZES = {  # (layers, width, heads, context, vocab)
    "tiny": (3, 192, 3, 256, 4096),  # go_coder_tiny, the quickstart's model
    "small": (12, 768, 12, 1024, 50257),  # GPT-2 124M, seed 001's model
}


def time_lmforge(model, prompt, n):
    start = time.perf_counter()
    out = list(generate_tokens(model, prompt, n, temperature=0, stop_at_eos=False))
    assert len(out) == n
    return time.perf_counter() - start, out


def time_engine(engine, prompt, n):
    events: queue.Queue = queue.Queue()
    start = time.perf_counter()
    engine.submit(prompt, SamplingParams(n, temperature=0), events.put)
    out = []
    while True:
        kind, value = events.get()
        if kind == "token":
            out.append(value)
        else:
            break
    assert len(out) == n, (kind, value, len(out))
    return time.perf_counter() - start, out


def time_transformers(hf, prompt, n):
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--flavors", default="gpt2,llama")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from lmforge.train.device import pick_precision

    precisions = ["fp32"] + (["bf16"] if pick_precision("auto", torch.device("cpu")) == "bf16" else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, median of {args.rounds} rounds")
    print(f"| model | flavor | weights | lmforge generate (tok/s) | lmforge engine (tok/s) | transformers (tok/s) | "
          "generate vs transformers | engine vs transformers | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(["package main\n\nfunc main() {}\n"] * 50, 300, tmp / "tok", show_progress=False)
        from lmforge.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tmp / "tok")
        for size in args.sizes.split(","):
            layers, width, heads, ctx, vocab = SIZES[size]
            for flavor in args.flavors.split(","):
                torch.manual_seed(0)
                model = GPT(GPTConfig(flavor=flavor, vocab_size=vocab, n_positions=ctx, n_embd=width,
                                      n_layer=layers, n_head=heads)).eval()
                ckpt = model.save_pretrained(tmp / f"{size}-{flavor}")
                tokenizer.save(ckpt)
                hf_dir = export_hf(ckpt, tmp / f"{size}-{flavor}-hf")
                prompt = torch.randint(10, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
                params = sum(p.numel() for p in model.parameters()) / 1e6
                for precision in precisions:
                    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
                    ours = model.to(dtype)
                    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
                    engine = Engine(ours, eos_id=-1, max_batch_size=1)
                    systems = (("lmforge", time_lmforge, ours), ("engine", time_engine, engine),
                               ("transformers", time_transformers, hf))
                    runs = {name: [] for name, _, _ in systems}
                    outputs = {}
                    for name, fn, m in systems:
                        fn(m, prompt, 8)  # warm-up
                    for _ in range(args.rounds):
                        for name, fn, m in systems:
                            seconds, outputs[name] = fn(m, prompt, args.new_tokens)
                            runs[name].append(args.new_tokens / seconds)
                    engine.close()
                    speed = {k: statistics.median(v) for k, v in runs.items()}
                    same = outputs["lmforge"] == outputs["engine"] == outputs["transformers"]
                    print(f"| {size} ({params:.0f}M) | {flavor} | {precision} | {speed['lmforge']:,.1f} | "
                          f"{speed['engine']:,.1f} | {speed['transformers']:,.1f} | "
                          f"{speed['lmforge'] / speed['transformers']:.2f}x | "
                          f"{speed['engine'] / speed['transformers']:.2f}x | {'yes' if same else 'no'} |", flush=True)
                    del hf


if __name__ == "__main__":
    main()
