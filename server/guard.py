"""Who may talk to the server: the Host allow-list and the cross-origin rule, and a JSON answer for
a request cut by the shutdown.

A browser page on another site can make requests to a server on this machine:
by DNS rebinding (a name of its own that resolves to 127.0.0.1, so the Host
header names that site) or by a cross-origin "simple" POST (text/plain, which
needs no preflight). So, by default:

- the Host header must name the bind address or localhost (with a wildcard
  bind, 0.0.0.0 or ::, any IP address too); `--allowed-hosts` adds names,
  `*` allows any: else 400;
- a request with an Origin header other than the server's own is refused
  with 403 unless `--cors` allows that origin, whatever its content type.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .protocol import ApiError

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")  # noqa: S104 - names, not a bind


def host_name(host: str) -> str:
    """The name in a Host header: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _json(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


class Guard:
    """ASGI middleware: the Host and Origin rules above, and 503 JSON for a request cancelled unanswered."""

    def __init__(self, app: Any, hosts: list[str], bind_host: str, cors_origins: list[str]):
        self.app = app
        self.any_host = "*" in hosts
        self.hosts = {host_name(h) for h in [*hosts, bind_host, *LOCAL_NAMES]}
        self.any_ip = bind_host in WILDCARD_BINDS
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower() for o in cors_origins}

    def refusal(self, scope: dict, headers: Headers) -> ApiError | None:
        host = headers.get("host")
        if host is not None and not self.any_host:
            name = host_name(host)
            if name not in self.hosts and not (self.any_ip and _is_ip(name)):
                return ApiError(400, f"the Host header '{host}' is not one this server answers to; start it with "
                                     f"--allowed-hosts {name} to allow it", param="host", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is None:
            return None
        origin = origin.rstrip("/").lower()
        if host is not None and origin == f"{scope.get('scheme', 'http')}://{host.strip().lower()}":
            return None  # same origin
        if not (self.any_origin or origin in self.origins):
            return ApiError(403, f"cross-origin requests from {origin} are not served; start the server with "
                                 f"--cors {origin} to allow them", code="origin_not_allowed")
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            method = headers["access-control-request-method"].upper()
            if method not in ("GET", "POST"):
                return ApiError(400, f"{method} is not allowed from another origin (only GET and POST)",
                                code="method_not_allowed")
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope, Headers(scope=scope))
        if error is not None:
            await _json(error)(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:  # the server's graceful-shutdown limit passed: answer, end quietly
            if not started:
                with contextlib.suppress(Exception):
                    await _json(ApiError(503, "the server shut down before this request finished",
                                         kind="server_error", code="shutting_down"))(scope, receive, send)
