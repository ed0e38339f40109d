"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health.

Starlette handles HTTP; generation runs on the scheduler's thread
(runtime/scheduler.py), which hands each sampled token to the request's
asyncio queue. Text is made on the event loop with the same incremental
detokenizer and stop-string filter as the runtime's streaming, so a served
answer equals `foldline generate`'s for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.chat import chat_prompt
from ..runtime.checks import ContextFullError, TokenIdError
from ..runtime.sampling import Sampler
from ..runtime.scheduler import QueueFullError, Request, Scheduler
from ..runtime.streaming import IncrementalDetokenizer, StopStringFilter
from .protocol import ApiError, GenerationParams, chat_messages, completion_prompt, parse_params


@dataclass
class Outcome:
    """What a finished generation produced."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "length"


class ServedModel:
    """The model, its scheduler and its public name."""

    def __init__(self, model, model_id: str, max_queue: int = 64):
        self.model = model
        self.model_id = model_id
        self.created = int(time.time())
        self.scheduler = Scheduler(model, max_queue=max_queue)

    # ---- prompts -------------------------------------------------------------
    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return self._encode(prompt, add_bos=True)

    def chat_ids(self, body: dict) -> list[int]:
        try:
            text = chat_prompt(self.model, chat_messages(body))
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(400, f"the chat template could not be applied: {e}", param="messages") from e
        return self._encode(text, add_bos=False)  # the template writes its own BOS

    def _encode(self, text: str, add_bos: bool) -> list[int]:
        if self.model.manifest.tokenizer_path is None:
            raise ApiError(400, "this bundle has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.model.encode(text, add_bos=add_bos)

    # ---- generation ------------------------------------------------------------
    async def generate(self, ids: list[int], params: GenerationParams, outcome: Outcome) -> AsyncIterator[str]:
        """Yield text pieces as they settle; `outcome` is complete once the iteration ends."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        room = self.model.max_context - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        request = Request(
            prompt_ids=ids,
            max_tokens=max_tokens,
            on_token=lambda t: loop.call_soon_threadsafe(events.put_nowait, ("token", t)),
            on_finish=lambda reason, err: loop.call_soon_threadsafe(events.put_nowait, ("finish", reason, err)),
            sampler=Sampler(params.temperature, 0, params.top_p, params.seed),
            stop_ids=frozenset(self.model.eos_token_ids),
        )
        try:
            self.scheduler.submit(request)
        except QueueFullError as e:
            raise ApiError(503, str(e), kind="server_error", code="queue_full") from e
        except ContextFullError as e:
            raise ApiError(400, f"{e}", param="messages", code="context_length_exceeded") from e
        except TokenIdError as e:
            raise ApiError(400, str(e), param="prompt") from e
        has_tokenizer = self.model.manifest.tokenizer_path is not None
        detok = IncrementalDetokenizer(self.model.tokenizer) if has_tokenizer else None
        stops = StopStringFilter(params.stop)
        try:
            while True:
                event = await events.get()
                if event[0] == "token":
                    token = event[1]
                    outcome.completion_tokens += 1
                    if token in request.stop_ids or detok is None:
                        continue
                    piece = stops.push(detok.push(token))
                    if piece:
                        outcome.text += piece
                        yield piece
                    if stops.stopped:
                        request.cancel()
                        outcome.finish_reason = "stop"
                        return
                    continue
                _, reason, error = event
                if reason == "error":
                    raise ApiError(500, f"generation failed: {error}", kind="server_error")
                outcome.finish_reason = "stop" if reason == "stop" else "length"
                if detok is not None:
                    tail = stops.push(detok.flush())
                    if not stops.stopped:
                        tail += stops.flush()
                    else:
                        outcome.finish_reason = "stop"
                    if tail:
                        outcome.text += tail
                        yield tail
                return
        finally:
            request.cancel()  # a client gone mid-stream frees its row at the next step


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json_body(request: HttpRequest) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(served: ServedModel) -> Starlette:
    """The Starlette app; the scheduler starts and stops with it."""

    async def health(_: HttpRequest) -> Response:
        running, waiting = served.scheduler.load
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting,
                             "rows": served.scheduler.batch.rows})

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "foldline"}]})

    async def completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=False)

    async def chat_completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: HttpRequest, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
            params = parse_params(body, served.model_id, keys)
            if not chat and params.max_tokens is None:
                params.max_tokens = 16  # the OpenAI default for completions
            ids = served.chat_ids(body) if chat else served.completion_ids(completion_prompt(body))
            outcome = Outcome()
            pieces = served.generate(ids, params, outcome)
            first = await _first(pieces)  # submit now, so queue and context errors are answered as such
        except ApiError as e:
            return _error(e)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served.model_id}
        if params.stream:
            return StreamingResponse(_stream(meta, ids, params, outcome, first, pieces, chat),
                                     media_type="text/event-stream")
        try:
            async for _ in pieces:
                pass
        except ApiError as e:
            return _error(e)
        usage = _usage(ids, outcome)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                      "finish_reason": outcome.finish_reason, "logprobs": None}
            return JSONResponse({**meta, "object": "chat.completion", "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": None}
        return JSONResponse({**meta, "object": "text_completion", "choices": [choice], "usage": usage})

    async def _stream(meta: dict, ids: list[int], params: GenerationParams, outcome: Outcome, first: str | None,
                      pieces: AsyncIterator[str], chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**meta, "object": kind, "choices": [choice]}

        try:
            if chat:
                yield _sse(chunk("", None, role=True))
            if first is not None:
                yield _sse(chunk(first, None))
            async for piece in pieces:
                yield _sse(chunk(piece, None))
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
        yield _sse(chunk(None if chat else "", outcome.finish_reason))
        if params.include_usage:
            yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(ids, outcome)})
        yield "data: [DONE]\n\n"

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: _not_found, 405: _not_allowed})


async def _first(pieces: AsyncIterator[str]) -> str | None:
    """The first piece (None when the generation ends without text); runs the submit and its checks."""
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


def _usage(ids: list[int], outcome: Outcome) -> dict[str, int]:
    return {"prompt_tokens": len(ids), "completion_tokens": outcome.completion_tokens,
            "total_tokens": len(ids) + outcome.completion_tokens}


async def _not_found(request: HttpRequest, exc: Exception) -> Response:
    return _error(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: HttpRequest, exc: Exception) -> Response:
    return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
