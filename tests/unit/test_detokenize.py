"""The router's incremental detokenizer: the pieces add up to the whole text, each step decodes a short window."""

from __future__ import annotations

import pytest

from dualpath_router.detokenize import IncrementalDetokenizer

TEXT = "héllo wörld, 世界! ok 🙂 done"


def byte_decoder(calls: list[int]):
    """One token per UTF-8 byte (as byte-level BPE can split a character), decoded as a tokenizer does."""

    def decode(token_ids: list[int]) -> str:
        calls.append(len(token_ids))
        return bytes(token_ids).decode("utf-8", errors="replace")

    return decode


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_pieces_add_up_to_the_whole_text_and_never_split_a_character(step):
    calls: list[int] = []
    detok = IncrementalDetokenizer(byte_decoder(calls))
    ids = list(TEXT.encode())
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    # Each decode sees a window of a few tokens, not the whole answer so far (the old way: O(n^2) in all).
    assert max(calls) <= 3 * step + 4


def test_a_long_answer_costs_linear_decoding():
    calls: list[int] = []
    detok = IncrementalDetokenizer(byte_decoder(calls))
    ids = list(("abc " * 5000).encode())
    for token in ids:
        detok.add([token])
    assert sum(calls) < 4 * len(ids)


def test_the_last_step_sends_what_an_unfinished_character_held_back():
    # The answer stops inside a character: its first two bytes of three, as a max_tokens cut can leave it.
    ids = list("ok 世".encode())[:-1]
    whole = bytes(ids).decode("utf-8", errors="replace")
    assert whole.endswith("\ufffd")
    held = IncrementalDetokenizer(byte_decoder([]))
    pieces = [held.add([token]) for token in ids]
    assert "".join(pieces) == "ok "  # control: a step not known to be the last holds the bytes back
    detok = IncrementalDetokenizer(byte_decoder([]))
    pieces = [detok.add([token], last=i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(pieces) == whole  # what the unstreamed answer decodes to
