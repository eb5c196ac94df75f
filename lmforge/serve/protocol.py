"""The OpenAI request schema that ``lmforge serve`` accepts, checked field by field.

Every problem becomes an ``APIError`` with the HTTP status and the OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``), naming the field and what it should be.
Parameters that a sampler of this kind cannot honour (penalties, logit_bias, suffix, best_of) are
refused rather than silently ignored; unknown fields are refused as OpenAI does.

The pydantic models (``CompletionBody``, ``ChatBody``) describe the request bodies for the OpenAPI
document (``/openapi.json``, ``/docs``) and name the fields each endpoint knows. The ``parse_*``
functions are what check a request, so that every refusal is a 400 with a one-line message in
OpenAI's format (FastAPI's own validation would answer 422 in a format OpenAI clients do not read).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from lmforge.chat import ROLES, check_messages
from lmforge.errors import LMForgeError
from lmforge.infer.logprobs import MAX_TOP_LOGPROBS

MAX_CHOICES = 16  # n times the number of prompts
MAX_STOP = 4
MAX_TOP_K = 2**31 - 1  # any k above the vocabulary is "off"; a huge one overflowed the sampler's int64 tensor
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_BODY_BYTES = 8 << 20  # far above any prompt that fits a context; a bigger body is refused unread
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule; the chat template writes the name inside a tag
UNSUPPORTED = "Not supported by lmforge serve: leave it out (only the value meaning 'off' is accepted)."


# ---- the request bodies, for the OpenAPI document ---------------------------------------------------

class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")  # unknown fields are refused


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat messages and tools may carry more (OpenAI's own fields)


class StreamOptions(_Closed):
    include_usage: bool = Field(False, description="Send a last chunk with the token counts.")


NonEmptyStr = Annotated[str, Field(min_length=1)]
# The vocabulary's size is the server's: create_app's document turns this mark into a "maximum".
TokenId = Annotated[int, Field(ge=0, description="A token id of the model's vocabulary.",
                               json_schema_extra={"x-token-id": True})]


class CommonBody(_Closed):
    """The fields both endpoints share."""

    model: str = Field(description="The id that GET /v1/models lists.")
    max_tokens: Optional[int] = Field(None, ge=1, description="Tokens to generate at most; the prompt and these "
                                      "must fit the model's context (default: /v1/completions 16, chat the rest). "
                                      "/v1/completions takes 0 with echo: the prompt is scored, nothing generated.")
    temperature: Optional[float] = Field(1.0, ge=0, le=2, description="0 = greedy.")
    top_p: Optional[float] = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1 = off.")
    top_k: Optional[int] = Field(0, ge=0, le=MAX_TOP_K, description="Keep the k most likely tokens; 0 = off.")
    n: Optional[int] = Field(1, ge=1, le=MAX_CHOICES, description=f"Choices per prompt (at most {MAX_CHOICES} "
                             "choices per request in all).")
    stream: Optional[bool] = Field(False, description="Server-Sent Events in OpenAI's chunk format.")
    stream_options: Optional[StreamOptions] = Field(None, description='Only with "stream": true.')
    stop: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)], None] = Field(
        None, description="Text that ends the reply (not included).")
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX, description="Same seed, same settings: same text.")
    user: Optional[str] = Field(None, description="Accepted and ignored.")
    metadata: Optional[dict[str, str]] = Field(None, description="Accepted and ignored.")
    store: Optional[bool] = Field(None, description="Accepted and ignored.")
    service_tier: Optional[str] = Field(None, description="Accepted and ignored.")
    presence_penalty: Optional[Literal[0]] = Field(None, description=UNSUPPORTED)
    frequency_penalty: Optional[Literal[0]] = Field(None, description=UNSUPPORTED)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=0, description=UNSUPPORTED)


class CompletionBody(CommonBody):
    """POST /v1/completions."""

    prompt: Union[str, Annotated[list[str], Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]] = Field(
        description="A string, a list of strings, a list of token ids or a list of such lists.")
    max_tokens: Optional[int] = Field(None, ge=0, description="Tokens to generate at most (default 16); the prompt "
                                      "and these must fit the model's context. 0 with echo: score the prompt only.")
    echo: Optional[bool] = Field(False, description="Start each choice's text with its prompt (with logprobs: "
                                 "its tokens and their log-probabilities, the first one null).")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Return each token's log-probability and the N most likely tokens at its position (0-20). They are the "
        "model's own distribution (temperature 1), whatever temperature, top_k and top_p sample from."))
    suffix: Optional[Literal[""]] = Field(None, description=UNSUPPORTED)
    best_of: Optional[Literal[1]] = Field(None, description=UNSUPPORTED)


class TextPart(_Open):
    type: Literal["text"]
    text: str


class Message(_Open):
    # check_messages: a message needs content, or tool_calls (an assistant's call)
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}}]})

    role: Literal[(*ROLES, "developer")] = Field(description="developer is read as system (OpenAI's newer name).")
    content: Union[str, list[TextPart], None] = Field(None, description="Required unless the message has "
                                                      "tool_calls.")
    tool_calls: Optional[list[dict[str, Any]]] = None


class FunctionSpec(_Open):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="A JSON Schema of the arguments.")


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class JSONSchemaFormat(_Open):
    name: str = Field(description="A name for the schema (not used).")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="The JSON Schema the reply follows.")
    strict: Optional[bool] = Field(None, description="Accepted: replies always follow the schema, and an object "
                                   "schema listing its properties allows no others unless it says so.")
    description: Optional[str] = None


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"] = Field(description="json_object: the reply is a JSON "
                                                                "object; json_schema: it validates against the "
                                                                "schema. Enforced by constrained decoding.")
    json_schema: Optional[JSONSchemaFormat] = Field(None, description='With "type": "json_schema".')


class NamedFunction(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(CommonBody):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = Field(
        None, description="required: the reply is one or more calls of the tools; a named function: calls of it "
        "(enforced by constrained decoding); none: the tools are not shown to the model.")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="The newer name of max_tokens.")
    parallel_tool_calls: Optional[bool] = Field(None, description="With tool_choice required or named: false "
                                                "allows one call only (default: several).")
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[bool] = Field(None, description=(
        "Return each content token's log-probability (choices[].logprobs.content). They are the model's own "
        "distribution (temperature 1), whatever temperature, top_k and top_p sample from."))
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: the N most "
                                        "likely tokens at each position too (0-20).")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorDetail


# ---- the checks --------------------------------------------------------------------------------------

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
    except RecursionError:  # thousands of nested [ or {: Python's parser gives up
        raise bad("the request body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_unicode(body)
    return body


def _check_unicode(body: dict[str, Any]) -> None:
    """A 400 naming the first string of ``body`` (a key or a value) that holds an unpaired UTF-16 surrogate
    (JSON's ``"\\ud800"`` escape alone): it is not Unicode text, and no tokenizer can encode it."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:  # iterative: the body may nest as deeply as the JSON parser allowed; depth first, in order
        where, value = todo.pop()
        if isinstance(value, dict):
            for key in value:
                _encodable(key, f"a key of {where or 'the body'}")
            todo.extend(reversed([(f"{where}.{key}" if where else key, item) for key, item in value.items()]))
        elif isinstance(value, list):
            todo.extend(reversed([(f"{where}[{i}]", item) for i, item in enumerate(value)]))
        elif isinstance(value, str):
            _encodable(value, f"'{where}'", where)


def _encodable(text: str, what: str, param: str | None = None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{what} contains an unpaired surrogate ({ascii(text[e.start])} at position {e.start}), which is "
                  "not Unicode text; send valid Unicode (encode each surrogate pair's character whole)",
                  param) from None


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


def _common(body: dict, allowed: set[str], model_id: str, min_tokens: int = 1) -> Common:
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
        max_tokens=_int(body, "max_tokens", None, min_tokens),
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 0, MAX_TOP_K),
        n=_int(body, "n", 1, 1, MAX_CHOICES),
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage", False)),
        stop=stop,
        seed=_int(body, "seed", None, SEED_MIN, SEED_MAX),
    )


