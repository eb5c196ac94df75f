"""The OpenAI request schema that ``lmforge serve`` accepts, checked field by field.

Every problem becomes an ``APIError`` with the HTTP status and the OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``), naming the field and what it should be.
Parameters that a sampler of this kind cannot honour (logprobs, penalties, echo) are refused
rather than silently ignored; unknown fields are refused as OpenAI does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.chat import check_messages
from lmforge.errors import LMForgeError

MAX_CHOICES = 16  # n times the number of prompts
MAX_STOP = 4


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {401: "authentication_error", 404: "invalid_request_error",
                              429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500
                                                           else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e}); send a JSON object with Content-Type: "
                  "application/json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if value < lo or (hi is not None and value > hi):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(f"'{name}' must be {span}, got {value}", name)
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {json.dumps(value)}", name)
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


@dataclass
class Common:
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    seed: int | None


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                 "seed", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "metadata",
                 "store", "service_tier"}


def _common(body: dict, allowed: set[str], model_id: str) -> Common:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: the id that GET /v1/models lists", "model")
    if model != model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_id}'", "model",
                       "model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"'{name}' is not supported by lmforge serve; leave it out", name)
    if body.get("logprobs") not in (None, False, 0):
        raise bad("'logprobs' is not supported by lmforge serve; leave it out", "logprobs")
    if body.get("logit_bias") not in (None, {}):
        raise bad("'logit_bias' is not supported by lmforge serve; leave it out", "logit_bias")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} non-empty strings", "stop")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    stream = _bool(body, "stream", False)
    if options is not None and not stream:
        raise bad("'stream_options' is only allowed with \"stream\": true", "stream_options")
    return Common(
        model=model,
        max_tokens=_int(body, "max_tokens", None, 1),
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 0),
        n=_int(body, "n", 1, 1, MAX_CHOICES),
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage", False)),
        stop=stop,
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
    )


@dataclass
class CompletionRequest:
    common: Common
    prompts: list[str | list[int]]
    echo: bool = False


def parse_completion(body: dict, model_id: str, vocab_size: int) -> CompletionRequest:
    common = _common(body, COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}, model_id)
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' (insertion) is not supported by lmforge serve", "suffix")
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' is not supported by lmforge serve; use 'n'", "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p)):
        prompts = prompt
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")
    for p in prompts:
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise bad(f"'prompt' has a token id outside the vocabulary (0..{vocab_size - 1})", "prompt")
    if len(prompts) * common.n > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n={common.n} choices is more than {MAX_CHOICES} per request", "n")
    return CompletionRequest(common, prompts, echo=_bool(body, "echo", False))


@dataclass
class ChatRequest:
    common: Common
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def parse_chat(body: dict, model_id: str) -> ChatRequest:
    allowed = COMMON_FIELDS | {"messages", "tools", "tool_choice", "max_completion_tokens", "parallel_tool_calls",
                               "response_format"}
    if "max_completion_tokens" in body:  # the newer name of max_tokens
        body = dict(body)
        body["max_tokens"] = body.pop("max_completion_tokens")
    common = _common(body, allowed, model_id)
    try:
        messages = check_messages(body.get("messages"))
    except LMForgeError as e:
        raise bad(str(e), "messages") from None
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                  "\"parameters\": {...}}}", "tools")
    choice = body.get("tool_choice")
    if choice == "none":
        tools = []
    elif choice not in (None, "auto"):
        raise bad("'tool_choice' can be \"auto\" or \"none\": lmforge serve does not force calls", "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported by lmforge serve",
                  "response_format")
    return ChatRequest(common, messages, tools)
