"""Run the app under uvicorn with a graceful shutdown.

The first SIGTERM (or SIGINT) stops accepting: the listening socket closes and
requests that still arrive on open connections get 503. Running requests get
`shutdown_timeout` seconds to finish; those still running then end (503
`shutting_down`), the scheduler stops and the process exits 0. Clients still
sending a request are answered by server/connection.py (at once in their
headers, at the deadline in their body). A second signal exits at once with
status 128 + the signal number.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import uvicorn

from .app import create_app
from .connection import protocol_for
from .served import ServedModel

# What uvicorn adds after the deadline: time for the last answers to reach their clients.
FLUSH_GRACE_S = 3.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signals drain the ServedModel first."""

    def __init__(self, config: uvicorn.Config, served: ServedModel):
        super().__init__(config)
        self.served = served

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second signal: no more waiting
            print(f"foldline serve: {signal.Signals(sig).name} again, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        print(f"foldline serve: {signal.Signals(sig).name}, finishing running requests "
              f"(at most {self.served.options.shutdown_timeout:g} s)", file=sys.stderr, flush=True)
        self.served.begin_shutdown()
        # not recorded as a captured signal: uvicorn would raise it again on exit, and the exit would not be 0
        self.should_exit = True


def uvicorn_config(served: ServedModel, host: str = "127.0.0.1", port: int = 8000) -> uvicorn.Config:
    """The app under uvicorn's h11 protocol with foldline's connection limits (server/connection.py)."""
    options = served.options
    return uvicorn.Config(create_app(served), host=host, port=port, log_level="warning", lifespan="on",
                          http=protocol_for(options), timeout_keep_alive=options.keep_alive_timeout,
                          timeout_graceful_shutdown=options.shutdown_timeout + FLUSH_GRACE_S)


def serve(served: ServedModel, host: str, port: int) -> None:
    """Serve until a signal; returns once shut down, the model's runtime objects released."""
    GracefulServer(uvicorn_config(served, host, port), served).run()
    served.close()
    _no_leak_report()


def _no_leak_report() -> None:
    """nanobind lists every IREE object still alive at interpreter exit (about 150 lines after a clean
    stop, more when a stuck call kept the rows): the process is ending, nothing leaks past it."""
    try:
        from iree.runtime import _binding
    except ImportError:
        return
    disable = getattr(_binding, "disable_leak_checker", None)
    if disable is not None:
        disable()
