"""Text of a growing token sequence, produced piece by piece: each step decodes a short window, not it all.

Decoding all of a choice's tokens at every streamed event costs O(n^2) per answer on the router's one event
loop. Here each step decodes the window from ``prefix_offset`` (a few tokens already sent, kept for context:
some tokenizers render a token differently at the start of a text) and sends what the window's text has
grown by, as vLLM's and TGI's detokenizers do. A step whose text ends in U+FFFD (the first bytes of a
character the next token completes) sends nothing yet, unless it is the choice's last: then what was held back
is sent as it decodes, so the pieces of a stream always add up to the text the same answer has unstreamed.
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0  # the window starts here: tokens already sent, kept as context
        self._read_offset = 0  # tokens before this are sent

    def add(self, token_ids: list[int], last: bool = False) -> str:
        """The text ``token_ids`` add to what was sent so far ("" while a character is incomplete, unless
        ``last``: no token will complete it)."""
        self._tokens.extend(token_ids)
        sent = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        text = self._decode(self._tokens[self._prefix_offset:])
        if len(text) <= len(sent) or (text.endswith("\ufffd") and not last):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return text[len(sent):]
