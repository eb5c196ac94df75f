"""Single-stream generation speed: lmforge vs transformers ``generate`` on the same exported model, and
lmforge's int8 weights (``--quantize int8``) beside fp32 and bf16.

For each model size, a seeded random lmforge checkpoint is exported with ``lmforge export --format
hf`` and loaded by ``AutoModelForCausalLM``. Both then greedy-decode ``--new-tokens`` tokens (eos
ignored, so both produce exactly that many) after a ``--prompt-tokens`` prompt, batch 1, with their
KV caches, each run in a fresh process with the same thread settings (two threads' OpenMP pools in
one process slow each other down), in alternating rounds; the median round counts.
Three ways are timed: lmforge's ``generate_tokens`` (``lmforge generate``/``chat``), lmforge's
batching ``Engine`` with one request, on the main thread as ``lmforge serve`` runs it, and transformers
``model.generate(do_sample=False)``; each in fp32 and, where the hardware has bf16 units, with both
models' weights in bf16 (what lmforge's ``--precision auto`` picks there). ``int8`` is lmforge alone
with ``lmforge.infer.quantize.quantize_int8`` (what ``--quantize int8`` loads: int8 weights, activations
in the ``--precision auto`` dtype); a second table puts the three precisions side by side.

Quality of int8 (``--quality``, on by default): random weights say nothing about it, so for each size
a model is trained for ``--train-seconds`` on part of the Python standard library's sources (a BPE
tokenizer of the size's vocabulary trained on the same files), then scored on other files of it:
held-out bits per byte of the bf16 and int8 models (and fp32), and the fraction of ``--prompts`` held-out
prompts whose ``--greedy-tokens`` greedy tokens are identical in int8 and bf16. Usage:

    python benchmarks/generation_speed.py [--sizes tiny,small] [--flavors gpt2,llama] [--rounds 3]
        [--precisions fp32,bf16,int8] [--no-quality] [--train-seconds tiny=120,small=600]
    python benchmarks/generation_speed.py --batch 32 --no-quality [--sizes small] [--flavors gpt2]
    python benchmarks/generation_speed.py --device cuda --no-quality --sizes small [--batch 32]

``--device`` (default cpu) runs every timed worker there, lmforge and transformers alike; the quality
table always runs on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmforge.export import export_hf
from lmforge.infer.engine import Engine, SamplingParams
from lmforge.infer.generate import generate_tokens
from lmforge.infer.quantize import quantize_int8, quantized_bytes
from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import train_tokenizer

SIZES = {  # (layers, width, heads, context, vocab)
    "tiny": (3, 192, 3, 256, 4096),  # go_coder_tiny, the quickstart's model
    "small": (12, 768, 12, 1024, 50257),  # GPT-2 124M, seed 001's model
}


def _wait(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timing ends when the work does."""
    from lmforge.device import _sync

    _sync(device)


def time_lmforge(model, prompt, n):
    device = next(model.parameters()).device
    _wait(device)
    start = time.perf_counter()
    out = list(generate_tokens(model, prompt, n, temperature=0, stop_at_eos=False))
    assert len(out) == n
    _wait(device)
    return time.perf_counter() - start, out


def time_engine(model, prompt, n, batch=1):
    """``batch`` requests (the prompt with its last token varied) decoded together by a fresh ``Engine``
    run on this thread, as ``lmforge serve`` runs it; returns the seconds and the first one's tokens."""
    out = [[] for _ in range(batch)]
    left = [batch]

    def on_event(i, event):
        if event[0] == "token":
            out[i].append(event[1])
        else:
            left[0] -= 1
            if not left[0]:
                engine.close()  # run() returns

    engine = Engine(model, eos_id=-1, max_batch_size=batch, background=False)
    device = next(model.parameters()).device
    _wait(device)
    start = time.perf_counter()
    for i in range(batch):
        engine.submit(prompt[:-1] + [prompt[-1] + i], SamplingParams(n, temperature=0),
                      lambda e, i=i: on_event(i, e))
    engine.run()
    _wait(device)
    assert all(len(o) == n for o in out), [len(o) for o in out]
    return time.perf_counter() - start, out[0]


def time_transformers(hf, prompt, n):
    ids = torch.tensor([prompt], device=hf.device)
    _wait(hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    _wait(hf.device)
    assert out.shape[1] == len(prompt) + n
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def auto_dtype(device: str = "cpu") -> torch.dtype:
    """The activations' dtype ``--precision auto`` picks on ``device`` (what ``--quantize int8`` computes in)."""
    from lmforge.device import pick_precision

    return torch.bfloat16 if pick_precision("auto", torch.device(device)) == "bf16" else torch.float32


def as_precision(model, precision: str, device: str = "cpu"):
    """An fp32 lmforge model as ``lmforge generate --precision P`` / ``--quantize int8`` loads it on ``device``."""
    model = model.to(device)
    if precision == "int8":
        return quantize_int8(model, auto_dtype(device))
    return model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])