@dataclass
class CompletionRequest:
    common: Common
    prompts: list[str | list[int]]
    echo: bool = False
    logprobs: int | None = None  # the N most likely tokens with each token's log-probability; None: none


def parse_completion(body: dict, model_id: str, vocab_size: int) -> CompletionRequest:
    common = _common(body, set(CompletionBody.model_fields), model_id, min_tokens=0)
    echo = _bool(body, "echo", False)
    if common.max_tokens == 0 and not echo:
        raise bad("'max_tokens': 0 generates nothing, so it needs \"echo\": true (score the prompt, with "
                  "\"logprobs\"); otherwise ask for 1 or more tokens", "max_tokens")
    if body.get("logprobs") is True or body.get("logprobs") is False:  # the chat endpoint's form
        raise bad(f"'logprobs' of /v1/completions is a number of most likely tokens, 0 to {MAX_TOP_LOGPROBS} "
                  "(true/false is the chat endpoint's form)", "logprobs")
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
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
    return CompletionRequest(common, prompts, echo=echo, logprobs=logprobs)


@dataclass
class Constraint:
    """What constrained decoding must enforce on a chat reply."""

    kind: str  # "json_object", "json_schema" or "tool_calls"
    schema: dict[str, Any] | None = None  # json_schema's schema
    tool: str | None = None  # tool_calls: the one tool named by tool_choice (None: any of the tools)
    parallel: bool = True  # tool_calls: several calls allowed


