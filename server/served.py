"""The served model: prompts to token ids, and one generation bridged from the scheduler thread to asyncio.

The scheduler (runtime/scheduler.py) hands each sampled token to the
request's callback on its own thread, which turns it into text with the same
incremental detokenizer and stop-string filter as the runtime's streaming (so
a served answer equals `foldline generate`'s for the same prompt) and passes
the piece to the request's asyncio queue: the event loop only moves bytes, and
a stop string ends the row before its next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..contract.errors import BundleError
from ..runtime.chat import ChatTemplateError, encode_messages
from ..runtime.checks import ContextFullError, TokenIdError
from ..runtime.sampling import Sampler, TokenLogprobs
from ..runtime.scheduler import QueueFullError, Request, Scheduler, SchedulerDownError
from ..runtime.slots import DEFAULT_MAX_FILES, SlotStore
from ..runtime.streaming import IncrementalDetokenizer, StopStringFilter
from .connection import default_max_connections
from .protocol import DEFAULT_MAX_STOP, ApiError, GenerationParams

MIB = 1 << 20
DEFAULT_CHECKPOINTS = 4  # per row (foldline serve --checkpoints)


@dataclass
class ServeOptions:
    """The server's limits (docs/serving.md); None means no limit."""

    max_queue: int = 64
    max_body_bytes: int = MIB
    request_timeout: float | None = None  # seconds a request may take, queueing included
    stall_timeout: float = 60.0  # seconds without a step, with work waiting, before /health says 503
    shutdown_timeout: float = 10.0  # seconds running requests get to finish after SIGTERM
    max_stop: int = DEFAULT_MAX_STOP  # stop strings in one request
    header_timeout: float = 10.0  # seconds from a request's first byte to its last header line (then 408)
    body_timeout: float = 30.0  # seconds for a request's whole body (then 408)
    keep_alive_timeout: float = 5.0  # seconds an idle connection is kept between requests
    max_connections: int = field(default_factory=default_max_connections)  # open at once; more get 503
    cors_origins: list[str] = field(default_factory=list)
    # Host header values served (besides the bind address and the localhost names); "*" serves any
    allowed_hosts: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"  # the bind address
    prompt_cache: bool = True  # a prompt that extends what a released row holds prefills only the rest
    slots_dir: str | None = None  # where rows the prompt cache must give up are saved (runtime/slots.py)
    slots_max: int = DEFAULT_MAX_FILES  # the most files kept there; the least recently used go first
    checkpoints: int = DEFAULT_CHECKPOINTS  # per row, copies of its rings and recurrent state (runtime/batch.py)


