"""A conversation -> the token ids the model is trained on, and which of them it learns to produce.

The ids are exactly what ``lmforge serve`` feeds the model: ``[eos] + encode(render(messages))`` with
the tokenizer's own chat template (the one saved with the checkpoint, exported to HF and GGUF).
The loss covers each chosen assistant turn's body and the eos that closes it (where generation
stops); never the role headers, the system prompt, the user's or the tools' words.

How the supervised spans are found, for any template: for an assistant message ``k``, the render of
``messages[:k]`` with the generation prompt is what the server sends to get that reply; the render of
``messages[:k + 1]`` extends it by the reply. The text in between, up to and including the first eos
after it, is the supervised span. Each prompt and reply piece is tokenized on its own, so the prompt
of every turn is tokenized exactly as the server tokenizes it (a byte-level BPE never merges across
the header's newline, so this equals one-pass tokenization of the history; where a foreign
tokenizer would merge there, the example is counted as ``boundary_merges``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmforge.errors import LMForgeError

ASSISTANT_TURNS = ("all", "last")


@dataclass
class Example:
    """One conversation, tokenized: ``ids`` and a 0/1 ``supervised`` flag per id."""

    ids: np.ndarray  # int32
    supervised: np.ndarray  # uint8, same length
    source: str = ""


@dataclass
class RenderStats:
    """What became of the conversations handed to ``render_examples``."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    tokens: int = 0  # tokens of the kept examples
    supervised: int = 0  # of those, tokens the loss covers
    boundary_merges: int = 0  # kept examples whose one-pass tokenization differs at a turn boundary
    longest: int = 0  # tokens of the longest example seen (kept or too long)
    untokenized: int = 0  # of the too long ones, those left out untokenized: more characters than seq_len tokens hold

    def summary(self, seq_len: int) -> str:
        total = self.kept + sum(self.skipped.values())
        parts = [f"{self.kept:,} of {total:,} conversations kept"]
        if self.kept:
            parts.append(f"{self.tokens:,} tokens, {self.supervised / max(self.tokens, 1):.1%} supervised")
        for reason, n in sorted(self.skipped.items()):
            parts.append(f"{n:,} skipped: {reason}")
        if self.skipped.get(TOO_LONG, 0) > self.untokenized:
            parts.append(f"longest {self.longest:,} tokens: raise data.seq_len (now {seq_len}) to keep them")
        if self.untokenized:
            parts.append(f"{self.untokenized:,} of them not tokenized: more characters than {seq_len} tokens can hold")
        if self.boundary_merges:
            parts.append(f"{self.boundary_merges:,} tokenized per turn where one pass would merge across a turn "
                         "boundary")
        return "; ".join(parts)


TOO_LONG = "longer than data.seq_len"
NOTHING_TO_LEARN = "no assistant turn to learn from"


def check_chat_tokenizer(tokenizer: Any, where: str) -> None:
    """A tokenizer SFT can use: it has an eos token and a chat template of its own."""
    if not getattr(tokenizer, "has_chat_template", True):
        raise LMForgeError(
            f"the tokenizer {where} has no chat template (its tokenizer_config.json has no 'chat_template'), so "
            "lmforge cannot know how the model will be prompted. Add the template the model is served with as "
            "'chat_template' in tokenizer_config.json, or use a tokenizer trained by lmforge (which carries its "
            "own).")


def _render(tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
    # The markup: the messages' spellings of special tokens are marked, so they are encoded as text and
    # only the template's markers are special tokens, as ``lmforge serve`` encodes the conversation.
    if hasattr(tokenizer, "chat_markup"):
        return tokenizer.chat_markup(messages, tools=tools, add_generation_prompt=generation_prompt)
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt)


def _encode(tokenizer: Any, pieces: list[str]) -> list[list[int]]:
    """Token ids of pieces of ``_render``'s markup, each as serving encodes it (``encode_markup_batch``: a piece
    without marks, where no message spells a special token, exactly as ``encode`` encodes its text)."""
    if hasattr(tokenizer, "encode_markup_batch"):
        return tokenizer.encode_markup_batch(pieces)
    return tokenizer.encode_batch(pieces)


def supervised_spans(tokenizer: Any, messages: list[dict], tools: list | None,
                     assistant_turns: str = "all") -> tuple[str, list[tuple[int, int]]]:
    """The conversation's rendered text (its ``chat_markup``: encode pieces of it with ``tokenize_spans``) and
    the character spans the loss covers (assistant bodies with
    their closing eos), for all assistant turns or the last one only."""
    if assistant_turns not in ASSISTANT_TURNS:
        raise LMForgeError(f"recipe.assistant_turns must be one of {', '.join(ASSISTANT_TURNS)}, "
                           f"got {assistant_turns!r}")
    eos = tokenizer.special_tokens["eos"]
    text = _render(tokenizer, messages, tools, generation_prompt=False)
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if assistant_turns == "last":
        turns = turns[-1:]
    spans = []
    for k in turns:
        if k == 0:
            raise LMForgeError("the conversation opens with an assistant turn; a reply needs a system or user "
                               "message before it")
        prompt = _render(tokenizer, messages[:k], tools, generation_prompt=True)
        through = _render(tokenizer, messages[:k + 1], tools, generation_prompt=False)
        if not (through.startswith(prompt) and text.startswith(through)):
            raise LMForgeError("the tokenizer's chat template does not render a conversation as its prompt "
                               "followed by the reply (each turn's render must extend the previous one), so the "
                               "assistant's tokens cannot be located; use a template that appends turns")
        end = through.find(eos, len(prompt))
        if end < 0:
            raise LMForgeError(f"the chat template does not close an assistant turn with the eos token {eos!r}, "
                               "where generation stops; the model would never learn to stop")
        spans.append((len(prompt), end + len(eos)))
    return text, spans


