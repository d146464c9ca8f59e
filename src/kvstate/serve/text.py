"""Incremental detokenization with stop strings: text deltas safe to send while tokens are still coming.

The whole reply is decoded again after each token (a tokenizer may change how earlier bytes read once
more tokens arrive), and text is held back while it ends in a partial UTF-8 character or in a prefix of
a stop string, so a stream never sends text the final answer does not contain. The pure part,
:func:`split_stop`, takes strings only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split_stop(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """``(end, stopped)``: the first stop string's start if one occurs in ``text`` (``stopped``), else the
    length of the longest prefix of ``text`` that cannot become the start of a stop string."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold, False


class TextStream:
    """Feed token ids one at a time; :meth:`push` returns the text that can be sent now."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._skip = bool(skip_special_tokens)
        self._tok = tokenizer
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self.sent = ""  # text already returned
        self.stopped = False  # a stop string occurred: the reply ends before it

    def _text(self) -> str:
        return str(self._tok.decode(self._ids, skip_special_tokens=self._skip))

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._text()
        end, self.stopped = split_stop(text, self._stops)
        if not self.stopped:
            while end > 0 and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
                end -= 1
        return self._advance(text, end)

    def flush(self) -> str:
        """The text held back, at the end of a reply that did not stop on a stop string."""
        if self.stopped:
            return ""
        text = self._text()
        return self._advance(text, len(text))

    def _advance(self, text: str, end: int) -> str:
        # what was sent is never taken back: if the tokenizer re-read earlier text, only the part past
        # the sent length follows
        delta = text[len(self.sent):end] if end > len(self.sent) else ""
        self.sent += delta
        return delta