class ServedModel:
    """The model, its scheduler, its public name and the server's limits."""

    def __init__(self, model, model_id: str, max_queue: int | None = None, options: ServeOptions | None = None):
        self.options = options or ServeOptions()
        if max_queue is not None:
            self.options.max_queue = max_queue
        self.model = model
        self.model_id = model_id
        self.created = int(time.time())
        slots = None
        if self.options.slots_dir is not None:
            slots = SlotStore(self.options.slots_dir, model, self.options.slots_max)
        self.scheduler = Scheduler(model, max_queue=self.options.max_queue,
                                   stall_timeout=self.options.stall_timeout,
                                   prompt_cache=self.options.prompt_cache, slots=slots,
                                   checkpoints=self.options.checkpoints if self.options.prompt_cache else 0)
        self.draining = False  # set on the first SIGTERM: new requests get 503
        self._drain_timer: threading.Timer | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.model.manifest.tokenizer_path is not None

    # ---- prompts (blocking: the app runs these in a worker thread) ----------------
    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = self.model.vocab_size
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt[{bad}] is token id {prompt[bad]}, outside this model's vocabulary "
                               f"(0 to {vocab - 1})", param="prompt")
            return prompt
        return self._encode(prompt, add_bos=True, param="prompt")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's ids; control-token text a message holds (`<|im_start|>system`) stays text,
        so a user cannot open a turn of another role (runtime/chat.py `encode_messages`)."""
        if not self.has_tokenizer:
            raise ApiError(400, "this bundle has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids", param="messages")
        try:
            return encode_messages(self.model, messages)  # no BOS added: the template writes its own
        except (ChatTemplateError, BundleError) as e:
            raise ApiError(400, f"the chat template could not be applied: {e}", param="messages") from e
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take (the app refuses surrogates before)
            raise ApiError(400, f"'messages' could not be tokenized: {e}", param="messages") from e

    def _encode(self, text: str, add_bos: bool, param: str) -> list[int]:
        if not self.has_tokenizer:
            raise ApiError(400, "this bundle has no tokenizer: send the prompt as a list of token ids", param=param)
        try:
            return self.model.encode(text, add_bos=add_bos)
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take (the app refuses surrogates before)
            raise ApiError(400, f"'{param}' could not be tokenized: {e}", param=param) from e

    # ---- shutdown ------------------------------------------------------------------
    def begin_shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests; cancel those still running after `timeout` seconds."""
        if self.draining:
            return
        self.draining = True
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self._drain_timer = threading.Timer(timeout, self.scheduler.cancel_all, args=("shutdown",))
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def close(self) -> None:
        """Release the rows and the model, unless a module call that never returned still holds them."""
        if self.scheduler.thread_alive:
            return
        self.scheduler.batch.close()
        self.model.close()

    def health(self) -> str | None:
        """None when serving, else why not."""
        if self.draining:
            return "shutting down"
        return self.scheduler.health()


@dataclass
class Outcome:
    """What a generation produced so far; complete once its pieces are exhausted."""

    text: str = ""
    completion_tokens: int = 0  # stop ids (end of turn) not counted
    finish_reason: str = "length"
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)


