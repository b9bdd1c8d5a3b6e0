"""Client requests in, engine requests out: validation, tokenization, chat <-> completions.

Engines run without a tokenizer (``--skip-tokenizer-init``), so they only
ever get ``/v1/completions`` with the prompt as token ids. Token-id prompts
need nothing else; text prompts and chat need the router's ``tokenizer``,
which also turns the engine's ``token_ids`` back into chat messages.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

NO_TOKENIZER = "text prompts need `tokenizer` in the router config"

# Chat fields with the same meaning in a completions request.
_CHAT_TO_COMPLETION_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stream",
    "stream_options", "user",
)


class BadRequest(Exception):
    """A request the router refuses; ``message`` says why."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, reason: str = "bad_request",
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.reason = reason
        self.err_type = err_type


# What the client gets back: the DE's answer as is (token-id prompts), with
# text filled in from token ids (text prompts), or as chat (chat requests).
AnswerForm = Literal["raw", "text", "chat"]


@dataclass
class RoutedRequest:
    """A validated client request, ready for the engines."""

    body: dict[str, Any]  # a completions body with the prompt as token ids
    token_ids: list[int]
    stream: bool
    answer_form: AnswerForm = "raw"


def _token_ids(value: Any, vocab_size: int | None) -> list[int] | None:
    """``value`` as a token-id list, ``None`` if it is not one; raises on bad ids."""
    if not isinstance(value, list) or not value or not all(isinstance(t, int) for t in value):
        return None
    for t in value:
        if isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise BadRequest(f"bad token id {t!r} in `prompt`: ids must be non-negative integers{limit}",
                             param="prompt", reason="bad_token_ids")
    return list(value)


class PromptBuilder:
    def __init__(self, tokenizer_path: str | None, served_model_names: list[str]) -> None:
        self.served_model_names = served_model_names
        self.tokenizer = None
        if tokenizer_path is not None:
            from transformers import AutoTokenizer  # heavy; only when configured

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def build(self, raw: bytes, *, chat: bool) -> RoutedRequest:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed_json") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", reason="malformed_json")
        self._check_model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("`stream` must be true or false", param="stream")
        if chat:
            if body.get("max_completion_tokens") is not None:
                body["max_tokens"] = body["max_completion_tokens"]
            token_ids = self._chat_token_ids(body)
            out = {k: body[k] for k in _CHAT_TO_COMPLETION_FIELDS if k in body}
            answer_form: AnswerForm = "chat"
        else:
            token_ids, answer_form = self._prompt_token_ids(body)
            out = dict(body)
            # The router owns the PD handoff; a client's own parameters would mislead the engines.
            out.pop("kv_transfer_params", None)
        if answer_form != "raw":
            # Engines without a tokenizer answer token ids; the router makes the text.
            out["return_token_ids"] = True
        max_tokens = out.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise BadRequest(f"`max_tokens` must be a positive integer, got {max_tokens!r}", param="max_tokens",
                             reason="bad_max_tokens")
        out["prompt"] = token_ids
        return RoutedRequest(out, token_ids, stream, answer_form)

    def _check_model(self, body: dict[str, Any]) -> None:
        if "model" not in body:
            return  # vLLM's default: the engine's only model
        model = body["model"]
        if model not in self.served_model_names:
            raise BadRequest(
                f"The model `{model}` does not exist; this router serves {', '.join(self.served_model_names)}",
                status=404, param="model", reason="unknown_model", err_type="NotFoundError",
            )

    @property
    def _vocab_size(self) -> int | None:
        return len(self.tokenizer) if self.tokenizer is not None else None

    def _prompt_token_ids(self, body: dict[str, Any]) -> tuple[list[int], AnswerForm]:
        if "prompt" not in body:
            raise BadRequest("missing required field `prompt`", param="prompt", reason="missing_prompt")
        prompt = body["prompt"]
        # One prompt per request: a PD handoff carries one sequence.
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        token_ids = _token_ids(prompt, self._vocab_size)
        if token_ids is not None:
            return token_ids, "raw"
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is None:
                raise BadRequest(NO_TOKENIZER, param="prompt", reason="no_tokenizer")
            return list(self.tokenizer.encode(prompt)), "text"
        raise BadRequest(
            "`prompt` must be one non-empty string or one non-empty list of token ids "
            "(batched prompts are not supported: send one request per prompt)",
            param="prompt", reason="bad_prompt",
        )

    def _chat_token_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("`messages` must be a non-empty list of message objects", param="messages",
                             reason="missing_prompt")
        if self.tokenizer is None:
            raise BadRequest(NO_TOKENIZER, param="messages", reason="no_tokenizer")
        try:
            token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
        except Exception as exc:  # template errors: bad roles, missing template...
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages",
                             reason="bad_prompt") from None
        return list(token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def answer(self, content: bytes, form: AnswerForm) -> bytes:
        """A whole completions answer from an engine, in the client's form."""
        if form == "raw":
            return content
        completion = json.loads(content)
        if form == "text":
            for choice in completion.get("choices", []):
                choice["text"] = self._decode(choice.get("token_ids") or [])
            return json.dumps(completion).encode()
        choices = [
            {
                "index": choice.get("index", 0),
                "message": {"role": "assistant", "content": self._decode(choice.get("token_ids") or [])},
                "finish_reason": choice.get("finish_reason"),
                "logprobs": None,
            }
            for choice in completion.get("choices", [])
        ]
        return json.dumps({
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": completion.get("created", int(time.time())),
            "model": completion.get("model"),
            "choices": choices,
            "usage": completion.get("usage"),
        }).encode()

    async def answer_stream(self, lines: AsyncIterator[str], form: AnswerForm) -> AsyncIterator[bytes]:
        """An engine's completions SSE stream (form "text" or "chat") in the client's form.

        Text is decoded from all of a choice's tokens so far and only the new
        suffix sent, so characters spanning several tokens come out whole.
        """
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        tokens: dict[int, list[int]] = {}
        sent: dict[int, str] = {}

        def new_text(index: int, token_ids: list[int]) -> str:
            tokens.setdefault(index, []).extend(token_ids)
            text = self._decode(tokens[index])
            if text.endswith("\ufffd"):  # wait for the rest of a split character
                return ""
            delta, sent[index] = text[len(sent.get(index, "")):], text
            return delta

        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                yield b"data: [DONE]\n\n"
                continue
            event = json.loads(data)
            if form == "text":
                for choice in event.get("choices", []):
                    choice["text"] = new_text(choice.get("index", 0), choice.get("token_ids") or [])
                yield f"data: {json.dumps(event)}\n\n".encode()
                continue
            choices = []
            for choice in event.get("choices", []):
                index = choice.get("index", 0)
                delta: dict[str, Any] = {} if index in tokens else {"role": "assistant"}
                delta["content"] = new_text(index, choice.get("token_ids") or [])
                choices.append({"index": index, "delta": delta, "finish_reason": choice.get("finish_reason"),
                                "logprobs": None})
            chunk = {"id": chat_id, "object": "chat.completion.chunk", "created": event.get("created"),
                     "model": event.get("model"), "choices": choices}
            if event.get("usage") is not None:
                chunk["usage"] = event["usage"]
            yield f"data: {json.dumps(chunk)}\n\n".encode()
