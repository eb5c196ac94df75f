"""Scoring through ``lmforge serve``: what the HTTP path costs, and lm-evaluation-harness through it.

1. Log-probability requests per second: ``--requests`` prompts of ``--prompt-tokens`` tokens scored
   (``echo``, ``max_tokens 0``, ``logprobs 1``: what a perplexity or multiple-choice benchmark sends)
   through a real ``lmforge serve`` by ``--clients`` concurrent clients, against the same prompts scored
   in this process by a plain forward + log-softmax, one prompt at a time, same thread count. The model
   is a seeded one of the quickstart's size (go_coder_tiny: gpt2 flavor, 3 x 192, context 256, a
   4096-token vocabulary), or ``--checkpoint``.
2. lm-evaluation-harness on the local tasks of the test suite (tests/lm_eval_tasks.py: a multiple-choice
   and a generate_until task over 24 people) with the model those tests train: its wall time through
   ``local-completions`` against ``lmforge serve`` and through its own ``hf`` backend on the HF export,
   one run each, and their accuracies (equal: the test suite checks it sample by sample).

Usage:

    python benchmarks/serve_logprobs.py [--requests 200] [--clients 8] [--prompt-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402
from lm_eval_tasks import (export, local_completions_model_args, run_hf, run_lm_eval,  # noqa: E402
                           train_facts_model, write_tasks)
from serve_helpers import Server  # noqa: E402

from lmforge.infer.loading import load_for_inference  # noqa: E402
from lmforge.models.gpt import GPT, GPTConfig  # noqa: E402
from lmforge.tokenizer import Tokenizer, train_tokenizer  # noqa: E402


def quickstart_sized(tmp: Path) -> Path:
    texts = [Path(__file__).read_text()] * 5
    tokenizer = Tokenizer.load(train_tokenizer(texts, 300, tmp / "tok", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="gpt2", vocab_size=4096, n_positions=256, n_embd=192, n_layer=3, n_head=3))
    ckpt = model.save_pretrained(tmp / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def direct(checkpoint: Path, batch: list[list[int]]) -> float:
    """Requests/s of a plain in-process forward + fp32 log-softmax per prompt."""
    model, _, _ = load_for_inference(checkpoint, precision="fp32")
    with torch.inference_mode():
        model.logits(torch.tensor([batch[0]]))  # warm-up
        start = time.perf_counter()
        for ids in batch:
            x = torch.tensor([ids])
            model.logits(x)[0, :-1].float().log_softmax(-1).gather(-1, x[0, 1:, None])
        return len(batch) / (time.perf_counter() - start)


async def served(base: str, batch: list[list[int]], clients: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    await client.completions.create(model="tiny", prompt=batch[0], max_tokens=0, echo=True, logprobs=1)
    todo = list(batch)

    async def worker() -> None:
        while todo:
            ids = todo.pop()
            r = await client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
            assert len(r.choices[0].logprobs.token_logprobs) == len(ids)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    rate = len(batch) / (time.perf_counter() - start)
    await client.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the server")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {args.threads} threads")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers started below inherit it
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else quickstart_sized(tmp)
        batch = prompts(args.requests, args.prompt_tokens, 256)  # ids every tokenizer here has
        here = direct(ckpt, batch)
        server = Server(ckpt, "--max-batch-size", "16")
        try:
            through = asyncio.run(served(server.base, batch, args.clients))
        finally:
            server.stop()
        print(f"\nscoring {args.requests} prompts of {args.prompt_tokens} tokens (echo, max_tokens 0, logprobs 1)")
        print("| path | requests/s |\n| --- | --- |")
        print(f"| in-process forward + log-softmax, one prompt at a time | {here:.1f} |")
        print(f"| lmforge serve, {args.clients} concurrent clients (openai.AsyncOpenAI) | {through:.1f} |")

        facts = train_facts_model(tmp / "facts")
        hf_dir, tasks = export(facts, tmp / "facts_hf"), write_tasks(tmp / "tasks")
        names = ("local_mc", "local_gen")
        server = Server(facts, "--max-batch-size", "8")
        try:
            start = time.perf_counter()
            via_serve = run_lm_eval("local-completions", local_completions_model_args(server.base, hf_dir), names,
                                    tasks, batch_size=8)
            serve_wall = time.perf_counter() - start
        finally:
            server.stop()
        start = time.perf_counter()
        via_hf = run_hf(hf_dir, names, tasks)
        hf_wall = time.perf_counter() - start
        print("\nlm-evaluation-harness, local_mc + local_gen (24 documents each), one run each")
        print("| backend | wall (s) | local_mc acc | local_gen exact_match |\n| --- | --- | --- | --- |")
        for name, res, wall in (("local-completions -> lmforge serve", via_serve, serve_wall),
                                ("hf (HF export, in-process)", via_hf, hf_wall)):
            r = res["results"]
            print(f"| {name} | {wall:.1f} | {r['local_mc']['acc,none']:.3f} | "
                  f"{r['local_gen']['exact_match,none']:.3f} |")


if __name__ == "__main__":
    main()
