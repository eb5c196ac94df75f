"""Autoregressive sampling with a KV cache, and streaming detokenisation.

``generate_tokens`` works with any model that has ``config`` (``n_positions``, ``bos_token_id``,
``eos_token_id``), ``logits(input_ids, kv_cache=, last_only=)`` and ``new_kv_cache(batch_size)``, like
``lmforge.models.gpt.GPT``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lmforge.errors import LMForgeError


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not (math.isfinite(temperature) and math.isfinite(top_p)):
        raise LMForgeError(f"temperature and top_p must be finite numbers, got {temperature} and {top_p}")
    if temperature < 0:
        raise LMForgeError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise LMForgeError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise LMForgeError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                uniform: torch.Tensor) -> torch.Tensor:
    """Pick one token per row of ``[B, V]`` logits, each row with its own settings (``[B]`` tensors).

    ``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` 1 = off (nucleus: keep the most likely
    tokens until their probability reaches ``top_p``). ``uniform`` holds one draw in [0, 1) per row,
    turned into a token by the inverse CDF: the caller owns the randomness, so a request with its
    own seed samples the same tokens whatever else is in the batch.
    """
    logits = logits.float()
    greedy = temperature <= 0
    best = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return best
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    if not bool(((top_k > 0) | (top_p < 1)).any()):
        # Nothing to cut: the inverse CDF over the vocabulary in its own order draws from the same
        # distribution as over the sorted one, without sorting (most of a sampled step at 50k tokens).
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        index = torch.searchsorted(cdf, uniform[:, None].to(cdf.dtype) * cdf[:, -1:]).squeeze(-1)
        return torch.where(greedy, best, index.clamp_max(logits.size(-1) - 1))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.size(-1), device=logits.device)
    outside_k = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_logits.masked_fill(outside_k, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already hold top_p; the top one always stays.
    outside_p = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    cdf = probs.masked_fill(outside_p, 0.0).cumsum(dim=-1)
    index = (cdf < uniform[:, None] * cdf[:, -1:]).sum(dim=-1).clamp_max(logits.size(-1) - 1)
    return torch.where(greedy, best, order.gather(-1, index[:, None]).squeeze(-1))


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of ``[B, V]`` logits -> ``[B]`` ids, all rows with the same settings
    (``sample_rows``); the draws come from ``generator``."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    n, device = logits.size(0), logits.device
    uniform = torch.rand(n, generator=generator, device=generator.device if generator else "cpu").to(device)
    return sample_rows(logits, torch.full((n,), float(temperature), device=device),
                       torch.full((n,), top_k, device=device), torch.full((n,), float(top_p), device=device),
                       uniform)


def check_seed(seed: Any) -> None:
    """A sampling seed: None or an integer in [0, 2**64), the range of ``torch.Generator.manual_seed``."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise LMForgeError(f"seed must be an integer (or None), got {seed!r}: pass e.g. seed=0")
    if not 0 <= seed < 2**64:
        raise LMForgeError(f"seed must be in 0..2**64-1, got {seed}: pass a smaller non-negative integer")


def generate_tokens(model: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None, eos_id: int | None = None,
                    stop_at_eos: bool = True, note: Callable[[str], Any] | None = None) -> Iterator[int]:
    """Yield new token ids one at a time: one prefill of the prompt, then one cached step per token.

    An empty prompt starts from the document separator (eos), as packed training data does. With ``stop_at_eos``
    generation ends at ``eos_id`` (default: the model's) without yielding it. Prompt plus output never exceed
    ``n_positions``: a prompt that does not fit keeps its last ``n_positions - max_new_tokens`` tokens, but at least
    half the context, and generation stops when the context is full; both are told to ``note`` (default: a
    ``UserWarning``).
    With ``seed`` the output is reproducible. Bad settings raise ``LMForgeError`` here, before the first token.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise LMForgeError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}: pass e.g. 256")
    check_seed(seed)
    check_sampling(temperature, top_k, top_p)
    if note is None:
        note = lambda message: warnings.warn(message, stacklevel=3)  # the caller's line
    return _generate_tokens(model, list(prompt_ids), int(max_new_tokens), temperature, top_k, top_p, seed, eos_id,
                            stop_at_eos, note)


def _generate_tokens(model: Any, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int | None, eos_id: int | None, stop_at_eos: bool,
                     note: Callable[[str], Any]) -> Iterator[int]:
    config = model.config
    n_ctx = config.n_positions
    eos = config.eos_token_id if eos_id is None else eos_id
    ids = ids or [config.eos_token_id]  # a document starts after the separator
    if max_new_tokens == 0:
        return
    # A prompt that fits is kept whole, as the server keeps it (the reply ends where the context does). One that
    # does not keeps room for the new tokens asked for, but never less than half the context (the rule lmforge
    # eval's harness follows), so a long reply never costs most of the prompt.
    keep = max(n_ctx - max_new_tokens, n_ctx // 2, 1)
    if len(ids) >= n_ctx:
        room = (f"so that the {max_new_tokens} new tokens asked for fit" if keep + max_new_tokens <= n_ctx else
                f"(half the context), which leaves room for {n_ctx - keep} new tokens")
        note(f"a prompt of {len(ids)} tokens and {max_new_tokens} new ones do not fit model.n_positions={n_ctx}: "
             f"keeping its last {keep} tokens {room}; shorten the prompt (or ask for fewer new tokens) to keep more")
        ids = ids[len(ids) - keep:]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cache = model.new_kv_cache(1)

    # Eval mode and inference mode only around model calls: a generator is suspended between
    # tokens, and the caller's code then must see its own grad and train/eval state.
    @torch.inference_mode()
    def step(new_ids: list[int]) -> torch.Tensor:
        was_training = model.training
        if was_training:  # switching walks every module: only when needed
            model.eval()
        try:
            logits = model.logits(torch.tensor([new_ids], device=device), kv_cache=cache, last_only=True)
        finally:
            if was_training:
                model.train()
        return logits[:, -1]

    logits = step(ids)
    length = len(ids)
    for i in range(max_new_tokens):
        if i:
            if length >= n_ctx:
                note(f"stopped after {i} new tokens: the context is full (model.n_positions={n_ctx}); "
                     "shorten the prompt for a longer reply")
                return
            logits = step([token])
        token = int(sample_next(logits, temperature, top_k, top_p, generator)[0])
        if stop_at_eos and token == eos:
            return
        yield token
        length += 1


class StreamingDecoder:
    """Turn a stream of token ids into a stream of text, emitting only complete characters.

    Byte-level tokens can end in the middle of a UTF-8 character; such text decodes with a trailing
    U+FFFD, so ``push`` holds it back until a later token completes the character. Text is decoded
    in a short window that starts one emitted chunk back, so decoders that treat the first token
    specially (e.g. strip a leading space) see the same context as a full decode would.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._window_start = 0  # first id of the decode window
        self._emitted_end = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(int(token_id))
        return self._emit(force=False)

    def flush(self) -> str:
        """Return whatever is pending, partial characters included (as U+FFFD)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        emitted = self.tokenizer.decode(self._ids[self._window_start:self._emitted_end])
        text = self.tokenizer.decode(self._ids[self._window_start:])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not force):
            return ""
        self._window_start, self._emitted_end = self._emitted_end, len(self._ids)
        return text[len(emitted):]


def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 256, temperature: float = 0.8,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                  stream: Callable[[str], Any] | None = None, note: Callable[[str], Any] | None = None) -> str:
    """Generate a continuation of ``prompt`` and return it (without the prompt).

    The prompt is encoded and prefixed with the document separator ``tokenizer.eos_id``: in packed
    training data every document follows one, so this is how a model trained by lmforge has seen
    documents begin. Generation stops at the next ``eos_id``. ``stream`` gets each new piece of text;
    ``note`` what ``generate_tokens`` tells about the context (default: a ``UserWarning``).
    """
    if not isinstance(prompt, str):
        raise LMForgeError(f"prompt must be a str, got {type(prompt).__name__}: pass the text to continue ('' for "
                           "none)")
    ids = [tokenizer.eos_id, *tokenizer.encode(prompt)]
    decoder = StreamingDecoder(tokenizer)
    pieces: list[str] = []

    def emit(piece: str) -> None:
        if piece:
            pieces.append(piece)
            if stream is not None:
                stream(piece)

    for token in generate_tokens(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, eos_id=tokenizer.eos_id, stop_at_eos=stop_at_eos, note=note):
        emit(decoder.push(token))
    emit(decoder.flush())
    return "".join(pieces)
