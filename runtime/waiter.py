"""The thread that waits for IREE's CPU workers, at a lower scheduling priority than theirs.

A module call on IREE's local-task driver runs on its worker threads (one per
core) while the calling thread waits for the result, and part of that wait is a
spin. On a CPU with no core to spare, a spinning caller takes a core away from
a worker whenever the scheduler gives it one, and the step then runs on one
core for the rest of the time slice, taking far longer (docs/runtime.md,
"The thread that waits"; docs/history.md has the run). Run from a thread
whose nice value is above the workers', the waiting thread yields to any
worker that wakes up, and every step takes the short time.

Only the thread this module starts is lowered, never the caller's own: an
application's threads keep their priority. On platforms where a single
thread's priority cannot be set (anything but Linux), or with
FOLDLINE_WAIT_NICE=0, calls run on the caller's thread as before.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..errors import InputError

WAIT_NICE_ENV = "FOLDLINE_WAIT_NICE"
# Above the workers' nice 0, low enough that a loaded host still gives the thread its share (a step's
# host work is short); the value within that range made no difference (docs/history.md).
DEFAULT_WAIT_NICE = 10

T = TypeVar("T")


def wait_nice() -> int:
    """The nice value of the waiting thread: $FOLDLINE_WAIT_NICE (0 to 19; 0 turns the thread off)."""
    raw = os.environ.get(WAIT_NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_NICE
    try:
        nice = int(raw)
    except ValueError:
        raise InputError(f"${WAIT_NICE_ENV} must be an integer from 0 to 19, got {raw!r}") from None
    if not 0 <= nice <= 19:
        raise InputError(f"${WAIT_NICE_ENV} must be an integer from 0 to 19, got {nice}")
    return nice


def _lower_own_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (Linux sets it per thread; lowering needs no privilege)."""
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class Waiter:
    """Runs a model's module calls on one thread of lower priority, one call at a time.

    The model's lock already runs its calls one at a time, so one thread per model
    serializes nothing new; each model has its own, so two models still run side by side.
    """

    def __init__(self, nice: int):
        self._pool: ThreadPoolExecutor | None = None
        if nice and sys.platform.startswith("linux"):
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foldline-wait",
                                            initializer=_lower_own_priority, initargs=(nice,))

    @property
    def active(self) -> bool:
        """Whether calls leave the caller's thread."""
        return self._pool is not None

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on the waiting thread (or here, when inactive); its exception is raised here."""
        if self._pool is None:
            return fn()
        return self._pool.submit(fn).result()

    def close(self) -> None:
        """Stop the thread after the call in progress, if any. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def inline() -> Waiter:
    """A waiter that runs every call on the caller's thread (GPU devices, local-sync CPU)."""
    return Waiter(0)
