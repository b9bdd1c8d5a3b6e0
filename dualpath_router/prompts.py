"""Client requests in, engine requests out: validation, tokenization, chat <-> completions.

Engines only ever get ``/v1/completions`` with the prompt as token ids, so
they may run with or without a tokenizer (``--skip-tokenizer-init``), and the
router alone decides how text and chat become tokens. Token-id prompts need
nothing else; text prompts and chat need the router's ``tokenizer``, which
also turns the engine's ``token_ids`` back into text and chat messages. An
engine without a tokenizer checks no prompt id against the vocabulary (an id
past it kills the engine), so every prompt's ids are checked here, whatever
their origin.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from nixl_backends.configuration import ConfigError

from dualpath_router.config import RouterConfig
from dualpath_router.detokenize import IncrementalDetokenizer
from dualpath_router.model_limits import ModelLimits, model_limits

NO_TOKENIZER = "text prompts need `tokenizer` in the router config"

# Chat fields with the same meaning in a completions request.
_CHAT_TO_COMPLETION_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stream",
    "stream_options", "user", "cache_salt",
)
# vLLM's own bounds on a cache salt (validate_cache_salt).
_MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


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


# vLLM starts its request ids with a request's X-Request-Id (its own random suffix keeps them apart), so one
# id sent to the PE and the DE finds the request in both engines' logs and the router's.
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id (printable ASCII without spaces, at most 128 characters), else a new one."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise BadRequest("X-Request-Id must be 1 to 128 printable ASCII characters without spaces",
                         param="X-Request-Id", reason="bad_request_id")  # fmt: skip
    return given


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
    # vLLM's cache_salt: the request's KV is stored and looked up in the salt's own chain.
    cache_salt: str | None = None
    # Sent to both engines as X-Request-Id (:func:`request_id_of`).
    request_id: str = ""


def _check_sampling(body: dict[str, Any], stream: bool) -> None:
    """What a DE would refuse, refused here before a PE prefills (and holds blocks) for nothing; vLLM's rules."""
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest(f"`n` must be a positive integer, got {_shown(n)}", param="n", reason="bad_n")
    if n > 1:
        # One prefill hands one prompt's KV to one decode; n choices would need n hand-offs.
        raise BadRequest("`n` > 1 is not served through the PD router: send n requests (with different seeds)",
                         param="n", reason="unsupported_n")
    if body.get("stream_options") is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options",
                         reason="bad_stream_options")
    min_tokens, max_tokens = body.get("min_tokens"), body.get("max_tokens")
    if min_tokens is not None:
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise BadRequest(f"`min_tokens` must be a non-negative integer, got {_shown(min_tokens)}",
                             param="min_tokens", reason="bad_min_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                             param="min_tokens", reason="bad_min_tokens")


def _checked_cache_salt(salt: Any) -> str | None:
    """The request's cache salt, refused as vLLM refuses it (a PE must not hold blocks for a 400 to come)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt",
                         reason="bad_cache_salt")
    if len(salt) > _MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise BadRequest(f"Parameter 'cache_salt' must be at most {_MAX_CACHE_SALT_CHARS} characters and must not "
                         "contain '@', '/', '\\', or NUL.", param="cache_salt", reason="bad_cache_salt")
    return salt


def _shown(value: Any) -> str:
    shown = json.dumps(value) if not isinstance(value, float) else repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def check_token_ids(token_ids: list[Any], where: str, limits: ModelLimits) -> list[int]:
    """``token_ids`` as ints, each in the vocabulary; the first bad one is named with its position."""
    if not token_ids:
        raise BadRequest(f"`{where}` is empty: a prompt needs at least one token id", param="prompt",
                         reason="bad_prompt")
    vocab = limits.vocab_size
    if not _all_in_vocabulary(token_ids, vocab):
        _raise_first_bad_id(token_ids, where, vocab)
    if limits.max_prompt_tokens is not None and len(token_ids) > limits.max_prompt_tokens:
        raise BadRequest(f"the prompt has {len(token_ids)} tokens, more than the model's "
                         f"{limits.max_prompt_tokens}", param="prompt", reason="prompt_too_long")
    return token_ids


def _all_in_vocabulary(token_ids: list[Any], vocab: int) -> bool:
    """Every id an ``int`` (not a bool) in ``[0, vocab)``, checked at C speed: this runs for every request.

    False also for what only the element-wise check can judge (an ``int``
    subclass, an id past int64): :func:`_raise_first_bad_id` has the last word.
    """
    if set(map(type, token_ids)) != {int}:
        return False
    try:
        ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    except OverflowError:
        return False
    return bool(ids.min() >= 0 and ids.max() < vocab)


def _raise_first_bad_id(token_ids: list[Any], where: str, vocab: int) -> None:
    """The first id that is not an integer in ``[0, vocab)``, named with its position; returns if there is none."""
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            kind = "null" if t is None else "a nested list" if isinstance(t, list) else type(t).__name__
            raise BadRequest(f"bad token id {_shown(t)} at {where}[{i}]: a token id is an integer, got {kind}",
                             param="prompt", reason="bad_token_ids")
        if not 0 <= t < vocab:
            raise BadRequest(f"bad token id {_shown(t)} at {where}[{i}]: token ids are in [0, {vocab}) "
                             f"(the model's vocabulary size is {vocab})", param="prompt", reason="bad_token_ids")


class PromptBuilder:
    def __init__(self, config: RouterConfig) -> None:
        self.served_model_names = config.served_model_names
        self.tokenizer = None
        if config.tokenizer is not None:
            from transformers import AutoTokenizer  # heavy; only when configured

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"tokenizer: cannot load {config.tokenizer}: {exc}") from None
        # The longest token's spelling (one character per byte-level symbol); bounds text before tokenizing.
        self._max_chars_per_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1) \
            if self.tokenizer is not None else 1
        self.limits = model_limits(
            len(self.tokenizer) if self.tokenizer is not None else None,
            config.model_config, config.vocab_size, config.max_prompt_tokens, config.max_model_len,
        )

    def build(self, raw: bytes, *, chat: bool) -> RoutedRequest:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed_json") from None
        except RecursionError:  # nesting deeper than the interpreter's recursion limit (~1000): the bound
            raise BadRequest("request body is nested too deeply", reason="malformed_json") from None
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
            where = "the tokenized messages"
        else:
            token_ids, answer_form, where = self._prompt_token_ids(body)
            out = dict(body)
            # The router owns the PD handoff; a client's own parameters would mislead the engines.
            out.pop("kv_transfer_params", None)
        if answer_form != "raw":
            # The router makes the text from the engine's token ids (engines may have no tokenizer).
            out["return_token_ids"] = True
        max_tokens = out.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise BadRequest(f"`max_tokens` must be a positive integer, got {max_tokens!r}", param="max_tokens",
                             reason="bad_max_tokens")
        _check_sampling(out, stream)
        cache_salt = _checked_cache_salt(out.get("cache_salt"))
        # The engines key a request by its id (an abort, for one): a client's own id could name another client's
        # request, so every request gets the router's.
        out["request_id"] = f"dualpath-{uuid.uuid4().hex}"
        # Every id, the tokenizer's too (it may know more ids than the model's embedding table).
        out["prompt"] = token_ids = check_token_ids(token_ids, where, self.limits)
        limit = self.limits.max_model_len
        # vLLM's rules (it clamps max_tokens to what the context leaves, but refuses these two).
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise BadRequest(f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request "
                             "fewer output tokens.", param="max_tokens", reason="bad_max_tokens")  # fmt: skip
        if limit is not None and len(token_ids) >= limit:
            raise BadRequest(f"The prompt (length {len(token_ids)}) plus the number of requested output tokens (at "
                             f"least 1) is longer than the maximum model length of {limit}.", param="prompt",
                             reason="too_long")  # fmt: skip
        return RoutedRequest(out, token_ids, stream, answer_form, cache_salt)

    def _check_model(self, body: dict[str, Any]) -> None:
        if "model" not in body:
            return  # vLLM's default: the engine's only model
        model = body["model"]
        if model not in self.served_model_names:
            raise BadRequest(
                f"The model `{model}` does not exist; this router serves {', '.join(self.served_model_names)}",
                status=404, param="model", reason="unknown_model", err_type="NotFoundError",
            )

    def _prompt_token_ids(self, body: dict[str, Any]) -> tuple[list[Any], AnswerForm, str]:
        """The prompt's token ids (checked by the caller), the answer's form, where the ids stand."""
        if "prompt" not in body:
            raise BadRequest("missing required field `prompt`", param="prompt", reason="missing_prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            # One prompt per request: a PD handoff carries one sequence.
            raise BadRequest("batched prompts are not supported: send one request per prompt", param="prompt",
                             reason="bad_prompt")
        where = "prompt"
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt, where = prompt[0], "prompt[0]"
        if isinstance(prompt, list):
            return prompt, "raw", where
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is None:
                raise BadRequest(NO_TOKENIZER, param="prompt", reason="no_tokenizer")
            self._bound_text(len(prompt), where)
            return list(self.tokenizer.encode(prompt)), "text", f"the tokenized {where}"
        raise BadRequest(f"`prompt` must be one non-empty string or one list of token ids, got {_shown(prompt)}",
                         param="prompt", reason="bad_prompt")

    def _chat_token_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("`messages` must be a non-empty list of message objects", param="messages",
                             reason="missing_prompt")
        if self.tokenizer is None:
            raise BadRequest(NO_TOKENIZER, param="messages", reason="no_tokenizer")
        self._bound_text(sum(len(json.dumps(m)) for m in messages), "messages")
        try:
            token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
        except Exception as exc:  # template errors: bad roles, missing template...
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages",
                             reason="bad_prompt") from None
        return list(token_ids)

    def _bound_text(self, chars: int, where: str) -> None:
        """Refuse text that must tokenize past ``max_prompt_tokens``, before spending the tokenizer on it.

        No token spells more than ``_max_chars_per_token`` characters, so text longer than that many per
        allowed token has too many tokens whatever it says.
        """
        limit = self.limits.max_prompt_tokens
        if limit is not None and chars > limit * self._max_chars_per_token:
            raise BadRequest(f"{where} has {chars} characters: more than {limit} tokens (max_prompt_tokens) can spell",
                             param="messages" if where == "messages" else "prompt", reason="too_long")  # fmt: skip

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

        Text is decoded incrementally per choice (:class:`IncrementalDetokenizer`),
        so characters spanning several tokens come out whole.
        """
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        tokens: dict[int, IncrementalDetokenizer] = {}

        def new_text(choice: dict[str, Any]) -> str:
            index = choice.get("index", 0)
            if index not in tokens:
                tokens[index] = IncrementalDetokenizer(self._decode)
            # A choice's last event (its finish reason set) sends whatever its detokenizer held back.
            return tokens[index].add(choice.get("token_ids") or [], last=choice.get("finish_reason") is not None)

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
                    choice["text"] = new_text(choice)
                yield f"data: {json.dumps(event)}\n\n".encode()
                continue
            choices = []
            for choice in event.get("choices", []):
                index = choice.get("index", 0)
                delta: dict[str, Any] = {} if index in tokens else {"role": "assistant"}
                delta["content"] = new_text(choice)
                choices.append({"index": index, "delta": delta, "finish_reason": choice.get("finish_reason"),
                                "logprobs": None})
            chunk = {"id": chat_id, "object": "chat.completion.chunk", "created": event.get("created"),
                     "model": event.get("model"), "choices": choices}
            if event.get("usage") is not None:
                chunk["usage"] = event["usage"]
            yield f"data: {json.dumps(chunk)}\n\n".encode()
