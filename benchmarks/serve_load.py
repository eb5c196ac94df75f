"""Load test of ``lmforge serve``: many concurrent OpenAI clients, latency, throughput and errors.

Starts ``lmforge serve`` on a seeded random checkpoint of the quickstart's size (go_coder_tiny: gpt2
flavor, 3 x 192, context 256, a 4096-token vocabulary) or on ``--checkpoint``, then runs
``--clients`` concurrent clients (the official ``openai`` AsyncOpenAI client), each sending
``--requests`` completion requests one after another (prompt of a few words, ``--max-tokens``
tokens, temperature 0.8, half of them streamed). Reports p50/p95 latency, completion tokens per
second over the whole run, and errors; once per ``--batch-sizes`` value (1 = requests only queue).
Usage:

    python benchmarks/serve_load.py [--clients 32] [--requests 5] [--max-tokens 64] [--batch-sizes 1,32]
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,32")
    args = parser.parse_args()
    print(f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, temperature 0.8")
    print("| max batch | requests | errors | p50 latency (s) | p95 latency (s) | completion tokens | tokens/s | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else random_checkpoint(Path(tmp))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            server = Server(ckpt, "--max-batch-size", str(batch))
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
