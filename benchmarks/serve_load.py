"""Load test of ``lmforge serve``: many concurrent OpenAI clients, latency, throughput and errors.

Starts ``lmforge serve`` on a seeded random checkpoint of the quickstart's size (go_coder_tiny: gpt2
flavor, 3 x 192, context 256, a 4096-token vocabulary) or on ``--checkpoint``, then runs
``--clients`` concurrent clients (the official ``openai`` AsyncOpenAI client), each sending
``--requests`` completion requests one after another (prompt of a few words, ``--max-tokens``
tokens, temperature 0.8, half of them streamed). Reports p50/p95 latency, completion tokens per
second over the whole run, and errors; once per ``--batch-sizes`` value (1 = requests only queue).
With ``--long-prompts`` it measures instead what long prompts do to running requests: 16 clients
stream 200-token replies while 8 requests with 2,000-token prompts arrive, one every ``--every``
seconds (the first 1,900 tokens shared, as a long system prompt or tool list is); the figure is the
p95 (and max) gap between consecutive streamed tokens of the running requests, on a random gpt2 model
(``--layers`` 6 x ``--width`` 512, ~20M parameters; its vocabulary the 300 tokens of the tokenizer,
so that every token streams) with a 2,304-token context, before (``--prefill-chunk`` larger than any prompt,
``--prefix-cache 0``: each prompt prefilled whole, as lmforge did before) and after (chunks of 512,
4 kept prompts) in one run. Usage:

    python benchmarks/serve_load.py [--clients 32] [--requests 5] [--max-tokens 64] [--batch-sizes 1,32]
        [--precision fp32] [--quantize int8] [--device cuda]
    python benchmarks/serve_load.py --long-prompts [--every 0.5] [--layers 6 --width 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serve_helpers import Server  # noqa: E402  (the test suite's subprocess launcher)

from lmforge.models.gpt import GPT, GPTConfig  # noqa: E402
from lmforge.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

PROMPTS = ["package main\n\nfunc", "// Copyright", "import (\n\t\"fmt\"", "The quick brown fox", "func (s *Server)"]


def random_checkpoint(tmp: Path) -> Path:
    texts = [Path(__file__).read_text()] * 5
    tokenizer = Tokenizer.load(train_tokenizer(texts, 300, tmp / "tok", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="gpt2", vocab_size=4096, n_positions=256, n_embd=192, n_layer=3, n_head=3))
    ckpt = model.save_pretrained(tmp / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


async def one_client(client, index: int, requests: int, max_tokens: int, results: list) -> None:
    for r in range(requests):
        prompt = PROMPTS[(index + r) % len(PROMPTS)]
        start = time.perf_counter()
        try:
            if (index + r) % 2:
                stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0.8, stream=True,
                                                         stream_options={"include_usage": True})
                tokens = 0
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            else:
                reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0.8)
                tokens = reply.usage.completion_tokens
            results.append((time.perf_counter() - start, tokens, None))
        except Exception as e:  # noqa: BLE001 - counted and reported
            results.append((time.perf_counter() - start, 0, repr(e)))


async def load(base: str, clients: int, requests: int, max_tokens: int) -> tuple[list, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    results: list = []
    start = time.perf_counter()
    await asyncio.gather(*(one_client(client, i, requests, max_tokens, results) for i in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def long_context_checkpoint(tmp: Path, layers: int, width: int) -> Path:
    texts = [Path(__file__).read_text()] * 5
    tokenizer = Tokenizer.load(train_tokenizer(texts, 300, tmp / "tok", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="gpt2", vocab_size=tokenizer.vocab_size, n_positions=2304, n_embd=width,
                          n_layer=layers, n_head=width // 64))
    # Every sampled token must be whole text, so that every step streams a chunk to time: a token that
    # is part of a UTF-8 character is held back until the character completes, and a random model's
    # run of them showed as a "gap" of seconds. The final norm's output is made ~ all ones (gain 0.01,
    # bias 1), so the (tied) head's rows of non-ASCII and special tokens, set to -1, score ~ -width.
    with torch.no_grad():
        model.norm_f.weight.fill_(0.01)
        model.norm_f.bias.fill_(1.0)
        for token in range(tokenizer.vocab_size):
            data = tokenizer.token_bytes(token)
            if not data or max(data) >= 0x80 or not tokenizer.decode([token], skip_special_tokens=True):
                model.tok_embed.weight[token] = -1.0
    ckpt = model.save_pretrained(tmp / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


async def long_prompt_load(base: str, every: float) -> tuple[list[float], list[float]]:
    """Inter-token gaps (s) of 16 streamed replies while 8 long prompts arrive; and those prompts'
    time to their first token."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    shared = [(7 * i) % 250 + 5 for i in range(1900)]
    gaps: list[float] = []
    firsts: list[float] = []

    async def running(i: int) -> None:
        stream = await client.completions.create(model="tiny", prompt=[5 + i, 6, 7], max_tokens=200,
                                                 temperature=0.8, seed=i, stream=True)
        last = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is not None:
                    gaps.append(now - last)
                last = now

    async def long(i: int) -> None:
        await asyncio.sleep(1.0 + i * every)
        prompt = shared + [(11 * i + j) % 250 + 5 for j in range(100)]
        start = time.perf_counter()
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and len(firsts) <= i:
                firsts.append(time.perf_counter() - start)

    await asyncio.gather(*(running(i) for i in range(16)), *(long(i) for i in range(8)))
    await client.close()
    return gaps, firsts


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main_long_prompts(every: float, layers: int, width: int) -> None:
    print(f"{layers} x {width} gpt2 model; 16 streams of 200 tokens; 8 prompts of 2,000 tokens (1,900 shared) "
          f"arriving every {every} s; max batch 32, fp32")
    print("Gaps are measured by the clients; the engine's own steps come from `serve --trace-steps` (a step: "
          "the prefill of at most one chunk, then one decode forward of every running row).")
    print("| engine | p50 gap (ms) | p95 gap (ms) | max gap (ms) | long prompts' first token, median (s) "
          "| engine: max step (ms) | max prefill (ms) | p95 step (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = long_context_checkpoint(Path(tmp), layers, width)
        for i, (label, flags) in enumerate((
                ("whole prefill, no prefix cache (before)", ("--prefill-chunk", "100000", "--prefix-cache", "0")),
                ("chunks of 512, no prefix cache", ("--prefill-chunk", "512", "--prefix-cache", "0")),
                ("chunks of 512 + prefix cache (after)", ("--prefill-chunk", "512", "--prefix-cache", "4")),
                ("chunks of 128 + prefix cache", ("--prefill-chunk", "128", "--prefix-cache", "4")))):
            trace = Path(tmp) / f"steps-{i}.jsonl"
            server = Server(ckpt, "--max-batch-size", "32", "--trace-steps", str(trace), *flags)
            try:
                gaps, firsts = asyncio.run(long_prompt_load(server.base, every))
            finally:
                server.stop()
            steps = [json.loads(line) for line in trace.read_text().splitlines()]
            busy = [s for s in steps if s["decoded"]]  # steps while replies were streaming
            total = [s["prefill_seconds"] + s["decode_seconds"] for s in busy]
            print(f"| {label} | {1000 * pct(gaps, 0.5):.1f} | {1000 * pct(gaps, 0.95):.1f} | "
                  f"{1000 * max(gaps):.1f} | {statistics.median(firsts):.2f} | {1000 * max(total):.1f} | "
                  f"{1000 * max(s['prefill_seconds'] for s in busy):.1f} | {1000 * pct(total, 0.95):.1f} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--precision", default="fp32", help="the server's --precision")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"], help="the server's --quantize")
    parser.add_argument("--device", default="cpu", help="the server's --device (cpu, cuda, cuda:N, mps)")
    parser.add_argument("--long-prompts", action="store_true", help="measure running streams while long prompts "
                        "arrive (see above)")
    parser.add_argument("--every", type=float, default=0.5, help="--long-prompts: seconds between long prompts")
    parser.add_argument("--layers", type=int, default=6, help="--long-prompts: the model's layers")
    parser.add_argument("--width", type=int, default=512, help="--long-prompts: the model's width")
    args = parser.parse_args()
    if args.long_prompts:
        main_long_prompts(args.every, args.layers, args.width)
        return
    print(f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, temperature 0.8, "
          f"--precision {args.precision} --quantize {args.quantize} --device {args.device}")
    print("| max batch | requests | errors | p50 latency (s) | p95 latency (s) | completion tokens | tokens/s | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else random_checkpoint(Path(tmp))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            server = Server(ckpt, "--max-batch-size", str(batch), "--precision", args.precision, "--quantize", args.quantize,
                            "--device", args.device)
            try:
                results, wall = asyncio.run(load(server.base, args.clients, args.requests, args.max_tokens))
            finally:
                server.stop()
            latencies = sorted(r[0] for r in results)
            errors = [r[2] for r in results if r[2]]
            tokens = sum(r[1] for r in results)
            p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
            print(f"| {batch} | {len(results)} | {len(errors)} | {statistics.median(latencies):.2f} | {p95:.2f} | "
                  f"{tokens:,} | {tokens / wall:,.0f} | {wall:.1f} |", flush=True)
            for e in errors[:3]:
                print(f"  error: {e}")


if __name__ == "__main__":
    main()
