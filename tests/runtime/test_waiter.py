"""The thread module calls wait on (runtime/waiter.py): lower priority than IREE's workers, the caller's untouched.

Each test fails without what it names: the call leaving the caller's thread, the
nice value on that thread alone, the exception coming back, the switch that
turns it off, and the model's calls going through it with the same logits.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from foldline.errors import InputError
from foldline.runtime import Model
from foldline.runtime.waiter import DEFAULT_WAIT_NICE, WAIT_NICE_ENV, Waiter, wait_nice

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@linux_only
def test_calls_run_on_a_lower_priority_thread_and_the_callers_keeps_its_own():
    mine = threading.get_native_id()
    before = _nice_of(mine)
    waiter = Waiter(7)
    try:
        seen = waiter.run(lambda: (threading.get_native_id(), _nice_of(threading.get_native_id())))
        assert seen[0] != mine, "the call ran on the caller's thread"
        assert seen[1] == min(19, before + 7)
        assert _nice_of(mine) == before, "the caller's own priority changed"
        # one thread for the model's calls, not one per call
        assert waiter.run(threading.get_native_id) == seen[0]
    finally:
        waiter.close()


@linux_only
def test_an_exception_in_the_call_reaches_the_caller_and_the_thread_goes_on():
    waiter = Waiter(DEFAULT_WAIT_NICE)
    try:
        with pytest.raises(ZeroDivisionError):
            waiter.run(lambda: 1 / 0)
        assert waiter.run(lambda: 41 + 1) == 42
    finally:
        waiter.close()
    waiter.close()  # idempotent
    assert not waiter.active and waiter.run(threading.get_native_id) == threading.get_native_id()


def test_nice_zero_runs_on_the_callers_thread(monkeypatch):
    monkeypatch.setenv(WAIT_NICE_ENV, "0")
    waiter = Waiter(wait_nice())
    assert not waiter.active
    assert waiter.run(threading.get_native_id) == threading.get_native_id()


@pytest.mark.parametrize("raw", ["fast", "-3", "20"])
def test_a_bad_nice_value_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(WAIT_NICE_ENV, raw)
    with pytest.raises(InputError, match=WAIT_NICE_ENV):
        wait_nice()


@linux_only
@pytest.mark.slow
def test_a_cpu_models_calls_go_through_the_waiter_with_the_same_logits(bundle_factory, monkeypatch):
    bundle = bundle_factory("llama-tiny")
    model = Model.load(bundle)
    assert model.ctx.waiter.active, "a local-task CPU model waits on the caller's thread"
    ran_on: list[int] = []
    real_run = model.ctx.waiter.run
    model.ctx.waiter.run = lambda fn: real_run(lambda: (ran_on.append(threading.get_native_id()), fn())[1])
    waited = model.session().prefill([1, 5, 9, 2])
    assert ran_on and ran_on[0] != threading.get_native_id()
    assert _nice_of(ran_on[0]) > _nice_of(threading.get_native_id())

    monkeypatch.setenv(WAIT_NICE_ENV, "0")
    direct_model = Model.load(bundle)
    assert not direct_model.ctx.waiter.active
    direct = direct_model.session().prefill([1, 5, 9, 2])
    np.testing.assert_array_equal(waited, direct)

    waiter = model.ctx.waiter
    model.close()
    assert not waiter.active, "closing the model left its waiting thread running"
    assert ran_on[0] not in {t.native_id for t in threading.enumerate()}
