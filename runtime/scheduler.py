"""Continuous batching: many requests served on the rows of one batched bundle.

One thread owns the `Batch` and runs a loop:

1. waiting requests take free rows (a new request starts at the next step);
2. every running request is fed: the generating ones their last sampled token
   in one decode call, the ones still reading a prompt their next chunk in one
   prefill call (each call leaves the other rows as they are). A long prompt
   therefore never stalls the others, and a row's tokens are computed by the
   same kind of call whoever else runs: a stream's text does not depend on the
   load (docs/serving.md);
3. each row whose prompt is complete samples a token and hands it to its
   request; a request that hits a stop id, its token budget, the context
   limit, its deadline or a cancellation gives its row back.

The loop must outlive any one request: an exception while a request is
sampled or handed its token ends that request only; a failed module call ends
the requests of that call and the batch is rebuilt. Should the loop itself end
(a stop, or a fault it cannot recover from), every request still queued or
running is finished, so no caller waits forever. `health()` reports a loop
that died or stopped making progress while it has work (a watchdog for
`/health`).

Requests beyond the free rows wait in a bounded queue; a full queue is refused
at submit (`QueueFullError`), which the server turns into HTTP 503.

With the prompt cache, a new request takes the free row whose kept state
serves most of its prompt without losing what it holds, else an empty row,
else the least recently used (runtime/prompt_cache.py `place`); a request that
names its conversation (`cache_key`) takes back the row that conversation last
used whenever it serves some of the prompt. With checkpoints, rows keep copies
of their rings and recurrent state along their prompts, so an edited turn of a
hybrid model resumes from the last one before the edit. With a slot
store (`foldline serve --slots-dir`, runtime/slots.py), rows about to lose
what they kept are saved to disk first, and a saved row that serves more of a
prompt than any kept one is restored into the row an empty prompt would take.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import FoldlineError, InputError
from .checks import ContextFullError, check_ids
from .prompt_cache import place
from .sampling import Sampler, TokenLogprobs, token_logprobs
from .session_file import SessionFileError
from .slots import SlotStore

log = logging.getLogger("foldline.scheduler")

# Why a request ended, as passed to on_finish.
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "shutdown", "error")


class QueueFullError(FoldlineError, RuntimeError):
    """Every row is busy and the waiting queue is full, or the scheduler no longer takes requests."""


class SchedulerDownError(QueueFullError):
    """The scheduler is stopping or its loop has ended: nothing new can run."""


@dataclass(eq=False)
class Request:
    """One generation: a prompt, a budget, and callbacks run on the scheduler thread.

    on_token(id, logprobs) is called for every sampled token (stop ids
    included, so a caller can see why it ended); logprobs is a TokenLogprobs
    when `logprobs` is set (the number of most likely tokens to report beside
    the chosen one), else None. on_finish(reason, error) is called exactly
    once at the end, with a reason of FINISH_REASONS: "stop" (a stop id),
    "length" (max_tokens or the context limit), "timeout" (the deadline, a
    time.monotonic() value, passed), "cancelled" / "shutdown" (cancel()) or
    "error" (with a message).
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    on_token: Callable[[int, TokenLogprobs | None], None]
    on_finish: Callable[[str, str | None], None]
    sampler: Sampler = field(default_factory=Sampler)
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    deadline: float | None = None
    cache_key: str | None = None  # the conversation this request continues (the prompt cache prefers its row)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "cancelled"
    # set by the scheduler
    row: int | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not fed yet
    cached_tokens: int = 0  # prompt tokens a kept row already held (the prompt cache): never fed
    generated: int = 0
    last_token: int | None = None
    finished: bool = False

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the scheduler to stop this request; its row is freed at the next step."""
        if not self.cancelled.is_set():
            self.cancel_reason = reason
        self.cancelled.set()


class Scheduler:
    """Runs requests on the rows of `model.batch()` from one background thread."""

    def __init__(self, model, max_queue: int = 64, stall_timeout: float = 60.0, prompt_cache: bool = True,
                 slots: SlotStore | None = None, checkpoints: int = 0):
        self.model = model  # a runtime Model
        self.prompt_cache = prompt_cache  # reuse what a released row holds (runtime/prompt_cache.py)
        if slots is not None and not prompt_cache:
            raise InputError("saving rows to a slots directory needs the prompt cache, which is off")
        self.slots = slots  # rows' kept state saved to disk (runtime/slots.py)
        if checkpoints and not prompt_cache:
            raise InputError("checkpoints serve the prompt cache, which is off")
        self.checkpoints = checkpoints  # per row, copies of its rings and recurrent state (runtime/batch.py)
        self.batch = self._new_batch()
        self._row_used = [0] * self.batch.rows  # when each row was last opened: the prompt cache's LRU order
        self._row_key: list[str | None] = [None] * self.batch.rows  # the conversation each row last served
        self._opened = 0
        self.max_queue = max_queue
        self.stall_timeout = stall_timeout
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}
        self._wake = threading.Condition()
        self._finish_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._progress_at = time.monotonic()
        self.died: str | None = None  # why the loop ended other than by stop()
        self.steps = 0  # module calls made (for stats and tests)
        self.prefilled = 0  # prompt tokens fed to the module
        self.cached = 0  # prompt tokens served by the prompt cache instead (restored ones included)
        self.restored = 0  # of those, prompt tokens served by rows restored from the slot store
        self.submitted = 0
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by reason

    # ---- API -----------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._run, name="foldline-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop; requests still queued or running end as "shutdown".

        Returns within `timeout` even when the loop is stuck in a module call:
        the requests are then finished from here and the stuck (daemon)
        thread is left behind.
        """
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        self._finish_all("shutdown")

    def cancel_all(self, reason: str = "shutdown") -> None:
        """Cancel every queued and running request (each ends at the next step with `reason`)."""
        with self._wake:
            for request in [*self._running.values(), *self._waiting]:
                request.cancel(reason)
            self._wake.notify_all()

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
            if self._stopping or not self.alive:
                raise SchedulerDownError("the server is shutting down" if self._stopping else
                                         f"the generation loop has stopped ({self.died or 'not started'})")
            if len(self._waiting) >= self.max_queue and len(self._running) >= self.batch.rows:
                raise QueueFullError(f"all {self.batch.rows} rows are busy and {len(self._waiting)} requests "
                                     "are waiting; retry later")
            if not self._waiting and not self._running:
                self._progress_at = time.monotonic()  # the stall clock starts when work arrives
            self._waiting.append(request)
            self.submitted += 1
            self._wake.notify_all()
        return request

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self._wake:
            return len(self._running), len(self._waiting)

    @property
    def thread_alive(self) -> bool:
        """The loop's thread is still running (after stop(): stuck in a module call)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.died is None

    def health(self) -> str | None:
        """None when the loop is serving; otherwise why it is not (dead, or stalled with work waiting)."""
        if self._thread is None:
            return "the generation loop has not started"
        if not self.alive:
            return f"the generation loop has stopped: {self.died or 'stopped'}"
        with self._wake:
            busy = bool(self._running or self._waiting)
            idle_for = time.monotonic() - self._progress_at
        if busy and idle_for > self.stall_timeout:
            return f"the generation loop has made no progress for {idle_for:.1f} s with requests waiting"
        return None

    # ---- the loop --------------------------------------------------------------
    def _run(self) -> None:
        """The thread: the loop, and whatever it leaves unfinished finished when it ends, however it ends."""
        try:
            self._loop()
        except BaseException as e:
            self.died = f"{type(e).__name__}: {e}"
            log.exception("the generation loop died")
            raise
        finally:
            if self._stopping:
                self._finish_all("shutdown")
            else:
                self._finish_all("error", f"the generation loop stopped: {self.died}")

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        """End every queued and running request with `reason` (the loop is gone or going)."""
        with self._wake:
            left = [*self._running.values(), *self._waiting]
            self._waiting.clear()
        for request in left:
            self._finish(request, reason, error)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
                self._drop_waiting()
            self._admit()
            self._drop_running()
            if self._running:
                try:
                    self._step()
                except Exception as e:  # a fault outside any one request: end the running ones, go on
                    log.exception("a scheduler step failed")
                    self._fail_running(e)
            self._progress_at = time.monotonic()

    def _drop_waiting(self) -> None:
        """Waiting requests that were cancelled or ran out of time end without a row (called under the lock)."""
        now = time.monotonic()
        for request in [r for r in self._waiting if r.cancelled.is_set() or _expired(r, now)]:
            self._waiting.remove(request)
            self._finish(request, request.cancel_reason if request.cancelled.is_set() else "timeout")

    def _admit(self) -> None:
        """Waiting requests take free rows, oldest first.

        Only this thread touches the batch, so a row is opened outside the lock: saving or restoring
        a slot file reads and writes the disk, and submit() must not wait for that.
        """
        while True:
            with self._wake:
                if not self._waiting or not self.batch.free_rows():
                    return
                request = self._waiting[0]  # popped after the row opens: a failure here leaves it queued, not lost
            row, cached = self._open_row_for(request.pending, request.cache_key)
            with self._wake:
                if not self._waiting or self._waiting[0] is not request:  # stop() ended it meanwhile
                    self.batch.release(row)
                    return
                self._waiting.popleft()
                request.row, request.cached_tokens, request.pending = row, cached, request.pending[cached:]
                self.cached += cached
                self._running[row] = request

    def _open_row_for(self, prompt: list[int], key: str | None = None) -> tuple[int, int]:
        """Open a row for `prompt` from what serves most of it (a kept row, a saved one), else zeroed;
        (row, prompt tokens served)."""
        if not self.prompt_cache:
            return self.batch.open_row(), 0
        row, kept = self._place(prompt, key)
        if self.slots is not None:
            slot, saved = self.slots.best(prompt)
            if slot is not None and saved > kept:
                row, _ = self._place([])  # the row a prompt with nothing kept takes
                try:
                    served = self.slots.restore(self.batch, row, slot, prompt)
                except SessionFileError as e:
                    log.warning("a saved row could not be restored: %s", e)
                else:
                    self.restored += served
                    return self._opened_now(row, key), served
        row, kept = self.batch.open_row_reusing(prompt, row)
        return self._opened_now(row, key), kept

    def _place(self, prompt: list[int], key: str | None = None) -> tuple[int, int]:
        batch, free = self.batch, self.batch.free_rows()
        own = [r for r in free if key is not None and self._row_key[r] == key]
        preferred = max(own, key=self._row_used.__getitem__) if own else None
        return place(batch.reuse, free, batch.tokens, batch.prefilled, self._row_used, prompt,
                     [batch.checkpoint_positions(r) for r in range(batch.rows)], preferred)

    def _opened_now(self, row: int, key: str | None = None) -> int:
        self._opened += 1
        self._row_used[row], self._row_key[row] = self._opened, key
        return row

    def _new_batch(self):
        """The model's rows; with a slot store, a row about to lose what it kept is saved first."""
        batch = self.model.batch(self.checkpoints)
        if self.slots is not None:
            batch.before_evict = lambda row: self._save_row(batch, row)
        return batch

    def _save_row(self, batch, row: int) -> None:
        """Save a kept row to the slot store; a failure (a full disk) only loses it, as without a store."""
        try:
            self.slots.save(batch, row)
        except Exception as e:
            log.warning("row %d could not be saved to the slots directory: %s", row, e)

    def _drop_running(self) -> None:
        now = time.monotonic()
        with self._wake:
            running = list(self._running.values())
        for request in running:
            if request.cancelled.is_set():
                self._finish(request, request.cancel_reason)
            elif _expired(request, now):
                self._finish(request, "timeout")

    def _fail_running(self, e: BaseException) -> None:
        """Every running request fails and the rows start again from a new batch."""
        with self._wake:
            running = list(self._running.values())
        for request in running:
            self._finish(request, "error", f"{type(e).__name__}: {e}")
        self.batch.close()
        self.batch = self._new_batch()  # if this fails too, the loop ends and health says so

    def _step(self) -> None:
        chunk = self.model.chunk
        with self._wake:  # stop() may finish requests from another thread while a call runs
            running = list(self._running.items())
        generating = [(row, request) for row, request in running if not request.pending]
        reading = [(row, request) for row, request in running if request.pending]
        feeds: dict[int, list[int]] = {}
        for row, request in reading:
            feeds[row], request.pending = request.pending[:chunk], request.pending[chunk:]
            self.prefilled += len(feeds[row])
        calls = ((generating, {row: [request.last_token] for row, request in generating}, ()),
                 (reading, feeds, set(feeds)))
        for requests, call_feeds, prompt_rows in calls:
            if not requests:
                continue
            try:
                logits = self.batch.step(call_feeds, prompt_rows)
            except Exception as e:  # the batch is broken: every running request fails, new rows start clean
                self._fail_running(e)
                return
            self.steps += 1
            for row, request in requests:
                if not request.pending:  # a prompt still being read gives no token yet
                    self._emit(request, logits[row])

    def _emit(self, request: Request, logits: np.ndarray) -> None:
        if request.finished:
            return  # ended while its call ran (stop() on a stuck call): no token after the end
        try:
            token = request.sampler(logits)
            info = None if request.logprobs is None else token_logprobs(logits, token, request.logprobs)
            request.generated += 1
            request.last_token = token
            request.on_token(token, info)
        except Exception as e:  # this request's sampler or consumer failed: it ends, the others go on
            self._finish(request, "error", f"{type(e).__name__}: {e}")
            return
        if token in request.stop_ids:
            self._finish(request, "stop")
        elif request.generated >= request.max_tokens or self.batch.positions[request.row] >= self.model.max_context:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """Free the request's row and tell its caller, once, however many paths reach here."""
        with self._finish_lock:
            if request.finished:
                return
            request.finished = True
            self.finished[reason] += 1
        with self._wake:  # the loop thread and stop() both end requests: _running changes under the lock
            if request.row is not None and self._running.get(request.row) is request:
                del self._running[request.row]
                if not self.batch.closed:
                    self.batch.release(request.row)
        try:
            request.on_finish(reason, error)
        except Exception:  # noqa: S110 - a finished consumer has nothing left to tell
            pass


def _expired(request: Request, now: float) -> bool:
    return request.deadline is not None and now >= request.deadline
