"""Shared by the serve tests: an in-process uvicorn server on 127.0.0.1, and a slowed module call."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn


class RunningServer:
    """uvicorn on a socket bound to a free port of 127.0.0.1, in a thread; stopped by close()."""

    def __init__(self, served):
        from foldline.server.run import uvicorn_config

        self.served = served
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(served))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until `predicate()`; returns the seconds it took, fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - start


@contextmanager
def slowed_calls(model, seconds: float) -> Iterator[None]:
    """Every module call of `model` takes at least `seconds`: long generations on a tiny model."""
    real = model.ctx.call

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    model.ctx.call = slow
    try:
        yield
    finally:
        model.ctx.call = real
