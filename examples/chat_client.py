"""A multi-turn streaming chat with dualpath-router through the official ``openai`` client.

    export OPENAI_API_KEY=...    # only if something in front of the router asks for one
    python examples/chat_client.py --base-url http://127.0.0.1:8000/v1 "Hello!" "Tell me more."

Each argument is one user turn (without arguments: one turn per line read
from stdin). Every turn sends the whole conversation so far, the previous
answers included, so its prompt starts with the previous turn's: the router
finds that prefix's KV cache in the store and reports it in its
``x-dualpath-*`` response headers, printed after each answer. The key comes
from the environment only (a command-line argument would show in ``ps``); the
router itself asks clients for none. With the repository's tiny test model
(random weights) the answers are gibberish.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from openai import OpenAI

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


@dataclass
class Turn:
    """One answered turn: the messages sent, the streamed answer, how many chunks carried it, the router's headers."""

    messages: list[dict]
    text: str
    chunks: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def read_side(self) -> str:
        return self.headers.get("x-dualpath-read-side", "?")

    @property
    def hit_tokens(self) -> int:
        return int(self.headers.get("x-dualpath-hit-tokens", 0))


def stream_turn(client: OpenAI, model: str, messages: list[dict], max_tokens: int,
                on_text: Callable[[str], None] = lambda text: None, temperature: float | None = None) -> Turn:
    """Send ``messages`` with ``stream=True``; ``on_text`` gets each piece of the answer as it arrives.

    ``temperature``: None leaves it to the server (vLLM: the model's generation config, else 1).
    """
    options = {} if temperature is None else {"temperature": temperature}
    # with_streaming_response: the stream and the response headers (the plain call hides the headers).
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True, **options
    ) as response:
        headers = {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-dualpath-")}
        pieces: list[str] = []
        chunks = 0
        for chunk in response.parse():
            chunks += 1
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                    on_text(choice.delta.content)
    return Turn(list(messages), "".join(pieces), chunks, headers)


def chat(client: OpenAI, model: str, user_turns: Iterable[str], *, system: str | None = None,
         max_tokens: int = 32, temperature: float | None = None, out: TextIO = sys.stdout) -> Iterator[Turn]:
    """Run the conversation, printing it to ``out`` as it streams; yields each answered turn."""
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for number, user_text in enumerate(user_turns, start=1):
        messages.append({"role": "user", "content": user_text})
        print(f"user> {user_text}\nassistant> ", end="", file=out, flush=True)
        turn = stream_turn(client, model, messages, max_tokens,
                           lambda text: print(text, end="", file=out, flush=True), temperature)
        print(f"\n[turn {number}: {turn.chunks} streamed chunks, {len(turn.text)} characters, "
              f"read side {turn.read_side}, {turn.hit_tokens} hit tokens]", file=out, flush=True)  # fmt: skip
        messages.append({"role": "assistant", "content": turn.text})
        yield turn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("turns", nargs="*", help="user messages, one per turn (default: lines from stdin)")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL),
                        help="the router's /v1 URL (default: $OPENAI_BASE_URL or %(default)s)")
    parser.add_argument("--model", help="the served model name (default: the first in /v1/models)")
    parser.add_argument("--system", help="a system message before the first turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length per turn (default: %(default)s)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The client insists on a key; the router needs none, so any placeholder does without one in the environment.
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY") or "none")
    model = args.model or client.models.list().data[0].id
    turns = args.turns or (line.strip() for line in sys.stdin if line.strip())
    for _ in chat(client, model, turns, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature):
        pass


if __name__ == "__main__":
    main()
