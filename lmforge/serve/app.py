"""The HTTP side of ``lmforge serve``: OpenAI's ``/v1`` endpoints over a batching ``Engine``.

Each choice of a request is one engine request; their events come back from the engine thread
through ``loop.call_soon_threadsafe`` into an asyncio queue, so the event loop never blocks on the
model. Streams are Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``.
A client that goes away cancels its choices at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lmforge.chat import TOOL_CALL_OPEN, choice_seed, parse_tool_calls
from lmforge.errors import LMForgeError
from lmforge.infer.constrain import GrammarCompiler
from lmforge.infer.engine import Engine, EngineClosed, QueueFull, SamplingParams
from lmforge.infer.logprobs import TokenLogprob
from lmforge.serve.logprobs import Entry, TokenScores, chat_logprobs, completion_logprobs
from lmforge.serve.page import add_chat_page
from lmforge.serve.protocol import (MAX_BODY_BYTES, APIError, ChatBody, ChatRequest, Common, CompletionBody,
                                    CompletionRequest, ErrorBody, bad, parse_chat, parse_completion, parse_json)
from lmforge.serve.text import ChoiceText


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    text: ChoiceText
    finish_reason: str | None = None
    tokens: int = 0
    request: Any = None
    echo: str | None = None  # the prompt's text, when the reply starts with it
    scores: TokenScores | None = None  # with logprobs: the tokens' log-probabilities
    separated: bool = False  # the prompt starts with the document separator the server added
    _score: TokenLogprob | None = field(default=None, repr=False)  # the next token's, until it arrives

    @property
    def text_start(self) -> int:
        """Where the generated text starts in the reply's text."""
        return len(self.echo) if self.echo is not None else 0


