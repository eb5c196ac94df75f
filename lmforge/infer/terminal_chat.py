"""``lmforge chat``: talk to a checkpoint in the terminal, with the replies streamed as they are sampled.

The conversation is rendered with the model's chat template (``lmforge.chat``) every turn, as
``lmforge serve`` renders it, and sampled with the same sampler (``sample_rows``) on this thread.
Commands: ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) quits, Ctrl-C stops a reply.
"""

from __future__ import annotations

import sys
import warnings
from typing import TextIO

from lmforge.chat import choice_seed
from lmforge.errors import LMForgeError
from lmforge.infer.engine import SamplingParams
from lmforge.infer.generate import StreamingDecoder, check_seed, generate_tokens
from lmforge.tokenizer import check_text

HELP = "commands: /reset forgets the conversation, /exit quits (or Ctrl-D); Ctrl-C stops a reply"


def chat(checkpoint: str, system: str | None = None, max_tokens: int = 512, temperature: float = 0.8,
         top_p: float = 0.95, top_k: int = 0, seed: int | None = None, device: str = "auto", precision: str = "auto",
         stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, quantize: str = "none") -> None:
    from lmforge.infer.loading import load_for_inference
    from lmforge.checkpoint import resolve_model_dir

    SamplingParams(max_tokens, temperature, top_p, top_k)  # check the settings before loading
    check_seed(seed)
    model, tokenizer, _ = load_for_inference(checkpoint, device, precision, quantize=quantize)
    model_dir, n_ctx = resolve_model_dir(checkpoint), model.config.n_positions
    interactive = stdin.isatty()
    if hasattr(stdin, "reconfigure"):  # bytes that are not UTF-8 reach check_text (and its message) in any locale
        stdin.reconfigure(errors="surrogateescape")
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    turn = 0
    print(f"chatting with {model_dir} (context {n_ctx} tokens). {HELP}", file=stdout, flush=True)
    while True:
        if interactive:
            stdout.write("\nyou> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = list(base)
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        if not text.strip():
            continue
        try:
            check_text(text)
        except LMForgeError as e:  # a line that is not UTF-8: say so and keep the conversation
            print(f"({e})", file=stdout, flush=True)
            continue
        history.append({"role": "user", "content": text})
        # the messages' spellings of special tokens are text; only the template's markers are special tokens
        ids = [tokenizer.eos_id, *tokenizer.encode_chat(history)]
        room = n_ctx - len(ids)
        if room < 1:
            history.pop()
            print(f"(the conversation no longer fits the {n_ctx}-token context: /reset to start over)",
                  file=stdout, flush=True)
            continue
        stdout.write("model> ")
        stdout.flush()
        params = SamplingParams(min(max_tokens, room), temperature, top_p, top_k,
                                None if seed is None else choice_seed(seed, turn))
        reply, reason = _stream_reply(model, ids, params, tokenizer, stdout)
        turn += 1
        history.append({"role": "assistant", "content": reply})
        if reason == "context":
            stdout.write(f" [cut: the {n_ctx}-token context is full; /reset to start over]")
        elif reason == "length":
            stdout.write(" [cut at max tokens]")
        stdout.write("\n")
        stdout.flush()


def _stream_reply(model, ids, params: SamplingParams, tokenizer, stdout) -> tuple[str, str]:
    """Stream one reply; returns its text and why it ended (stop, length: max tokens, context: the context is
    full, cancelled)."""
    decoder = StreamingDecoder(tokenizer)
    pieces: list[str] = []
    count = 0

    def emit(piece: str) -> None:
        if piece:
            pieces.append(piece)
            stdout.write(piece)
            stdout.flush()

    try:
        with warnings.catch_warnings():  # a full context ends the reply with "length", not a warning
            warnings.simplefilter("ignore")
            for token in generate_tokens(model, ids, params.max_tokens, temperature=params.temperature,
                                         top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                                         eos_id=tokenizer.eos_id):
                count += 1
                emit(decoder.push(token))
    except KeyboardInterrupt:
        emit(decoder.flush())
        stdout.write(" [stopped]")
        return "".join(pieces), "cancelled"
    emit(decoder.flush())
    if len(ids) + count >= model.config.n_positions:
        return "".join(pieces), "context"
    return "".join(pieces), "length" if count >= params.max_tokens else "stop"
