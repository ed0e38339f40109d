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
from .served import Generation, Outcome, ServedModel, ServeOptions

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


def _usage(ids: list[int], outcome: Outcome) -> dict[str, int]:
    return {"prompt_tokens": len(ids), "completion_tokens": outcome.completion_tokens,
            "total_tokens": len(ids) + outcome.completion_tokens}


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

    async def _start(request: HttpRequest, chat: bool) -> Generation:
        """Validate, tokenize (off the event loop) and submit; any refusal is an ApiError."""
        if served.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
        data = await _json_body(request, options.max_body_bytes)
        if chat:
            body = parse_body(ChatBody, data)
            params = generation_params(body, served.model_id, chat=True)
            ids = await asyncio.to_thread(served.chat_ids, body.conversation())
            return Generation(served, ids, params, prompt_param="messages")
        body = parse_body(CompletionBody, data)
        params = generation_params(body, served.model_id, chat=False)
        ids = await asyncio.to_thread(served.completion_ids, body.single_prompt())
        return Generation(served, ids, params, prompt_param="prompt")

    async def _serve(request: HttpRequest, chat: bool) -> Response:
        try:
            gen = await _start(request, chat)
        except ApiError as e:
            return _error(e)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served.model_id}
        if gen.params.stream:
            return StreamingResponse(_stream(meta, gen, chat), media_type="text/event-stream")
        watcher = asyncio.create_task(_watch_disconnect(request, gen))
        try:
            async for _ in gen.pieces():
                pass
        except ApiError as e:
            return _error(e)
        finally:
            watcher.cancel()
        outcome, want_logprobs = gen.outcome, gen.params.logprobs is not None
        usage = _usage(gen.ids, outcome)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                      "finish_reason": outcome.finish_reason,
                      "logprobs": formatter.chat(outcome.logprobs) if want_logprobs else None}
            return JSONResponse({**meta, "object": "chat.completion", "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason,
                  "logprobs": formatter.completion(outcome.logprobs) if want_logprobs else None}
        return JSONResponse({**meta, "object": "text_completion", "choices": [choice], "usage": usage})

    async def _stream(meta: dict, gen: Generation, chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        outcome, want_logprobs = gen.outcome, gen.params.logprobs is not None
        sent = {"logprobs": 0, "offset": 0}  # logprob items already sent; text offset of the next ones

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            logprobs = None
            if want_logprobs and not role:
                items = outcome.logprobs[sent["logprobs"]:]
                sent["logprobs"] = len(outcome.logprobs)
                logprobs = formatter.chat(items) if chat else formatter.completion(items, sent["offset"])
                if not chat:
                    sent["offset"] += sum(len(t) for t in logprobs["tokens"])
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return {**meta, "object": kind, "choices": [choice]}

        pieces = gen.pieces()
        try:
            if chat:
                yield _sse(chunk("", None, role=True))
            async for piece in pieces:
                yield _sse(chunk(piece, None))
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
            gen.cancel()  # a no-op once finished; frees the row when the client left mid-stream
        yield _sse(chunk(None if chat else "", outcome.finish_reason))
        if gen.params.include_usage:
            yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(gen.ids, outcome)})
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
