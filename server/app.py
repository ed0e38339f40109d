"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health, /openapi.json.

Starlette handles HTTP; generation runs on the scheduler's thread
(server/served.py bridges it to asyncio). The event loop only moves bytes:
tokenization and chat templating run in a worker thread, so a huge prompt
never stalls `/health` or the other streams. Every error, including one
nobody foresaw, is answered as an OpenAI-style JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .connection import ClientGone, install_accept_backoff
from .guard import Guard
from .logprobs import LogprobFormatter
from .protocol import ApiError, generation_params
from .schema import ChatBody, CompletionBody, openapi_schema, parse_body
from .served import Generation, ServedModel, ServeOptions

__all__ = ["ServedModel", "ServeOptions", "create_app"]

log = logging.getLogger("foldline.server")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_at(data: Any) -> str | None:
    """Where the first string holding a lone surrogate (a JSON escape such as \\ud800) is: `messages[0].content`.

    Iterative, so a body nested as deep as the JSON parser allows is walked too.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            if any(_SURROGATE.search(key) for key in value):
                return path or "body"
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(list(value.items())))
    return None


def _parse_json(raw: bytes) -> Any:
    """The body as JSON text that can be tokenized: UTF-8 (strict: no encoded surrogates) without lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (at byte {e.start}: {e.reason})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    where = _surrogate_at(data)
    if where is not None:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate, which is not a character", param=where)
    return data


