"""Single-stream generation speed: lmforge vs transformers ``generate`` on the same exported model.

For each model size, a seeded random lmforge checkpoint is exported with ``lmforge export --format
hf`` and loaded by ``AutoModelForCausalLM``. Both then greedy-decode ``--new-tokens`` tokens (eos
ignored, so both produce exactly that many) after a ``--prompt-tokens`` prompt, batch 1, with their
KV caches, each run in a fresh process with the same thread settings (two threads' OpenMP pools in
one process slow each other down), in alternating rounds; the median round counts.
Three ways are timed: lmforge's ``generate_tokens`` (``lmforge generate``/``chat``), lmforge's
batching ``Engine`` with one request, on the main thread as ``lmforge serve`` runs it, and transformers
``model.generate(do_sample=False)``; each in fp32 and, where the hardware has bf16 units, with both
models' weights in bf16 (what lmforge's ``--precision auto`` picks there). Usage:

    python benchmarks/generation_speed.py [--sizes tiny,small] [--flavors gpt2,llama] [--rounds 3]
"""

from __future__ import annotations

import argparse
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


def time_engine(model, prompt, n):
    """One request through a fresh ``Engine`` run on this thread, as ``lmforge serve`` runs it."""
    out = []

    def on_event(event):
        if event[0] == "token":
            out.append(event[1])
        else:
            engine.close()  # run() returns

    engine = Engine(model, eos_id=-1, max_batch_size=1, background=False)
    start = time.perf_counter()
    engine.submit(prompt, SamplingParams(n, temperature=0), on_event)
    engine.run()
    assert len(out) == n, len(out)
    return time.perf_counter() - start, out


def time_transformers(hf, prompt, n):
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def worker(system: str, model_dir: str, precision: str, prompt_tokens: int, new_tokens: int) -> None:
    """One timed run in this process: prints tokens/s and the generated ids as JSON."""
    import json

    from lmforge.models import load_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    if system == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir + "-hf", dtype=dtype).eval()
        fn = time_transformers
    else:
        model = load_model(model_dir).eval().to(dtype)
        fn = time_engine if system == "engine" else time_lmforge
    vocab = model.config.vocab_size
    prompt = torch.randint(10, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    fn(model, prompt, 8)  # warm-up
    seconds, out = fn(model, prompt, new_tokens)
    print(json.dumps({"tok_s": new_tokens / seconds, "tokens": out}))


def main() -> None:
    import json
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--flavors", default="gpt2,llama")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("SYSTEM", "MODEL_DIR", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.prompt_tokens, args.new_tokens)
        return
    from lmforge.device import pick_precision

    precisions = ["fp32"] + (["bf16"] if pick_precision("auto", torch.device("cpu")) == "bf16" else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, median of {args.rounds} rounds")
    print("| model | flavor | weights | lmforge generate (tok/s) | lmforge engine (tok/s) | transformers (tok/s) | "
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
                params = sum(p.numel() for p in model.parameters()) / 1e6
                ckpt = model.save_pretrained(tmp / f"{size}-{flavor}")
                tokenizer.save(ckpt)
                export_hf(ckpt, tmp / f"{size}-{flavor}-hf")
                for precision in precisions:
                    runs = {"lmforge": [], "engine": [], "transformers": []}
                    outputs = {}
                    for _ in range(args.rounds):
                        for system in runs:
                            cmd = [sys.executable, __file__, "--worker", system, str(ckpt), precision,
                                   "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
                            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
                            result = json.loads(line.splitlines()[-1])
                            runs[system].append(result["tok_s"])
                            outputs[system] = result["tokens"]
                    speed = {k: statistics.median(v) for k, v in runs.items()}
                    same = outputs["lmforge"] == outputs["engine"] == outputs["transformers"]
                    print(f"| {size} ({params:.0f}M) | {flavor} | {precision} | {speed['lmforge']:,.1f} | "
                          f"{speed['engine']:,.1f} | {speed['transformers']:,.1f} | "
                          f"{speed['lmforge'] / speed['transformers']:.2f}x | "
                          f"{speed['engine'] / speed['transformers']:.2f}x | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
