"""The log-probabilities of a choice, in OpenAI's two formats.

``/v1/completions`` answers ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: each
token as a string (``"bytes:\\xe2\\x9c"`` for one that is part of a UTF-8 character), its log-probability
(``null`` for a prompt's first token), a ``{token: logprob}`` map of the most likely tokens at its
position (the sampled token always among them, so up to N + 1 entries, as OpenAI does) and the
character where the token starts in the choice's ``text``. ``/v1/chat/completions`` answers
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
"""

from __future__ import annotations

import codecs
from typing import Any, NamedTuple

from lmforge.infer.logprobs import TokenLogprob


class Entry(NamedTuple):
    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int  # the character of the choice's text where the token starts


class TokenScores:
    """A choice's tokens with their log-probabilities and text offsets, in arrival order; ``take`` hands
    out those that start before a character position (what a stream has sent so far)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.entries: list[Entry] = []
        self.chars = 0  # characters of text the tokens so far decode to
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._taken = 0

    def add(self, token: int, score: TokenLogprob | None, in_text: bool = True) -> None:
        """Append ``token``; ``in_text`` False for a token that is not part of the choice's text (the
        document separator the server puts before a text prompt)."""
        logprob, top = (None, None) if score is None else (score.logprob, score.top)
        self.entries.append(Entry(token, logprob, top, self.chars))
        if in_text:
            self.chars += len(self._decoder.decode(self.tokenizer.token_bytes(token)))

    def skip_to(self, chars: int) -> None:
        """The text goes on at ``chars`` (after an echoed prompt that was not scored)."""
        self._decoder.reset()
        self.chars = chars

    def take(self, upto: int | None = None) -> list[Entry]:
        """The entries not taken yet that start before character ``upto`` (None: all)."""
        end = self._taken
        while end < len(self.entries) and (upto is None or self.entries[end].offset < upto):
            end += 1
        out, self._taken = self.entries[self._taken:end], end
        return out


def token_string(tokenizer: Any, token: int) -> str:
    data = tokenizer.token_bytes(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def completion_logprobs(tokenizer: Any, entries: list[Entry]) -> dict[str, list]:
    """``/v1/completions``' ``logprobs`` object for ``entries``."""
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:
            tops.append(None)
            continue
        top = {token_string(tokenizer, t): lp for t, lp in e.top}
        top.setdefault(token_string(tokenizer, e.token), e.logprob)
        tops.append(top)
    return {"tokens": [token_string(tokenizer, e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(tokenizer: Any, entries: list[Entry]) -> dict[str, list]:
    """``/v1/chat/completions``' ``logprobs`` object for ``entries``."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_string(tokenizer, token), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}
