"""Continuous batching: many requests served on the rows of one batched bundle.

One thread owns the `Batch` and runs a loop:

1. waiting requests take free rows (a new request starts at the next step);
2. every running request is fed in the same call: a prompt still being read
   takes its next chunk, a generating one its last sampled token; a long
   prompt therefore never stalls the others, it just makes those steps
   prefill calls;
3. each row whose prompt is complete samples a token and hands it to its
   request; a request that hits a stop id, its token budget, the context
   limit or a cancellation gives its row back.

Requests beyond the free rows wait in a bounded queue; a full queue is refused
at submit (`QueueFullError`), which the server turns into HTTP 503.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import FoldlineError
from .checks import ContextFullError, check_ids
from .sampling import Sampler


class QueueFullError(FoldlineError, RuntimeError):
    """Every row is busy and the waiting queue is full."""


@dataclass(eq=False)
class Request:
    """One generation: a prompt, a budget, and callbacks run on the scheduler thread.

    on_token(id) is called for every sampled token (stop ids included, so a
    caller can see why it ended); on_finish(reason, error) once at the end with
    reason "stop" (a stop id), "length" (max_tokens or the context limit),
    "cancelled" or "error".
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    on_token: Callable[[int], None]
    on_finish: Callable[[str, str | None], None]
    sampler: Sampler = field(default_factory=Sampler)
    stop_ids: frozenset[int] = frozenset()
    cancelled: threading.Event = field(default_factory=threading.Event)
    # set by the scheduler
    row: int | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not fed yet
    generated: int = 0
    last_token: int | None = None

    def cancel(self) -> None:
        """Ask the scheduler to stop this request; its row is freed at the next step."""
        self.cancelled.set()


class Scheduler:
    """Runs requests on the rows of `model.batch()` from one background thread."""

    def __init__(self, model, max_queue: int = 64):
        self.model = model  # a runtime Model
        self.batch = model.batch()
        self.max_queue = max_queue
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # module calls made (for stats and tests)

    # ---- API -----------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._loop, name="foldline-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the loop; requests still queued or running end as cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> Request:
        """Queue a request; refuses bad ids, a prompt with no room to generate, and a full queue."""
        ids = check_ids(request.prompt_ids, self.model.vocab_size, 0, self.model.max_context)
        if ids.size == 0:
            raise ContextFullError("the prompt is empty") from None
        if ids.size >= self.model.max_context:
            raise ContextFullError(f"the prompt has {ids.size} tokens; this model's context is "
                                   f"{self.model.max_context}, which leaves no room to generate")
        request.pending = ids.tolist()
        with self._wake:
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue and len(self._running) >= self.batch.rows:
                raise QueueFullError(f"all {self.batch.rows} rows are busy and {len(self._waiting)} requests "
                                     "are waiting; retry later")
            self._waiting.append(request)
            self._wake.notify_all()
        return request

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self._wake:
            return len(self._running), len(self._waiting)

    # ---- the loop --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
                self._admit()
            self._drop_cancelled()
            if self._running:
                self._step()
        for request in [*self._running.values(), *self._waiting]:
            self._finish(request, "cancelled")
        self._waiting.clear()

    def _admit(self) -> None:
        """Waiting requests take free rows, oldest first (called under the lock)."""
        while self._waiting and self.batch.free_rows():
            request = self._waiting.popleft()
            if request.cancelled.is_set():
                self._finish(request, "cancelled")
                continue
            request.row = self.batch.open_row()
            self._running[request.row] = request

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._running.values() if r.cancelled.is_set()]:
            self._finish(request, "cancelled")

    def _step(self) -> None:
        chunk = self.model.chunk
        feeds: dict[int, list[int]] = {}
        for row, request in self._running.items():
            if request.pending:
                feeds[row], request.pending = request.pending[:chunk], request.pending[chunk:]
            else:
                feeds[row] = [request.last_token]
        try:
            logits = self.batch.step(feeds)
        except Exception as e:  # the batch is broken: every running request fails, new rows start clean
            for request in list(self._running.values()):
                self._finish(request, "error", f"{type(e).__name__}: {e}")
            self.batch.close()
            self.batch = self.model.batch()
            return
        self.steps += 1
        for row, request in list(self._running.items()):
            if request.pending:
                continue  # still reading its prompt
            self._emit(request, logits[row])

    def _emit(self, request: Request, logits: np.ndarray) -> None:
        token = request.sampler(logits)
        request.generated += 1
        request.last_token = token
        try:
            request.on_token(token)
        except Exception as e:  # a consumer that fails is cancelled, the others go on
            self._finish(request, "error", f"{type(e).__name__}: {e}")
            return
        if token in request.stop_ids:
            self._finish(request, "stop")
        elif request.generated >= request.max_tokens or self.batch.positions[request.row] >= self.model.max_context:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.row is not None and self._running.get(request.row) is request:
            del self._running[request.row]
            if not self.batch.closed:
                self.batch.release(request.row)
        try:
            request.on_finish(reason, error)
        except Exception:  # noqa: S110 - a finished consumer has nothing left to tell
            pass