async def _json_body(request: HttpRequest, limit: int) -> Any:
    """The parsed body; 413 past `limit` bytes (checked on the declared length and on the bytes read).

    Parsed in a worker thread: a 1 MiB body takes milliseconds the event loop does not give.
    """
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("the client left before its request body was complete") from None
    return await asyncio.to_thread(_parse_json, b"".join(chunks))


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(gens: list[Generation]) -> dict[str, Any]:
    """The prompt once, every choice's completion tokens (as OpenAI counts n choices), and the prompt
    tokens a kept row already held (prompt_tokens_details.cached_tokens, as OpenAI reports its cache)."""
    prompt = len(gens[0].ids)
    completion = sum(g.outcome.completion_tokens for g in gens)
    cached = max(g.request.cached_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _drain(gen: Generation) -> None:
    async for _ in gen.pieces():
        pass


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, str | None]]:
    """(choice index, text piece) as the choices produce them, then (index, None) as each one ends.

    An ApiError of any choice ends the stream with that error.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                await queue.put((gen.index, piece, None))
            await queue.put((gen.index, None, None))
        except ApiError as e:
            await queue.put((gen.index, None, e))

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        for _ in range(len(gens)):
            while True:
                index, piece, error = await queue.get()
                if error is not None:
                    raise error
                yield index, piece
                if piece is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


def create_app(served: ServedModel) -> Starlette:
    """The Starlette app; the scheduler starts and stops with it."""
    options = served.options
    formatter = LogprobFormatter(served.model)

    async def health(_: HttpRequest) -> Response:
        running, waiting = served.scheduler.load
        problem = served.health()
        body = {"status": "ok" if problem is None else ("shutting_down" if served.draining else "unhealthy"),
                "running": running, "waiting": waiting, "rows": served.scheduler.batch.rows}
        if problem is not None:
            body["reason"] = problem
        return JSONResponse(body, status_code=200 if problem is None else 503)

    schema = openapi_schema(_version())

    async def openapi(_: HttpRequest) -> Response:
        return JSONResponse(schema)

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "foldline"}]})

    async def completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=False)

    async def chat_completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=True)

    async def _start(request: HttpRequest, chat: bool) -> list[Generation]:
        """Validate, tokenize (off the event loop) and submit every choice; any refusal is an ApiError."""
        if served.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
        data = await _json_body(request, options.max_body_bytes)
        if chat:
            body = parse_body(ChatBody, data)
            params = generation_params(body, served.model_id, chat=True, max_stop=options.max_stop)
            ids = await asyncio.to_thread(served.chat_ids, body.conversation())
            return Generation.start_choices(served, ids, params, prompt_param="messages")
        body = parse_body(CompletionBody, data)
        params = generation_params(body, served.model_id, chat=False, max_stop=options.max_stop)
        ids = await asyncio.to_thread(served.completion_ids, body.single_prompt())
        return Generation.start_choices(served, ids, params, prompt_param="prompt")

    def _choice(gen: Generation, chat: bool) -> dict:
        outcome, want_logprobs = gen.outcome, gen.params.logprobs is not None
        if chat:
            return {"index": gen.index, "message": {"role": "assistant", "content": outcome.text},
                    "finish_reason": outcome.finish_reason,
                    "logprobs": formatter.chat(outcome.logprobs) if want_logprobs else None}
        return {"index": gen.index, "text": outcome.text, "finish_reason": outcome.finish_reason,
                "logprobs": formatter.completion(outcome.logprobs) if want_logprobs else None}

    async def _serve(request: HttpRequest, chat: bool) -> Response:
        try:
            gens = await _start(request, chat)
        except ApiError as e:
            return _error(e)
        except ClientGone:  # logged by the connection (server/connection.py)
            return Response(status_code=400)  # nobody reads it: the connection is gone
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served.model_id}
        if gens[0].params.stream:
            return StreamingResponse(_stream(meta, gens, chat), media_type="text/event-stream")
        watchers = [asyncio.create_task(_watch_disconnect(request, gen)) for gen in gens]
        try:
            await asyncio.gather(*(_drain(gen) for gen in gens))
        except ApiError as e:
            return _error(e)
        finally:
            for watcher in watchers:
                watcher.cancel()
            for gen in gens:
                gen.cancel()  # a no-op once finished; frees the other rows when one choice failed
        usage = _usage(gens)
        choices = [_choice(gen, chat) for gen in gens]
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**meta, "object": kind, "choices": choices, "usage": usage})

    async def _stream(meta: dict, gens: list[Generation], chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        want_logprobs = gens[0].params.logprobs is not None
        # per choice: logprob items already sent, and the text offset of the next ones
        sent = [{"logprobs": 0, "offset": 0} for _ in gens]

        def chunk(gen: Generation, text: str | None, finish: str | None, role: bool = False) -> dict:
            outcome, mark = gen.outcome, sent[gen.index]
            logprobs = None
            if want_logprobs and not role:
                items = outcome.logprobs[mark["logprobs"]:]
                mark["logprobs"] = len(outcome.logprobs)
                logprobs = formatter.chat(items) if chat else formatter.completion(items, mark["offset"])
                if not chat:
                    mark["offset"] += sum(len(t) for t in logprobs["tokens"])
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": gen.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": gen.index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return {**meta, "object": kind, "choices": [choice]}

        pieces = _merged(gens)
        try:
            if chat:
                for gen in gens:
                    yield _sse(chunk(gen, "", None, role=True))
            async for index, piece in pieces:
                gen = gens[index]
                if piece is None:  # this choice is done
                    yield _sse(chunk(gen, None if chat else "", gen.outcome.finish_reason))
                else:
                    yield _sse(chunk(gen, piece, None))
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
            for gen in gens:
                gen.cancel()  # a no-op once finished; frees the rows when the client left mid-stream
        if gens[0].params.include_usage:
            yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(gens)})
        yield "data: [DONE]\n\n"

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        install_accept_backoff(asyncio.get_running_loop())
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop(timeout=5.0)

    endpoints = [("/health", health, "GET"), ("/v1/models", models, "GET"), ("/openapi.json", openapi, "GET"),
                 ("/v1/completions", completions, "POST"), ("/v1/chat/completions", chat_completions, "POST")]
    # each path with and without a trailing slash: a redirect would lose a POST's body (and name the Host)
    routes = [Route(path + slash, endpoint, methods=[method]) for path, endpoint, method in endpoints
              for slash in ("", "/")]
    middleware = [Middleware(Guard, hosts=options.allowed_hosts, bind_host=options.host,
                             cors_origins=options.cors_origins)]
    if options.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=options.cors_origins,
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal})
    app.router.redirect_slashes = False
    return app


def _version() -> str:
    try:
        return metadata.version("foldline")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _watch_disconnect(request: HttpRequest, gen: Generation) -> None:
    """Cancel the generation once the client of a non-streaming request has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    gen.cancel()


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    return _error(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    """405 with the `Allow` header HTTP requires (Starlette's exception carries it)."""
    response = _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
    allow = (getattr(exc, "headers", None) or {}).get("Allow")
    if allow:
        response.headers["allow"] = allow
    return response


async def _internal(request: HttpRequest, exc: Exception) -> Response:
    """A bug: the client still gets JSON; the traceback goes to the log."""
    return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error",
                           code="internal_error"))
