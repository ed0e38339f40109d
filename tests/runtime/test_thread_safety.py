"""The runtime's shared state under threads: each test fails without the guard it names.

- `Model.close` takes the model's lock, so a module call in progress on another thread keeps its device.
- The CPU thread count IREE fixes at the first load is checked and set in one step.
- The scheduler's running requests change only under its condition, so `stop()` on another
  thread during a step does not break the loop's iteration, and a request it ends gets no token after.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from foldline.errors import InputError
from foldline.runtime import Model
from foldline.runtime import device as runtime_device
from foldline.runtime.prompt_cache import ReuseRule
from foldline.runtime.scheduler import Request, Scheduler


@pytest.mark.slow
def test_close_waits_for_a_call_in_progress(bundle_factory):
    model = Model.load(bundle_factory("llama-tiny"))
    session = model.session()
    real, entered, release = model.ctx.call, threading.Event(), threading.Event()
    model.ctx.call = lambda *a: (entered.set(), release.wait(10), real(*a))[2]
    result: dict[str, object] = {}
    caller = threading.Thread(target=lambda: result.setdefault("logits", session.prefill([5, 6, 7])))
    caller.start()
    assert entered.wait(10)
    closer = threading.Thread(target=model.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive() and not model.closed, "close() returned while a call was using the device"
    release.set()
    caller.join(10)
    closer.join(10)
    assert np.asarray(result["logits"]).shape == (model.vocab_size,)
    assert session.broken is None and model.closed


def test_first_loads_on_two_threads_fix_one_thread_count(monkeypatch):
    """Two first CPU loads at once, asking 2 and 3 threads: one sets the count, the other is refused."""
    monkeypatch.setattr(runtime_device, "_cpu_task_created", False)
    monkeypatch.setattr(runtime_device, "_cpu_task_threads", None)
    parsed = []

    def slow_parse(flag: str) -> None:  # the window between the check and the set
        time.sleep(0.2)
        parsed.append(flag)

    monkeypatch.setattr(runtime_device.rt.flags, "parse_flags", slow_parse)
    outcomes: dict[int, object] = {}

    def load(threads: int) -> None:
        try:
            outcomes[threads] = runtime_device._cpu_driver(threads)
        except InputError as e:
            outcomes[threads] = e

    loaders = [threading.Thread(target=load, args=(n,)) for n in (2, 3)]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join(10)
    refused = [n for n, o in outcomes.items() if isinstance(o, InputError)]
    assert len(parsed) == 1 and len(refused) == 1, (parsed, outcomes)
    assert "IREE fixes the CPU thread count at the first load" in str(outcomes[refused[0]])


class _Batch:
    """Rows without a module: every step returns zero logits."""

    rows = 2

    def __init__(self):
        self.closed, self.positions, self.open = False, [0, 0], set()
        self.tokens, self.prefilled = [[], []], [0, 0]  # nothing kept: the prompt cache serves nothing
        self.reuse = ReuseRule(whole_only=False)

    def checkpoint_positions(self, _row: int) -> list[int]:
        return []

    def free_rows(self) -> list[int]:
        return [r for r in range(self.rows) if r not in self.open]

    def open_row(self) -> int:
        row = self.free_rows()[0]
        self.open.add(row)
        self.positions[row] = 0
        return row

    def open_row_reusing(self, _prompt: list[int], _row: int | None = None) -> tuple[int, int]:
        return self.open_row(), 0

    def release(self, row: int) -> None:
        self.open.discard(row)

    def step(self, feeds: dict[int, list[int]], _prompt_rows=()) -> dict[int, np.ndarray]:
        for row, ids in feeds.items():
            self.positions[row] += len(ids)
        return {row: np.zeros(8, np.float32) for row in feeds}

    def close(self) -> None:
        self.closed = True


class _Model:
    chunk, vocab_size, max_context = 4, 8, 64

    def batch(self, checkpoints: int = 0) -> _Batch:
        return _Batch()


class _HookedRequest(Request):
    """Runs `hook` (once) when the scheduler first reads what it has left to feed once it holds a row:
    inside its step."""

    hook = None

    def __getattribute__(self, name):
        if name == "pending" and object.__getattribute__(self, "row") is not None:
            hook = object.__getattribute__(self, "hook")
            if hook is not None:
                object.__setattr__(self, "hook", None)
                hook()
        return object.__getattribute__(self, name)


def test_stop_from_another_thread_during_a_step(caplog):
    scheduler = Scheduler(_Model()).start()
    events: list[tuple[str, str]] = []

    def request(name: str, cls=Request) -> Request:
        return cls([1, 2, 3], 1000, on_token=lambda t, _i: events.append((name, "token")),
                   on_finish=lambda reason, _e: events.append((name, reason)))

    first, second = request("first", _HookedRequest), request("second")
    stopper = threading.Thread(target=scheduler.stop, kwargs={"timeout": 0})
    first.hook = lambda: (stopper.start(), stopper.join(10))  # stop() runs to its end inside the step
    with caplog.at_level(logging.ERROR, logger="foldline.scheduler"):
        with scheduler._wake:  # both take their rows at the same step
            scheduler.submit(first)
            scheduler.submit(second)
        scheduler._thread.join(10)
        stopper.join(10)
    assert not scheduler._thread.is_alive()
    assert not [r for r in caplog.records if "step failed" in r.getMessage()], "the loop's step broke"
    assert sorted(e for e in events if e[1] != "token") == [("first", "shutdown"), ("second", "shutdown")]
    for name in ("first", "second"):
        end = events.index((name, "shutdown"))
        assert (name, "token") not in events[end:], f"{name} got a token after it ended"
