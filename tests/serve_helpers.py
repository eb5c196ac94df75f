"""A small chat model that really calls a tool, and a real `lmforge serve` process to talk to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.tokenizer import Tokenizer, train_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
ASK_TOOL = [{"role": "user", "content": "Open main.go"}]
TOOL_REPLY = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "main.go"}'}}]}
GREETING = [{"role": "user", "content": "Say hello"}]
HELLO = "Hello! I write Go: func main() { fmt.Println(\"héllo\") }"

CORPUS = ["package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, world\")\n}\n",
          "The quick brown fox jumps over the lazy dog. Say hello, open main.go, read a file.",
          '<tool_call>{"name": "read_file", "arguments": {"path": "main.go"}}</tool_call>'] * 20


def train_chat_model(out: Path, flavor: str = "llama", max_steps: int = 400, n_positions: int = 256) -> Path:
    """A tiny model that has learnt two conversations by heart: a tool call for "Open main.go" (with
    the tools listed) and a fixed greeting for "Say hello". Saved with its tokenizer; returns the dir.
    It trains until its loss is below 0.02 (~150 steps), not for a fixed count: at a fixed count the
    loss may sit on one of its bumps, wherever rounding differs."""
    tokenizer = Tokenizer.load(train_tokenizer(CORPUS, vocab_size=400, out_dir=out / "tokenizer", show_progress=False))
    conversations = [tokenizer.apply_chat_template(ASK_TOOL + [TOOL_REPLY], tools=TOOLS, add_generation_prompt=False),
                     tokenizer.apply_chat_template(GREETING + [{"role": "assistant", "content": HELLO}],
                                                   add_generation_prompt=False)]
    rows = [[tokenizer.eos_id, *tokenizer.encode(text)] for text in conversations]
    return learn_by_heart(tokenizer, rows, out, flavor, max_steps, n_positions)


def learn_by_heart(tokenizer: Tokenizer, rows: list[list[int]], out: Path, flavor: str = "llama", max_steps: int = 400,
                   n_positions: int = 256) -> Path:
    """A tiny GPT trained on ``rows`` (token ids) until its loss is below 0.02; saved with ``tokenizer`` in
    OUT/ckpt, whose path it returns."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([r[1:] + [-100] * (width - len(r)) for r in rows])
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor=flavor, vocab_size=tokenizer.vocab_size, n_positions=n_positions, n_embd=64, n_layer=2,
                          n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        loss, _ = model({"input_ids": ids[:, :-1], "labels": labels})
        if loss.item() < 0.02:  # measured on the weights that are saved
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02, f"the test model did not learn its conversations (loss {loss.item():.3f})"
    ckpt = model.save_pretrained(out / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`lmforge serve CKPT` in a subprocess on a free loopback port; stopped on exit."""

    def __init__(self, checkpoint: Path, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(checkpoint).parent / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "lmforge", "serve", str(checkpoint), "--port", str(self.port),
               "--model-name", "tiny", "--log-level", "warning", "--precision", "fp32", *args]
        env = {**os.environ, "LMFORGE_API_KEY": ""}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300  # only a guard against a hang: a busy machine may take a while
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmforge serve exited: {self.log.read_text()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"lmforge serve did not come up: {self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def random_checkpoint(out: Path, n_positions: int = 64) -> Path:
    """An untrained (seeded) tiny model with a real tokenizer: enough to serve, fast to generate with."""
    tokenizer = Tokenizer.load(train_tokenizer(CORPUS, vocab_size=300, out_dir=out / "tokenizer", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_positions=n_positions, n_embd=32,
                          n_layer=1, n_head=2))
    ckpt = model.save_pretrained(out / "ckpt")
    tokenizer.save(ckpt)
    return ckpt
