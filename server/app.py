"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health.

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
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .logprobs import LogprobFormatter
from .protocol import ApiError, generation_params
from .schema import ChatBody, CompletionBody, parse_body
from .served import Generation, ServedModel, ServeOptions

__all__ = ["ServedModel", "ServeOptions", "create_app"]

log = logging.getLogger("foldline.server")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def _json_body(request: HttpRequest, limit: int) -> Any:
    """The parsed body; 413 past `limit` bytes (checked on the declared length and on the bytes read)."""
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


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
            params = generation_params(body, served.model_id, chat=True)
            ids = await asyncio.to_thread(served.chat_ids, body.conversation())
            return Generation.start_choices(served, ids, params, prompt_param="messages")
        body = parse_body(CompletionBody, data)
        params = generation_params(body, served.model_id, chat=False)
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
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop(timeout=5.0)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    middleware = []
    if options.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=options.cors_origins,
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal})


async def _watch_disconnect(request: HttpRequest, gen: Generation) -> None:
    """Cancel the generation once the client of a non-streaming request has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    gen.cancel()


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    return _error(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


async def _internal(request: HttpRequest, exc: Exception) -> Response:
    """A bug: the client still gets JSON; the traceback goes to the log."""
    return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error",
                           code="internal_error"))