class Generation:
    """The choices of one HTTP request, running on the engine. ``top_logprobs`` (None: none) asks for
    log-probabilities with that many most likely tokens; with echo, of the prompt's tokens too."""

    def __init__(self, engine: Engine, choices: list[Choice], common: Common, max_tokens: int,
                 top_logprobs: int | None = None, grammar: Any = None):
        self.engine, self.choices, self.common = engine, choices, common
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.grammar = grammar  # the constraint every choice's reply follows (lmforge.infer.constrain)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = len(choices)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for choice in self.choices:
                c = self.common
                seed = None if c.seed is None else choice_seed(c.seed, choice.index)
                scored = choice.echo is not None and (self.top_logprobs is not None or self.max_tokens == 0)
                params = SamplingParams(self.max_tokens, c.temperature, c.top_p, c.top_k, seed,
                                        top_logprobs=self.top_logprobs,
                                        prompt_logprobs=(self.top_logprobs or 0) if scored else None,
                                        grammar=self.grammar)

                def on_event(event, index=choice.index):
                    loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

                choice.request = self.engine.submit(choice.prompt_ids, params, on_event)
        except QueueFull as e:
            self.cancel()
            raise APIError(429, str(e), code="server_busy") from None
        except EngineClosed as e:
            self.cancel()
            raise APIError(503, str(e), code="shutting_down") from None
        except LMForgeError as e:  # settings the sampler refuses
            self.cancel()
            raise bad(str(e)) from None

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.request is not None:
                choice.request.cancel()

    async def events(self) -> AsyncIterator[tuple[Choice, str, list[Entry] | None]]:
        """Yields ``(choice, piece, logprobs)`` for sendable text (an echoed prompt first) and
        ``(choice, "", logprobs)`` once when a choice ends; ``logprobs``: the entries of the tokens
        whose text starts in what has been sent (None without logprobs)."""
        for choice in self.choices:
            if choice.echo is not None and choice.scores is None:
                yield choice, choice.echo, None
        while self.open:
            index, (kind, value) = await self.queue.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if kind == "prompt_logprobs":
                if choice.scores is None:  # max_tokens 0 without logprobs: its echo is out already
                    continue
                for i, (token, score) in enumerate(zip(choice.prompt_ids, value)):
                    choice.scores.add(token, score, in_text=not (i == 0 and choice.separated))
                choice.scores.skip_to(choice.text_start)  # generated text starts after the echo, exactly
                yield choice, choice.echo, choice.scores.take()
                continue
            if kind == "logprob":
                choice._score = value
                continue
            if kind == "token":
                choice.tokens += 1
                if choice.scores is not None:
                    choice.scores.add(value, choice._score)
                piece = choice.text.push(value)
                if choice.text.stopped:
                    choice.request.cancel()
                    piece += choice.text.finish()
                    choice.finish_reason = "stop"
                    self.open -= 1
                if piece:
                    yield choice, piece, self._sent_scores(choice)
                if choice.finish_reason:
                    yield choice, "", self._sent_scores(choice, final=True)
                continue
            if kind == "error":
                self.cancel()
                raise APIError(500, str(value), code="generation_failed")
            if kind == "grammar_error":  # the request's schema is at fault: a client error, even mid-reply
                self.cancel()
                tools = self.grammar.kind == "tool_calls"
                what = "a tool's parameters schema" if tools else "the schema"
                raise APIError(400, f"constrained decoding failed: {value}: {what} may admit no finite value along "
                               "the way this reply took (e.g. it requires itself through $ref with no way out); make "
                               "that recursion optional or remove it", "tools" if tools else "response_format",
                               code="invalid_schema")
            piece = choice.text.finish()
            choice.finish_reason = "stop" if value == "cancelled" else value
            self.open -= 1
            if piece:
                yield choice, piece, self._sent_scores(choice)
            yield choice, "", self._sent_scores(choice, final=True)

    @staticmethod
    def _sent_scores(choice: Choice, final: bool = False) -> list[Entry] | None:
        """The log-probabilities of the tokens whose text has been sent; ``final``: of every token left
        (the held-back tool section's too), except those a stop string cut off."""
        if choice.scores is None:
            return None
        if final and not choice.text.stopped:
            return choice.scores.take()
        return choice.scores.take(choice.text_start + (len(choice.text.text) if final else choice.text.sent))

    async def collect(self, request: Request) -> tuple[dict[int, list[str]], dict[int, list[Entry]]]:
        """All text of every choice (for a reply that is not streamed) and, with logprobs, all their
        entries; the choices are cancelled if the client disconnects before they finish."""
        texts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        scores: dict[int, list[Entry]] = {c.index: [] for c in self.choices}

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)
            self.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for choice, piece, entries in self.events():
                texts[choice.index].append(piece)
                scores[choice.index].extend(entries or ())
        finally:
            watcher.cancel()
            self.cancel()
        return texts, scores

    def usage(self) -> dict[str, int]:
        prompt = sum(len(c.prompt_ids) for c in {id(c.prompt_ids): c for c in self.choices}.values())
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(engine: Engine, tokenizer: Any, model_id: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application; ``lmforge.serve.server.serve`` runs it with uvicorn."""
    app = FastAPI(title="lmforge serve", version="1", redoc_url=None,
                  description="OpenAI-compatible API over an lmforge checkpoint.")
    app.openapi = lambda: app.openapi_schema or _openapi_document(app, model_id, tokenizer.vocab_size, n_ctx)
    created = int(time.time())
    n_ctx = engine.n_ctx
    compilers: list[GrammarCompiler] = []  # built at the first constrained request (~0.2 s at 50k tokens)
    # A prompt longer than this cannot fit the context, and is refused before it is tokenized: tokenizing
    # megabytes holds the event loop (a 6.9 MB prompt kept /health waiting 14 s).
    max_chars = tokenizer.max_chars(n_ctx)

    def encode(text: str, param: str) -> list[int]:
        if len(text) > max_chars:
            raise bad(f"This model's maximum context length is {n_ctx} tokens. However, your prompt has "
                      f"{len(text):,} characters, more than {n_ctx} tokens can hold (this server refuses prompts "
                      f"over {max_chars:,} characters without tokenizing them); shorten the prompt.", param)
        return tokenizer.encode(text)

    def grammar_for(req: ChatRequest):
        """The compiled grammar of the request's constraint; a 400 naming what cannot be compiled."""
        c = req.constraint
        if c is None:
            return None
        param = "tools" if c.kind == "tool_calls" else "response_format"
        try:
            if not compilers:
                compilers.append(GrammarCompiler(tokenizer, engine.model.config.vocab_size))
            compiler = compilers[0]
            if c.kind == "json_object":
                return compiler.json_object()
            if c.kind == "json_schema":
                return compiler.json_schema(c.schema)
            return compiler.tool_calls(req.tools, name=c.tool, parallel=c.parallel)
        except LMForgeError as e:
            where = "response_format.json_schema.schema: " if c.kind == "json_schema" else ""
            raise bad(f"{where}{e}", param) from None

    def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
        if e.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        message = {404: "no such endpoint; see GET / (the chat page), GET /v1/models, POST /v1/completions, "
                   "POST /v1/chat/completions",
                   405: "method not allowed on this endpoint"}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message), headers=getattr(e, "headers", None))  # 405: Allow

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _e: ClientDisconnect):
        # The client left while sending its body: no one reads a reply, and a traceback would tell nothing.
        logging.getLogger("uvicorn.error").warning("%s %s: the client disconnected while sending the request body",
                                                   request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def _crash(_request: Request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key, reject=error_response)

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "lmforge",
                "context_length": n_ctx}

    add_chat_page(app)  # GET /: the browser chat page (no key needed to load it)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "running": engine.running, "waiting": engine.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_id}'", "model",
                           "model_not_found")
        return model_card()

    def max_tokens_for(common: Common, prompts: list[list[int]], default: int | None, prompt_param: str) -> int:
        longest = max(len(p) for p in prompts)
        room = n_ctx - longest
        if common.max_tokens == 0 and room >= 0:  # scoring a prompt: it may fill the context
            return 0
        if room < 1:
            raise bad(f"This model's maximum context length is {n_ctx} tokens. However, your prompt has "
                      f"{longest} tokens, which leaves no room for the reply; shorten the prompt.", prompt_param)
        wanted = common.max_tokens if common.max_tokens is not None else min(default or room, room)
        if longest + wanted > n_ctx:
            raise bad(f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                      f"{longest + wanted} tokens ({longest} in the prompt, {wanted} for the completion). "
                      f"Reduce the prompt or max_tokens (at most {room} here).", "max_tokens")
        return wanted

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = parse_completion(parse_json(await _body(request)), model_id, tokenizer.vocab_size)
        c = req.common
        # A text prompt starts after the document separator, as every document did in training.
        prompt_ids = [[tokenizer.eos_id, *encode(p, "prompt")] if isinstance(p, str) else list(p)
                      for p in req.prompts]
        max_tokens = max_tokens_for(c, prompt_ids, default=16, prompt_param="prompt")  # 16: OpenAI's default
        choices = []
        for i, (prompt, ids) in enumerate(zip(req.prompts, prompt_ids)):
            echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if req.echo else None
            for j in range(c.n):
                choices.append(Choice(i * c.n + j, ids, ChoiceText(tokenizer, c.stop), echo=echo,
                                      separated=isinstance(prompt, str),
                                      scores=None if req.logprobs is None else TokenScores(tokenizer)))
        gen = Generation(engine, choices, c, max_tokens, top_logprobs=req.logprobs)
        gen.start()
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choice_list: list[dict], usage: dict | None = None) -> dict:
            body = {"id": rid, "object": "text_completion", "created": now, "model": model_id, "choices": choice_list}
            if usage is not None:
                body["usage"] = usage
            return body

        def logprobs(entries: list[Entry] | None) -> dict | None:
            return None if entries is None else completion_logprobs(tokenizer, entries)

        if c.stream:
            async def stream():
                async for ch, piece, entries in gen.events():
                    if piece or entries:
                        yield _sse(chunk([{"index": ch.index, "text": piece, "logprobs": logprobs(entries),
                                           "finish_reason": None}]))
                    if not piece:
                        yield _sse(chunk([{"index": ch.index, "text": "", "logprobs": None,
                                           "finish_reason": ch.finish_reason}]))
                if c.include_usage:
                    yield _sse(chunk([], gen.usage()))

            return _stream_response(stream(), gen)
        texts, scores = await gen.collect(request)
        return chunk([{"index": ch.index, "text": "".join(texts[ch.index]),
                       "logprobs": logprobs(scores[ch.index] if ch.scores is not None else None),
                       "finish_reason": ch.finish_reason} for ch in choices], gen.usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatRequest = parse_chat(parse_json(await _body(request)), model_id)
        c = req.common
        try:
            # A ChatText: encode() makes the messages' spellings of special tokens text, the template's markers special
            prompt = tokenizer.apply_chat_template(req.messages, tools=req.tools or None)
        except LMForgeError as e:
            raise bad(str(e), "messages") from None
        ids = [tokenizer.eos_id, *encode(prompt, "messages")]
        max_tokens = max_tokens_for(c, [ids], default=None, prompt_param="messages")
        grammar = grammar_for(req)
        marker = TOOL_CALL_OPEN if req.tools else None
        choices = [Choice(j, ids, ChoiceText(tokenizer, c.stop, hold_marker=marker),
                          scores=None if req.top_logprobs is None else TokenScores(tokenizer)) for j in range(c.n)]
        gen = Generation(engine, choices, c, max_tokens, top_logprobs=req.top_logprobs, grammar=grammar)
        gen.start()
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choice_list: list[dict], usage: dict | None = None) -> dict:
            body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                    "system_fingerprint": None, "choices": choice_list}
            if usage is not None:
                body["usage"] = usage
            return body

        def tool_section(ch: Choice) -> tuple[str, list]:
            """What the held-back tool section becomes: leftover content and the calls."""
            held = ch.text.held
            if not held:
                return "", []
            # cut by max_tokens or the context: an unfinished last call is dropped, the complete ones are kept
            return parse_tool_calls(held, cut=ch.finish_reason == "length")

        def finish_reason(ch: Choice, calls: list) -> str | None:
            """"tool_calls" for a reply that ended with calls; "length" for one that was cut, calls or not."""
            return "tool_calls" if calls and ch.finish_reason != "length" else ch.finish_reason

        def logprobs(entries: list[Entry] | None) -> dict | None:
            return None if entries is None else chat_logprobs(tokenizer, entries)

        if c.stream:
            async def stream():
                for ch in choices:
                    yield _sse(chunk([{"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
                async for ch, piece, entries in gen.events():
                    if piece:
                        yield _sse(chunk([{"index": ch.index, "delta": {"content": piece},
                                           "logprobs": logprobs(entries), "finish_reason": None}]))
                        continue
                    content, calls = tool_section(ch)
                    reason = ch.finish_reason
                    if content or entries:
                        yield _sse(chunk([{"index": ch.index, "delta": {"content": content} if content else {},
                                           "logprobs": logprobs(entries), "finish_reason": None}]))
                    if calls:
                        reason = finish_reason(ch, calls)
                        deltas = [{"index": k, **call.to_openai()} for k, call in enumerate(calls)]
                        yield _sse(chunk([{"index": ch.index, "delta": {"tool_calls": deltas}, "logprobs": None,
                                           "finish_reason": None}]))
                    yield _sse(chunk([{"index": ch.index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
                if c.include_usage:
                    yield _sse(chunk([], gen.usage()))

            return _stream_response(stream(), gen)
        _, scores = await gen.collect(request)
        out = []
        for ch in choices:
            sent = ch.text.text[:ch.text.sent]
            rest, calls = tool_section(ch)
            message: dict[str, Any] = {"role": "assistant", "content": (sent + rest) if (sent + rest) or not calls
                                       else None}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            out.append({"index": ch.index, "message": message,
                        "logprobs": logprobs(scores[ch.index] if ch.scores is not None else None),
                        "finish_reason": finish_reason(ch, calls)})
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_id,
                "system_fingerprint": None, "choices": out, "usage": gen.usage()}

    return app


def _openapi_document(app: FastAPI, model_id: str, vocab_size: int, n_ctx: int) -> dict[str, Any]:
    """FastAPI's document plus what its routes cannot tell it (they read raw JSON, see protocol.py):
    the request bodies, the error body, and this server's model id, vocabulary and context."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # no route answers FastAPI's 422
        schemas.pop(name, None)
    for operations in doc["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)

    def limit_token_ids(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("x-token-id", False):
                node["maximum"] = vocab_size - 1
            for value in node.values():
                limit_token_ids(value)
        elif isinstance(node, list):
            for value in node:
                limit_token_ids(value)

    def add(model) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        limit_token_ids(schema)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"description": "OpenAI's error body", "content": {"application/json": {"schema": add(ErrorBody)}}}
    for path, body in (("/v1/completions", CompletionBody), ("/v1/chat/completions", ChatBody)):
        operation = doc["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": add(body)}}}
        fields = schemas[body.__name__]["properties"]
        fields["model"]["enum"] = [model_id]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in fields:  # the prompt takes at least one position
                fields[name]["anyOf"][0]["maximum"] = n_ctx - 1
        operation["responses"] = {
            "200": {"description": "The reply; with \"stream\": true, Server-Sent Events ending in data: [DONE]",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{code: error for code in ("400", "401", "404", "413", "429", "503")}}
    app.openapi_schema = doc
    return doc


class APIKeyCheck:
    """Plain ASGI middleware: ``/v1`` requests need ``Authorization: Bearer KEY``. (Starlette's
    ``BaseHTTPMiddleware`` would hide client disconnects from the endpoints.)"""

    def __init__(self, app, api_key: str, reject):
        self.app, self.key, self.reject = app, api_key.encode(), reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                what = "Incorrect API key provided" if token else "Missing API key: send 'Authorization: Bearer KEY'"
                await self.reject(APIError(401, what, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _body(request: Request) -> bytes:
    """The request body, refused (413) as soon as it passes MAX_BODY_BYTES instead of held in memory."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _stream_response(body: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    async def with_done():
        try:
            async for event in body:
                yield event
        except APIError as e:  # headers are sent already: report the error in the stream
            yield _sse(e.body())
        finally:
            gen.cancel()  # a client that left, or an error: stop generating for it
        yield "data: [DONE]\n\n"

    return StreamingResponse(with_done(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