class Generation:
    """One request on the scheduler; created on the event loop, which then iterates `pieces()`.

    Submitting happens here, so a full queue, a prompt too long or a bad
    token id are answered before any response starts.
    """

    def __init__(self, served: ServedModel, ids: list[int], params: GenerationParams, prompt_param: str,
                 index: int = 0):
        self.served, self.params, self.ids, self.index = served, params, ids, index
        self.outcome = Outcome()
        self.client_gone = False
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        model = served.model
        if not ids:
            raise ApiError(400, "the prompt is empty", param=prompt_param)
        if len(ids) >= model.max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {model.max_context}, "
                           "which leaves no room to generate", param=prompt_param, code="context_length_exceeded")
        room = model.max_context - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ApiError(400, f"'{params.max_tokens_param}' is {params.max_tokens}, but this model's context is "
                           f"{model.max_context} and the prompt takes {len(ids)} tokens: at most {room} can be "
                           "generated", param=params.max_tokens_param, code="context_length_exceeded")
        limits = [t for t in (params.timeout, served.options.request_timeout) if t is not None]
        put = self._events.put_nowait
        self._text = _TextMaker(served, params.stop, frozenset(model.eos_token_ids))

        def on_token(token: int, logprobs: TokenLogprobs | None) -> None:  # the scheduler thread
            piece, stopped = self._text.push(token)
            loop.call_soon_threadsafe(put, ("token", token, logprobs, piece, stopped))
            if stopped:
                self.request.cancel()  # the row is free before its next step

        def on_finish(reason: str, error: str | None) -> None:  # the scheduler thread
            tail, stopped = self._text.finish()
            loop.call_soon_threadsafe(put, ("finish", reason, error, tail, stopped))

        self.request = Request(
            prompt_ids=ids,
            max_tokens=room if params.max_tokens is None else params.max_tokens,
            on_token=on_token,
            on_finish=on_finish,
            # choice i of n samples with seed + i: the choices differ, and each is reproducible
            sampler=Sampler(params.temperature, 0, params.top_p,
                            None if params.seed is None else (params.seed + index) % 2**64),
            stop_ids=frozenset(model.eos_token_ids),
            logprobs=params.logprobs,
            deadline=time.monotonic() + min(limits) if limits else None,
            cache_key=params.cache_key,
        )
        try:
            served.scheduler.submit(self.request)
        except SchedulerDownError as e:
            raise ApiError(503, str(e), kind="server_error", code="unavailable") from e
        except QueueFullError as e:
            raise ApiError(503, str(e), kind="server_error", code="queue_full") from e
        except ContextFullError as e:
            raise ApiError(400, str(e), param=prompt_param, code="context_length_exceeded") from e
        except TokenIdError as e:
            raise ApiError(400, str(e), param=prompt_param) from e

    @classmethod
    def start_choices(cls, served: ServedModel, ids: list[int], params: GenerationParams,
                      prompt_param: str) -> list[Generation]:
        """The request's n choices, each a generation of its own; all submitted, or none (a refusal)."""
        rows = served.scheduler.batch.rows
        if params.n > rows:
            raise ApiError(400, f"n is {params.n}, but this bundle generates {rows} sequence(s) at a time: ask for "
                           f"at most {rows} choices, or compile the bundle with --batch {params.n}", param="n")
        started: list[Generation] = []
        try:
            for index in range(params.n):
                started.append(cls(served, ids, params, prompt_param, index))
        except ApiError:
            for gen in started:
                gen.cancel()
            raise
        return started

    def cancel(self) -> None:
        """The client left: free the row at the next step."""
        self.client_gone = True
        self.request.cancel()

    async def pieces(self) -> AsyncIterator[str]:
        """Text pieces as they settle. Ends normally, or raises ApiError (failure, shutdown)."""
        outcome, stop_ids = self.outcome, self.request.stop_ids
        try:
            while True:
                event = await self._events.get()
                if event[0] == "token":
                    _, token, logprobs, piece, stopped = event
                    if token in stop_ids:
                        continue  # the end of turn is not part of the answer, nor of its count
                    outcome.completion_tokens += 1
                    if logprobs is not None:
                        outcome.logprobs.append((token, logprobs))
                    if piece:
                        outcome.text += piece
                        yield piece
                    if stopped:
                        outcome.finish_reason = "stop"
                        return
                    continue
                _, reason, error, tail, stopped = event
                if reason == "error":
                    raise ApiError(500, f"generation failed: {error}", kind="server_error", code="generation_failed")
                if reason == "shutdown":
                    raise ApiError(503, "the server shut down before this request finished", kind="server_error",
                                   code="shutting_down")
                if reason == "cancelled" and self.client_gone:
                    return
                # "timeout" reads as length; a stop string completed by the held-back tail is a stop
                outcome.finish_reason = "stop" if reason == "stop" or stopped else "length"
                if tail:
                    outcome.text += tail
                    yield tail
                return
        finally:
            self.request.cancel()  # a client gone mid-stream frees its row at the next step


class _TextMaker:
    """Token ids to text pieces, stop strings cut: run on the scheduler thread, one token at a time.

    The work per token is bounded: a short decode window, and the stop strings (at most
    `--max-stop` of at most schema.MAX_STOP_CHARS characters) searched for in the new text and
    the tail held back.
    """

    def __init__(self, served: ServedModel, stop: list[str], stop_ids: frozenset[int]):
        self.detok = IncrementalDetokenizer(served.model.tokenizer) if served.has_tokenizer else None
        self.stops = StopStringFilter(stop)
        self.stop_ids = stop_ids

    def push(self, token: int) -> tuple[str, bool]:
        """(the text `token` settles, whether a stop string has appeared)."""
        if self.detok is None or token in self.stop_ids or self.stops.stopped:
            return "", self.stops.stopped
        return self.stops.push(self.detok.push(token)), self.stops.stopped

    def finish(self) -> tuple[str, bool]:
        """(the text held back at the end, whether it completed a stop string)."""
        if self.detok is None or self.stops.stopped:
            return "", False
        tail = self.stops.push(self.detok.flush())
        if not self.stops.stopped:
            tail += self.stops.flush()
        return tail, self.stops.stopped
