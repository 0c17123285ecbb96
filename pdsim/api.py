"""Request parsing and response shapes of SGLang's `/generate` and its OpenAI-compatible endpoints.

Pure functions, no I/O. Tokens are fake and deterministic: output token i is "ok" (i == 0) or
" ok", so "Reply with the word ok." is answered with text containing "ok". Prompt length is
estimated at four characters per token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

TOKEN_ID = 3737
DEFAULT_MAX_NEW_TOKENS = {"generate": 128, "completions": 16, "chat": 128}


class RequestError(ValueError):
    """A request body SGLang would reject with 400."""


@dataclass(frozen=True)
class ParsedRequest:
    """The fields of a generation request that the simulation needs, whatever the endpoint."""

    endpoint: str  # "generate", "completions" or "chat"
    rid: str
    model: str
    prompt_tokens: int
    max_new_tokens: int
    stream: bool
    include_usage: bool
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


def count_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def token_text(n: int) -> str:
    """The text of the first n output tokens."""
    return "" if n <= 0 else "ok" + " ok" * (n - 1)


def token_delta(n_before: int, n_after: int) -> str:
    return token_text(n_after)[len(token_text(n_before)) :]


def _prompt_tokens_of(prompt: Any) -> int:
    if isinstance(prompt, str):
        return count_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return len(prompt)
        if len(prompt) != 1:
            raise RequestError("batched requests are not supported by pdsim")
        return _prompt_tokens_of(first)
    raise RequestError("the prompt must be a string, a list of token ids, or a list of one of them")


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    total = 0
    for message in messages:
        if not isinstance(message, Mapping):
            raise RequestError("each message must be an object")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        total += count_tokens(str(content)) + 4  # chat template overhead per message
    return total


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise RequestError(f"{name} must be an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be an integer") from None


def parse_request(endpoint: str, body: Any) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    if endpoint == "generate":
        if body.get("text") is not None:
            prompt_tokens = _prompt_tokens_of(body["text"])
        elif body.get("input_ids") is not None:
            prompt_tokens = _prompt_tokens_of(body["input_ids"])
        else:
            raise RequestError("Either text or input_ids should be provided.")
        sampling = body.get("sampling_params") or {}
        max_new = sampling.get("max_new_tokens")
        include_usage = False
    elif endpoint == "completions":
        prompt_tokens = _prompt_tokens_of(body.get("prompt"))
        max_new = body.get("max_tokens")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    elif endpoint == "chat":
        prompt_tokens = _chat_prompt_tokens(body.get("messages"))
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    else:
        raise RequestError(f"unknown endpoint {endpoint}")
    max_new_tokens = _int_or_none(max_new, "max_new_tokens")
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS[endpoint]
    if max_new_tokens < 1:
        raise RequestError("max_new_tokens must be at least 1 in pdsim")
    rid = body.get("rid") or uuid.uuid4().hex
    if isinstance(rid, list):
        rid = rid[0]
    return ParsedRequest(
        endpoint=endpoint,
        rid=str(rid),
        model=str(body.get("model") or "default"),
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        bootstrap_host=body.get("bootstrap_host"),
        bootstrap_port=_int_or_none(body.get("bootstrap_port"), "bootstrap_port"),
        bootstrap_room=_int_or_none(body.get("bootstrap_room"), "bootstrap_room"),
    )


def _openai_finish(reason: Mapping[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else str(reason["type"])


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None,
    }


class ResponseShaper:
    """Builds the non-stream body and the stream chunks of one request, in its endpoint's schema."""

    def __init__(self, parsed: ParsedRequest, model_name: str) -> None:
        self.p = parsed
        self.model = parsed.model if parsed.model != "default" else model_name
        self.created = int(time.time())
        self.started = time.monotonic()
        prefix = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}[parsed.endpoint]
        self.id = parsed.rid if parsed.rid.startswith(prefix) else f"{prefix}{parsed.rid}"

    def _meta(self, n: int, reason: Mapping[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.p.rid,
            "finish_reason": dict(reason) if reason is not None else None,
            "prompt_tokens": self.p.prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        if reason is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
        return meta

    def full(self, n: int, reason: Mapping[str, Any]) -> dict[str, Any]:
        if self.p.endpoint == "generate":
            return {
                "text": token_text(n),
                "output_ids": [TOKEN_ID] * n,
                "meta_info": self._meta(n, reason),
            }
        if self.p.endpoint == "completions":
            choice: dict[str, Any] = {
                "index": 0,
                "text": token_text(n),
                "logprobs": None,
                "finish_reason": _openai_finish(reason),
                "matched_stop": None,
            }
            obj = "text_completion"
        else:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": token_text(n),
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": _openai_finish(reason),
                "matched_stop": None,
            }
            obj = "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.p.prompt_tokens, n),
        }

    def chunks(
        self, n_before: int, n_after: int, reason: Mapping[str, Any] | None
    ) -> list[dict[str, Any]]:
        """The SSE payloads for the tokens n_before..n_after and, if given, the finish."""
        if self.p.endpoint == "generate":
            # SGLang's /generate streams the cumulative text.
            return [
                {
                    "text": token_text(n_after),
                    "output_ids": [TOKEN_ID] * n_after,
                    "meta_info": self._meta(n_after, reason),
                }
            ]
        delta = token_delta(n_before, n_after)
        out: list[dict[str, Any]] = []
        if self.p.endpoint == "completions":
            if delta or reason is not None:
                out.append(
                    self._chunk(
                        "text_completion",
                        {
                            "index": 0,
                            "text": delta,
                            "logprobs": None,
                            "finish_reason": _openai_finish(reason),
                            "matched_stop": None,
                        },
                    )
                )
        else:
            if delta:
                message: dict[str, Any] = {"content": delta}
                if n_before == 0:
                    message = {"role": "assistant", **message}
                out.append(
                    self._chunk(
                        "chat.completion.chunk",
                        {
                            "index": 0,
                            "delta": message,
                            "logprobs": None,
                            "finish_reason": None,
                            "matched_stop": None,
                        },
                    )
                )
            if reason is not None:
                out.append(
                    self._chunk(
                        "chat.completion.chunk",
                        {
                            "index": 0,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": _openai_finish(reason),
                            "matched_stop": None,
                        },
                    )
                )
        if reason is not None and self.p.include_usage:
            obj = "text_completion" if self.p.endpoint == "completions" else "chat.completion.chunk"
            usage_chunk = self._chunk(obj, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = usage(self.p.prompt_tokens, n_after)
            out.append(usage_chunk)
        return out

    def _chunk(self, obj: str, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
            "usage": None,
        }

    def stream_error(self, status: int, message: str) -> dict[str, Any]:
        """An OpenAI stream's error event (sglang/srt/entrypoints/openai/serving_base.py:223-237
        with the HTTPStatus name as type, serving_chat.py:2572-2577 @ 0.5.23)."""
        try:
            kind = HTTPStatus(status).name
        except ValueError:
            kind = "INTERNAL_SERVER_ERROR"
        return {
            "error": {
                "object": "error",
                "message": message,
                "type": kind,
                "param": None,
                "code": status,
            }
        }

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        if self.p.endpoint == "generate":
            # FastAPI's HTTPException body, which SGLang raises for scheduler-side aborts.
            return {"detail": message}
        kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError"
        )
        return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
