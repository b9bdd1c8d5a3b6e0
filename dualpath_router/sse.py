"""Server-sent event lines from a byte stream, split where the SSE format ends a line (CRLF, LF, CR) and nowhere else.

httpx's ``aiter_lines`` splits as ``str.splitlines`` does: also at U+0085, U+2028, U+2029 and a few
control characters. An engine writes those raw inside its JSON strings (JSON escapes only characters below
U+0020, and vLLM does not escape non-ASCII), so a generated text holding one would reach a reader as two
lines, neither of them valid JSON.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import AsyncIterator

_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an SSE stream given as byte chunks cut anywhere (inside a character, between CR and LF)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    async for chunk in chunks:
        text = pending + decoder.decode(chunk)
        # A CR at the end may be the first half of a CRLF whose LF is in the next chunk.
        held = text.endswith("\r")
        *lines, pending = _LINE_END.split(text[:-1] if held else text)
        if held:
            pending += "\r"
        for line in lines:
            yield line
    lines = _LINE_END.split(pending + decoder.decode(b"", final=True))
    if lines[-1] == "":
        lines.pop()
    for line in lines:
        yield line
