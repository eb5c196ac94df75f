"""The text of one choice as its tokens arrive: stop strings, tool-call hold-back, streaming pieces."""

from __future__ import annotations

from typing import Any

from lmforge.infer.generate import StreamingDecoder


def _partial_suffix(text: str, target: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``target``."""
    for n in range(min(len(text), len(target) - 1), 0, -1):
        if text.endswith(target[:n]):
            return n
    return 0


class ChoiceText:
    """Decodes a choice's tokens into text pieces that are safe to send.

    The text is cut before the first ``stop`` string (which is never sent), and a tail that could
    still grow into one is held back until it cannot. With ``hold_marker`` (the tool-call opener,
    when the request has tools) everything from the marker on is held for ``finish`` to parse.
    """

    def __init__(self, tokenizer: Any, stop: list[str], hold_marker: str | None = None):
        self._decoder = StreamingDecoder(tokenizer)
        self._stop = stop
        self._marker = hold_marker
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""  # everything decoded so far, up to (not including) a stop string
        self.sent = 0  # characters of text already handed out
        self.stopped = False  # a stop string was found

    def push(self, token: int) -> str:
        """Add a token; returns the new text that may be sent now ("" if none)."""
        return self._add(self._decoder.push(token), final=False)

    def finish(self) -> str:
        """The generation ended: returns what was held back (except a tool-call section)."""
        return self._add("" if self.stopped else self._decoder.flush(), final=True)

    def _add(self, piece: str, final: bool) -> str:
        if self.stopped or not piece and not final:
            return ""
        start = max(0, len(self.text) - self._longest)
        self.text += piece
        cuts = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if cuts:
            self.text, self.stopped, final = self.text[:min(cuts)], True, True
        end = len(self.text)
        if self._marker is not None:
            at = self.text.find(self._marker, self.sent)
            if at >= 0:
                end = at
            elif not final:
                end -= _partial_suffix(self.text, self._marker)
        if not final:
            end = min(end, len(self.text) - max((_partial_suffix(self.text, s) for s in self._stop), default=0))
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    @property
    def held(self) -> str:
        """Text not handed out (after ``finish``: the tool-call section, if any)."""
        return self.text[self.sent:]
