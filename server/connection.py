"""Connection hygiene under uvicorn: time limits on a request's headers and body, a cap on open
connections, answers in every phase of a shutdown, and quiet logs for what clients do wrong.

uvicorn's h11 protocol has a keep-alive timeout but nothing that ends a client
that never finishes its headers or its body, and its `limit_concurrency` and
its protocol errors answer text/plain. `GuardedH11Protocol` adds, per
connection (limits read from the live ServeOptions):

- headers: `header_timeout` seconds from the first byte of a request (or the
  connection) to its last header line, else 408;
- body: `body_timeout` seconds for the whole body, else 408;
- past `max_connections` open connections, a new one gets 503 at once;
- at shutdown, a request still in its headers gets 503 at once, one still in
  its body gets 503 at the deadline; idle keep-alive connections are closed;
- a client that half-closes after its request still gets its answer.

Every such answer is OpenAI-style JSON. What clients cause (timeouts, bad
HTTP, bodies cut short) is logged as one line, at most once per
LOG_INTERVAL_S; so is running out of file descriptors while accepting, which
asyncio retries every second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import threading
import time
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import ApiError

log = logging.getLogger("foldline.server")

LOG_INTERVAL_S = 10.0  # at most one line per kind of client error in this time
HALF_CLOSE_PROBE_S = 0.2  # after a client's end of stream, when to check that it still reads
SHUTDOWN_ANSWER = ("the server is shutting down", "shutting_down")


class ClientGone(Exception):  # noqa: N818 - not an error of ours
    """The client left before its request could be read."""


class RateLimitedLog:
    """One warning line per kind of event per `interval` seconds, with how many were left out."""

    def __init__(self, interval: float = LOG_INTERVAL_S):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def note(self, client: Any, message: str, kind: str | None = None) -> bool:
        """Log `message` (from `client`, an address) unless its kind was logged in the last interval."""
        kind = kind or message
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.interval) < self.interval:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return False
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        who = f"{client[0]}:{client[1]}: " if isinstance(client, tuple | list) and len(client) >= 2 else ""
        more = f" ({skipped} more like it in the last {self.interval:g} s)" if skipped else ""
        log.warning("%s%s%s", who, message, more)
        return True


client_error_log = RateLimitedLog()


class _ClientErrorFilter(logging.Filter):
    """uvicorn's own warnings about bad requests, rate-limited like ours and without a traceback."""

    CLIENT_CAUSED = ("Invalid HTTP request received.",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.CLIENT_CAUSED:
            client_error_log.note(None, "invalid HTTP request")
            return False
        return True


def install_accept_backoff(loop: asyncio.AbstractEventLoop) -> None:
    """Out of file descriptors, asyncio stops accepting for a second and calls the loop's exception
    handler, once per connection it tried (a traceback each): log one line per interval instead."""
    fallback = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            error = context.get("exception")
            client_error_log.note(None, f"cannot accept connections ({error}); retrying every second "
                                        "(raise the open-file limit, or lower --max-connections)", kind="accept")
            return
        if fallback is not None:
            fallback(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def default_max_connections() -> int:
    """1024, or half the open-file limit where that is less: the rest is for the model, logs and slots."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(1, min(1024, soft // 2))


def _json_head(status: int, body: bytes, error: ApiError) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    return headers + [(k.encode(), v.encode()) for k, v in error.headers().items()]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; `options` is set by `protocol_for`."""

    options: Any  # the ServeOptions

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = "headers"  # "headers", "body", "done" (the request is read) or "refused"
        if len(self.connections) > self.options.max_connections:
            self._refuse_raw(ApiError(503, f"this server has {self.options.max_connections} connections open, its "
                                           "limit; retry later", kind="server_error", code="too_many_connections"))
            return
        self._arm(self.options.header_timeout, self._too_slow)

    # ---- phases ------------------------------------------------------------------------------
    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._phase == "refused":
            return  # read and dropped, so the refusal is not lost to a reset
        if self._phase == "done" and self.conn.their_state is h11.IDLE:  # the next request on a kept connection
            self._phase = "headers"
            self._arm(self.options.header_timeout, self._too_slow)
        super().data_received(data)
        self._follow_phase()

    def _follow_phase(self) -> None:
        state = self.conn.their_state
        if self._phase == "headers" and state is h11.SEND_BODY:
            self._phase = "body"
            self._arm(self.options.body_timeout, self._too_slow)
        elif self._phase in ("headers", "body") and state not in (h11.IDLE, h11.SEND_BODY):
            self._phase = "done"
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._phase = "done"  # idle: uvicorn's keep-alive timeout runs until the next request's first byte
            self._disarm()

    def _too_slow(self) -> None:
        self._timer = None
        what = "headers" if self._phase == "headers" else "body"
        limit = self.options.header_timeout if what == "headers" else self.options.body_timeout
        client_error_log.note(self.client, f"request {what} not complete after {limit:g} s", kind=f"slow {what}")
        error = ApiError(408, f"the request {what} did not arrive within {limit:g} s", code="request_timeout")
        if what == "headers":
            self._refuse_raw(error)
        else:
            self._answer_for_app(error)

    # ---- answers the app does not give --------------------------------------------------------
    def _refuse_raw(self, error: ApiError) -> None:
        """Answer before (or without) a complete request line, then close once the client has read it."""
        self._phase = "refused"
        self._disarm()
        body = json.dumps(error.body()).encode()
        head = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n".encode()
        head += b"".join(k + b": " + v + b"\r\n" for k, v in _json_head(error.status, body, error))
        self.transport.write(head + b"\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)  # time for the client to read it before a reset

    def _answer_for_app(self, error: ApiError) -> None:
        """Answer a request whose body is still arriving; the app then reads a disconnect."""
        cycle = self.cycle
        self._disarm()
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        body = json.dumps(error.body()).encode()
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=error.status,
                                                             headers=_json_head(error.status, body, error))))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass
        cycle.response_started = cycle.response_complete = cycle.disconnected = True
        cycle.message_event.set()
        self._phase = "refused"
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Bad HTTP: a JSON 400 instead of uvicorn's text/plain."""
        self._disarm()
        error = ApiError(400, f"the request is not valid HTTP/1.1: {msg}", code="invalid_http")
        body = json.dumps(error.body()).encode()
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=_json_head(400, body, error))))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    # ---- half-close and shutdown ----------------------------------------------------------------
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """A client that has sent its whole request and shut its write side still gets the answer.

        The end of its stream does not tell a half-close from a client that left: an interim
        `100 Continue` (which HTTP/1.1 clients must accept at any time) is sent, and again
        HALF_CLOSE_PROBE_S later; a peer that is gone resets the connection at the first, so the
        second write fails and the request ends as a disconnect.
        """
        cycle = self.cycle
        if (cycle is None or cycle.response_complete or self.conn.their_state is not h11.DONE
                or self.scope.get("http_version") != "1.1"):
            return None
        cycle.keep_alive = False  # close once answered
        self._interim()
        self.loop.call_later(HALF_CLOSE_PROBE_S, self._interim)
        return True

    def _interim(self) -> None:
        if self.cycle is None or self.cycle.response_started or self.transport.is_closing():
            return
        try:
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        except h11.LocalProtocolError:
            pass

    def shutdown(self) -> None:
        """Idle connections close; a request in its headers gets 503 now, one in its body at the deadline."""
        if self._phase == "refused":
            return
        if self.cycle is None or self.cycle.response_complete:
            if self._phase == "headers" and self.conn.trailing_data[0]:
                self._refuse_raw(ApiError(503, SHUTDOWN_ANSWER[0], kind="server_error", code=SHUTDOWN_ANSWER[1]))
                return
            self._disarm()
            super().shutdown()
            return
        super().shutdown()
        if self._phase == "body":
            error = ApiError(503, f"{SHUTDOWN_ANSWER[0]} and the request body did not arrive in time",
                             kind="server_error", code=SHUTDOWN_ANSWER[1])
            self._arm(self.options.shutdown_timeout, lambda: self._answer_for_app(error))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._phase == "body" and self.cycle is not None and not self.cycle.response_started:
            client_error_log.note(self.client, "the client left before its request body was complete",
                                  kind="truncated body")
        super().connection_lost(exc)


def protocol_for(options: Any) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn makes each connection with, reading `options` (live ServeOptions)."""
    errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ClientErrorFilter) for f in errors.filters):
        errors.addFilter(_ClientErrorFilter())
    return type("ServedH11Protocol", (GuardedH11Protocol,), {"options": options})