def _pieces(text: str, spans: list[tuple[int, int]]) -> tuple[list[str], list[int]]:
    """The text up to the last supervised span, cut into prompt and reply pieces; 0/1 per piece."""
    pieces, flags, at = [], [], 0
    for start, end in spans:
        pieces += [text[at:start], text[start:end]]
        flags += [0, 1]
        at = end
    return pieces, flags


def _join(eos_id: int, encoded: list[list[int]], flags: list[int]) -> tuple[list[int], list[int]]:
    ids, sup = [eos_id], [0]
    for piece_ids, flag in zip(encoded, flags):
        ids += piece_ids
        sup += [flag] * len(piece_ids)
    return ids, sup


def tokenize_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``[eos]`` + the text's pieces tokenized one by one (prompt, reply, prompt, ...) up to the last
    supervised span; returns ids and the 0/1 supervised flags."""
    pieces, flags = _pieces(text, spans)
    return _join(tokenizer.eos_id, _encode(tokenizer, pieces), flags)


_CHUNK = 512  # conversations tokenized per call (the tokenizer batches across threads)


def render_examples(tokenizer: Any, conversations, seq_len: int, assistant_turns: str = "all",
                    stats: RenderStats | None = None, check_boundaries: bool = True) -> list[Example]:
    """Tokenize conversations (objects with ``messages``, ``tools`` and ``source``) into examples that
    fit ``seq_len`` inputs (``seq_len + 1`` tokens: the last token is only a target); the others are
    counted in ``stats`` and left out, never trained on cut or all-masked."""
    stats = stats if stats is not None else RenderStats()
    out: list[Example] = []
    chunk: list[tuple[str, list[tuple[int, int]], str]] = []
    most = tokenizer.max_chars(seq_len)

    def flush() -> None:
        cut = [_pieces(text, spans) for text, spans, _ in chunk]
        encoded = _encode(tokenizer, [p for pieces, _ in cut for p in pieces])
        wholes = (_encode(tokenizer, [text[:spans[-1][1]] for text, spans, _ in chunk])
                  if check_boundaries else [None] * len(chunk))
        at = 0
        for (pieces, flags), (_, _, source), whole in zip(cut, chunk, wholes):
            ids, sup = _join(tokenizer.eos_id, encoded[at:at + len(pieces)], flags)
            at += len(pieces)
            stats.longest = max(stats.longest, len(ids))
            if len(ids) - 1 > seq_len:
                stats.skipped[TOO_LONG] += 1
                continue
            stats.boundary_merges += whole is not None and [tokenizer.eos_id, *whole] != ids
            stats.kept += 1
            stats.tokens += len(ids)
            stats.supervised += sum(sup)
            out.append(Example(np.asarray(ids, dtype=np.int32), np.asarray(sup, dtype=np.uint8), source))
        chunk.clear()

    for conv in conversations:
        try:
            text, spans = supervised_spans(tokenizer, conv.messages, conv.tools, assistant_turns)
        except LMForgeError as e:
            raise LMForgeError(f"{conv.source}: {e}") from e
        if not spans:
            stats.skipped[NOTHING_TO_LEARN] += 1
            continue
        if spans[-1][1] > most:  # cannot fit: left out untokenized (tokenizing megabytes takes minutes and GBs)
            stats.skipped[TOO_LONG] += 1
            stats.untokenized += 1
            continue
        chunk.append((text, spans, conv.source))
        if len(chunk) >= _CHUNK:
            flush()
    if chunk:
        flush()
    return out


def show_example(tokenizer: Any, example: Example, color: bool) -> str:
    """The example's text with the supervised tokens marked: green when ``color``, else ``[[...]]``."""
    open_, close = ("\x1b[42;30m", "\x1b[0m") if color else ("[[", "]]")
    out, run, flag = [], [], 0
    for token, sup in zip(example.ids.tolist(), example.supervised.tolist()):
        if sup != flag and run:
            piece = tokenizer.decode(run)
            out.append(open_ + piece + close if flag else piece)
            run = []
        flag = sup
        run.append(token)
    if run:
        piece = tokenizer.decode(run)
        out.append(open_ + piece + close if flag else piece)
    return "".join(out)