@dataclass
class ChatRequest:
    common: Common
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    top_logprobs: int | None = None  # with "logprobs": true, the N most likely tokens too (0 by default)
    constraint: Constraint | None = None


def parse_chat(body: dict, model_id: str) -> ChatRequest:
    if "max_completion_tokens" in body:  # the newer name of max_tokens
        body = dict(body)
        body["max_tokens"] = body.pop("max_completion_tokens")
    if "echo" in body or "prompt" in body:
        name = "echo" if "echo" in body else "prompt"
        raise bad(f"'{name}' belongs to /v1/completions; a chat request sends 'messages' (its prompt's "
                  "log-probabilities are scored with POST /v1/completions, echo and max_tokens 0)", name)
    common = _common(body, set(ChatBody.model_fields), model_id)
    messages = body.get("messages")
    if isinstance(messages, list):  # developer is OpenAI's newer name for system
        messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                    for m in messages]
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    try:
        messages = check_messages(messages)
    except LMForgeError as e:
        raise bad(str(e), "messages") from None
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                  "\"parameters\": {...}}}", "tools")
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not re.fullmatch(FUNCTION_NAME, name):
            raise bad(f"tools[{i}].function.name {json.dumps(name, ensure_ascii=False)} is not a function name: it "
                      f"must match {FUNCTION_NAME} (1 to 64 ASCII letters, digits, _ or -)",
                      f"tools[{i}].function.name")
        # as a forced call's grammar (lmforge.infer.constrain) checks them, whatever tool_choice is
        params = tool["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}] ({name}): \"parameters\" must be a JSON schema object, got "
                      f"{type(params).__name__}", "tools")
        kind = (params or {}).get("type", "object")
        if kind != "object" and kind != ["object"]:
            raise bad(f"tools[{i}] ({name}): \"parameters\" must describe an object (type \"object\"), got type "
                      f"{kind!r}: arguments are always a JSON object", "tools")
    parallel = _bool(body, "parallel_tool_calls", True)
    constraint = _tool_choice(body.get("tool_choice"), tools, parallel)
    if body.get("tool_choice") == "none":
        tools = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        if constraint is not None:
            raise bad("'response_format' and a forced tool call ('tool_choice' required or a named function) "
                      "exclude each other: the reply is either the calls or the JSON", "response_format")
        if tools:
            raise bad("'response_format' JSON with 'tools' the model may call is not supported: send "
                      "\"tool_choice\": \"none\" (a JSON reply) or \"required\" (a call)", "response_format")
        constraint = fmt
    return ChatRequest(common, messages, tools, top_logprobs=(top or 0) if logprobs else None,
                       constraint=constraint)


def _tool_choice(choice: Any, tools: list[dict[str, Any]], parallel: bool) -> Constraint | None:
    """The constraint ``tool_choice`` asks for: None for auto / none."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        name = None
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str) and set(choice) == {"type", "function"}):
        name = choice["function"]["name"]
    else:
        raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": NAME}}", "tool_choice")
    if not tools:
        raise bad("'tool_choice' forces a tool call but the request has no 'tools'", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name is not None and name not in names:
        raise bad(f"'tool_choice' names the function {name!r}, which is not among the tools ({', '.join(names)})",
                  "tool_choice")
    return Constraint("tool_calls", tool=name, parallel=parallel)


def _response_format(fmt: Any) -> Constraint | None:
    """The constraint ``response_format`` asks for: None for text."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if allowed is None or set(fmt) - allowed:
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                  "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be an object with a 'schema' (a JSON Schema object)",
                  "response_format")
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise bad(f"'response_format.json_schema' has unknown fields: {', '.join(sorted(extra))}", "response_format")
    schema = spec.get("schema")
    return Constraint("json_object") if not schema else Constraint("json_schema", schema=schema)