def worker(system: str, model_dir: str, precision: str, prompt_tokens: int, new_tokens: int, batch: int = 1,
           device: str = "cpu") -> None:
    """One timed run in this process: prints tokens/s and the generated ids as JSON."""
    import json

    from lmforge.models import load_model

    if system == "transformers":
        from transformers import AutoModelForCausalLM

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        model = AutoModelForCausalLM.from_pretrained(model_dir + "-hf", dtype=dtype).to(device).eval()
        fn = time_transformers
    else:
        model = as_precision(load_model(model_dir).eval(), precision, device)
        fn = time_engine if system == "engine" else time_lmforge
    vocab = model.config.vocab_size
    prompt = torch.randint(10, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    if batch > 1:
        fn = functools.partial(time_engine, batch=batch)
    fn(model, prompt, 8)  # warm-up
    seconds, out = fn(model, prompt, new_tokens)
    print(json.dumps({"tok_s": batch * new_tokens / seconds, "tokens": out}))


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--flavors", default="gpt2,llama")
    parser.add_argument("--precisions", default="fp32,bf16,int8", help="bf16 only runs on CPUs with bf16 units")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-speed", action="store_true", help="only the quality of int8")
    parser.add_argument("--no-quality", action="store_true", help="only the speed")
    parser.add_argument("--train-seconds", default="tiny=120,small=600", help="training time of each size's "
                        "quality model")
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts for the greedy agreement")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--eval-tokens", default="tiny=200000,small=30000", help="held-out tokens scored per size")
    parser.add_argument("--batch", type=int, default=1, help="above 1: only the engine's tokens/s with this many "
                        "requests decoding together (greedy), per precision")
    parser.add_argument("--device", default="cpu", help="where the timed runs decode: cpu, cuda, cuda:N or mps")
    parser.add_argument("--worker", nargs=3, metavar=("SYSTEM", "MODEL_DIR", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.prompt_tokens, args.new_tokens, args.batch, args.device)
        return
    from common import cpu_name

    from lmforge.device import pick_device
    from lmforge.errors import LMForgeError

    try:
        pick_device(args.device)  # a clear message for a device this machine does not have
    except LMForgeError as e:
        raise SystemExit(f"--device {args.device}: {e}") from e
    has_bf16 = auto_dtype(args.device) == torch.bfloat16
    precisions = [p for p in args.precisions.split(",") if p != "bf16" or has_bf16]
    where = (torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda")
             else args.device if args.device != "cpu" else cpu_name())
    print(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads; int8 computes in "
          f"{str(auto_dtype(args.device)).replace('torch.', '')}")
    if not args.no_speed:
        (batch_table if args.batch > 1 else speed_tables)(args, precisions)
    if not args.no_quality:
        quality_table(args)


def random_checkpoints(args, tmp: Path):
    """A seeded random checkpoint (with a small tokenizer) per ``--sizes`` x ``--flavors``, written under
    ``tmp``: yields ``(size, flavor, label, checkpoint)``."""
    from lmforge.tokenizer import Tokenizer

    train_tokenizer(["package main\n\nfunc main() {}\n"] * 50, 300, tmp / "tok", show_progress=False)
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
            yield size, flavor, f"{size} ({params:.0f}M)", ckpt


def batch_table(args, precisions: list[str]) -> None:
    """The engine's tokens/s with ``--batch`` requests decoding together, per precision, rounds alternating."""
    import json
    import subprocess
    import sys

    print(f"\nengine, batch {args.batch}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, "
          f"median of {args.rounds} rounds, tokens/s over all rows")
    print("| model | flavor | " + " | ".join(precisions) + " | int8 vs " + ("bf16" if "bf16" in precisions else "fp32")
          + " |")
    print("| --- | --- | " + " | ".join("---" for _ in precisions) + " | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for _size, flavor, label, ckpt in random_checkpoints(args, Path(tmp)):
            runs = {p: [] for p in precisions}
            for _ in range(args.rounds):
                for precision in precisions:
                    cmd = [sys.executable, __file__, "--worker", "engine", str(ckpt), precision, "--batch",
                           str(args.batch), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
                           str(args.new_tokens), "--device", args.device]
                    line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
                    runs[precision].append(json.loads(line.splitlines()[-1])["tok_s"])
            speed = {p: statistics.median(v) for p, v in runs.items()}
            base = "bf16" if "bf16" in speed else "fp32"
            ratio = f"{speed['int8'] / speed[base]:.2f}x" if "int8" in speed and base in speed else "—"
            print(f"| {label} | {flavor} | " + " | ".join(f"{speed[p]:,.1f}" for p in precisions)
                  + f" | {ratio} |", flush=True)


def speed_tables(args, precisions: list[str]) -> None:
    import json
    import subprocess
    import sys

    print(f"\nbatch 1, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, median of {args.rounds} rounds")
    print("| model | flavor | weights | lmforge generate (tok/s) | lmforge engine (tok/s) | transformers (tok/s) | "
          "generate vs transformers | engine vs transformers | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    side = {}  # (size label, flavor) -> {precision: speeds}
    with tempfile.TemporaryDirectory() as tmp:
        for size, flavor, label, ckpt in random_checkpoints(args, Path(tmp)):
            export_hf(ckpt, Path(tmp) / f"{size}-{flavor}-hf")
            for precision in precisions:
                systems = ["lmforge", "engine"] + (["transformers"] if precision != "int8" else [])
                runs = {system: [] for system in systems}
                outputs = {}
                for _ in range(args.rounds):
                    for system in runs:
                        cmd = [sys.executable, __file__, "--worker", system, str(ckpt), precision,
                               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                               "--device", args.device]
                        line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
                        result = json.loads(line.splitlines()[-1])
                        runs[system].append(result["tok_s"])
                        outputs[system] = result["tokens"]
                speed = {k: statistics.median(v) for k, v in runs.items()}
                side.setdefault((label, flavor), {})[precision] = speed
                same = all(out == outputs["lmforge"] for out in outputs.values())
                hf = speed.get("transformers")
                print(f"| {label} | {flavor} | {precision} | {speed['lmforge']:,.1f} | {speed['engine']:,.1f} | "
                      + (f"{hf:,.1f} | {speed['lmforge'] / hf:.2f}x | {speed['engine'] / hf:.2f}x"
                         if hf else "— | — | —") + f" | {'yes' if same else 'no'} |", flush=True)
    print("\nlmforge tokens/s side by side (generate / engine); int8 vs bf16 (vs fp32 where there is no bf16):")
    heads = [p for p in ("fp32", "bf16", "int8") if p in precisions]
    base = "bf16" if "bf16" in precisions else "fp32"
    print("| model | flavor | " + " | ".join(heads) + f" | int8 vs {base} (generate) | int8 vs {base} (engine) |")
    print("| --- | --- | " + " | ".join("---" for _ in heads) + " | --- | --- |")
    for (label, flavor), by in side.items():
        cells = [f"{by[p]['lmforge']:,.1f} / {by[p]['engine']:,.1f}" for p in heads]
        ratio = [f"{by['int8'][k] / by[base][k]:.2f}x" if "int8" in by and base in by else "—"
                 for k in ("lmforge", "engine")]
        print(f"| {label} | {flavor} | " + " | ".join(cells) + f" | {ratio[0]} | {ratio[1]} |")


# ---- quality of int8: held-out bits per byte and greedy agreement on briefly trained models ---------------
def stdlib_split() -> tuple[list[str], list[str]]:
    """The Python standard library's modules (no site-packages), split by file: 1 in 10 held out."""
    import hashlib
    import sysconfig

    from lmforge.quickstart import python_stdlib_globs

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted({f for glob in python_stdlib_globs(root) for f in root.glob(glob) if f.is_file()})
    train, held = [], []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(str(f.relative_to(root)).encode()).digest()[0]
        (held if digest % 10 == 0 else train).append(text)
    return train, held


def token_stream(tokenizer, texts: list[str]) -> tuple[torch.Tensor, int]:
    """Documents packed as training data is, each after the separator; and their UTF-8 bytes."""
    ids: list[int] = []
    for text, enc in zip(texts, tokenizer.encode_batch(texts)):
        ids += [tokenizer.eos_id, *enc]
    return torch.tensor(ids), sum(len(t.encode()) for t in texts)


def train_briefly(model, stream: torch.Tensor, seconds: float, seq_len: int, rows: int, lr: float) -> tuple[int, float]:
    """AdamW on random windows of ``stream`` in bf16 autocast for ``seconds``; returns (steps, last loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    model.train()
    start, steps, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - start < seconds:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (steps + 1) / 30)
        at = torch.randint(0, len(stream) - seq_len - 1, (rows,), generator=gen)
        window = torch.stack([stream[i:i + seq_len + 1] for i in at.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto_dtype() == torch.bfloat16):
            out, _ = model({"input_ids": window[:, :-1], "labels": window[:, 1:]})
        opt.zero_grad(set_to_none=True)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps, loss = steps + 1, out.detach().item()
    model.eval()
    return steps, loss


@torch.inference_mode()
def bits_per_byte(model, stream: torch.Tensor, n_bytes: int, seq_len: int) -> float:
    """Bits per UTF-8 byte of ``stream`` (windows of ``seq_len``, every token but the first predicted once;
    the bytes are those of the scored tokens, pro rata)."""
    from lmforge.eval.lm import lm_metrics

    nll, count = 0.0, 0
    for i in range(0, len(stream) - 1, seq_len):
        window = stream[i:i + seq_len + 1]
        logits = model.logits(window[None, :-1])[0].float()
        nll += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
        count += len(window) - 1
    return lm_metrics(nll / count, n_bytes / len(stream))["bpb"]


def quality_table(args) -> None:
    import copy

    from lmforge.tokenizer import Tokenizer

    budget = dict(item.split("=") for item in args.train_seconds.split(","))
    limits = dict(item.split("=") for item in args.eval_tokens.split(","))
    train_texts, held_texts = stdlib_split()
    print(f"\nint8 quality: Python standard library ({len(train_texts)} files to train on, {len(held_texts)} held "
          f"out); greedy agreement over {args.prompts} held-out {args.prompt_tokens}-token prompts x "
          f"{args.greedy_tokens} tokens; bpb ratio = int8 / bf16 - 1")
    print("| model | flavor | trained | train loss | memory fp32 / bf16 / int8 (MiB) | bpb fp32 | bpb bf16 | bpb int8 | "
          "int8 vs bf16 bpb | int8: same greedy tokens as bf16 | bf16: same as fp32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            layers, width, heads, ctx, vocab = SIZES[size]
            seq_len = min(ctx, 256)
            texts = train_texts
            tokenizer = Tokenizer.load(train_tokenizer(texts, vocab, Path(tmp) / f"tok-{size}", show_progress=False))
            train_stream, _ = token_stream(tokenizer, texts)
            held, n_bytes = token_stream(tokenizer, held_texts)
            keep = int(limits.get(size, 30000))
            n_bytes = round(n_bytes * min(1.0, keep / len(held)))
            held = held[:keep]
            for flavor in args.flavors.split(","):
                torch.manual_seed(0)
                model = GPT(GPTConfig(flavor=flavor, vocab_size=tokenizer.vocab_size, n_positions=ctx, n_embd=width,
                                      n_layer=layers, n_head=heads, eos_token_id=tokenizer.eos_id,
                                      bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id))
                steps, loss = train_briefly(model, train_stream, float(budget.get(size, 120)), seq_len,
                                            rows=16 if size == "tiny" else 8, lr=2e-3 if size == "tiny" else 6e-4)
                models = {"fp32": model.eval()}
                models["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
                models["int8"] = quantize_int8(copy.deepcopy(model), auto_dtype())
                memory = " / ".join(f"{quantized_bytes(models[p]) / 2**20:,.1f}" for p in ("fp32", "bf16", "int8"))
                bpb = {p: bits_per_byte(m, held, n_bytes, seq_len) for p, m in models.items()}
                gen = torch.Generator().manual_seed(1)
                starts = torch.randint(0, len(held) - args.prompt_tokens, (args.prompts,), generator=gen).tolist()
                greedy = {p: [list(generate_tokens(m, held[i:i + args.prompt_tokens].tolist(), args.greedy_tokens,
                                                   temperature=0, stop_at_eos=False)) for i in starts]
                          for p, m in models.items()}
                print(f"| {size} | {flavor} | {steps} steps x {16 if size == 'tiny' else 8} x {seq_len} | {loss:.2f} | "
                      f"{memory} | {bpb['fp32']:.4f} | {bpb['bf16']:.4f} | {bpb['int8']:.4f} | "
                      f"{bpb['int8'] / bpb['bf16'] - 1:+.2%} | {agreement(greedy['int8'], greedy['bf16'])} | "
                      f"{agreement(greedy['bf16'], greedy['fp32'])} |", flush=True)


def agreement(runs: list[list[int]], reference: list[list[int]]) -> str:
    """The fraction of prompts whose greedy tokens are all identical, and the mean identical prefix."""
    same = sum(a == b for a, b in zip(runs, reference)) / len(runs)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(runs, reference)]
    return f"{same:.0%} (first {sum(prefix) / len(prefix):.1f} of {len(runs[0])} tokens)"


if __name__ == "__main__":
    main()
