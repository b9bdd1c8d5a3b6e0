"""sse_lines: an SSE stream's lines, split only where the format ends a line, however the bytes are chunked."""

from __future__ import annotations

import asyncio
import json

import pytest
from httpx._decoders import LineDecoder

from dualpath_connector.protocol import sse_lines

# What vLLM streams for a token whose text holds a line separator: JSON leaves U+2028 and U+0085 raw.
EVENT = json.dumps({"choices": [{"text": "a\u2028b\u0085c\u2029d", "token_ids": [7]}]}, ensure_ascii=False)
STREAM = f"data: {EVENT}\r\n\r\ndata: [DONE]\n\n".encode()


def _lines(chunks: list[bytes]) -> list[str]:
    async def gather() -> list[str]:
        async def source():
            for chunk in chunks:
                yield chunk

        return [line async for line in sse_lines(source())]

    return asyncio.run(gather())


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_an_event_with_line_separators_in_its_text_stays_one_line(size):
    # Cut anywhere: inside a multi-byte character, between CR and LF.
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert _lines(chunks) == [f"data: {EVENT}", "", "data: [DONE]", ""]
    assert json.loads(_lines(chunks)[0].removeprefix("data: "))["choices"][0]["token_ids"] == [7]


def test_httpx_aiter_lines_would_cut_the_event():
    """The control: httpx's line splitting (aiter_lines) breaks the same event into pieces that are not JSON."""
    lines = LineDecoder().decode(STREAM.decode())
    assert f"data: {EVENT}" not in lines
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0].removeprefix("data: "))


def test_a_last_line_without_its_end_and_a_lone_cr():
    assert _lines([b"data: 1\rdata: 2\r", b"\ndata: 3"]) == ["data: 1", "data: 2", "data: 3"]
