"""A bundle over several CPU devices gives each device a task executor and workers of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from foldline.errors import InputError
from foldline.runtime import Model
from foldline.runtime.device import physical_cores, workers_per_device


def _thread_names(tids=None) -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task") if tids is None else tids:
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # ended meanwhile
            pass
    return sorted(names)


def _settled(names, expected: int, timeout: float = 20.0) -> list[str]:
    """names() once it holds `expected` iree-worker names (a worker names itself once it first runs,
    after the device that started it is made), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        workers = sorted(n for n in names() if n.startswith("iree-worker"))
        if len(workers) >= expected or time.monotonic() > deadline:
            return workers
        time.sleep(0.05)


def _started_by(load, expected: int) -> list[str]:
    """The IREE worker threads that `load()` started in this process."""
    before = set(os.listdir("/proc/self/task"))
    model = load()
    started = set(os.listdir("/proc/self/task")) - before
    return model, _settled(lambda: _thread_names(started), expected)


def test_every_device_gets_the_threads_asked_for_or_one_per_core():
    assert workers_per_device(2, 2) == [2, 2]
    assert workers_per_device(1, 3) == [1, 1, 1]
    cores = physical_cores()
    assert workers_per_device(None, 2) == [cores, cores] and cores >= 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="threads must be a positive integer"):
            workers_per_device(bad, 2)


@pytest.mark.slow
@pytest.mark.parametrize("threads,workers", [(1, ["iree-worker-0"] * 2),
                                             (2, ["iree-worker-0"] * 2 + ["iree-worker-1"] * 2)])
def test_each_device_runs_on_workers_of_its_own(bundle_factory, threads, workers):
    """Two executors (each numbering its workers from 0), `threads` workers each; the model still decodes."""
    model, started = _started_by(lambda: Model.load(bundle_factory("llama-tiny", devices=2), threads=threads),
                                 len(workers))
    assert started == workers
    tokens = list(model.session().generate_ids([1, 5, 9, 3], max_new_tokens=4))
    assert len(tokens) == 4


@pytest.mark.slow
def test_a_later_one_device_load_keeps_iree_default_workers(bundle_factory):
    """The per-device worker count is set through IREE's flags; the process-wide CPU driver a later
    one-device load creates must still get IREE's default (one worker per physical core)."""
    two, one = bundle_factory("llama-tiny", devices=2), bundle_factory("llama-tiny")
    expected = 4 + min(physical_cores(), 64)
    script = (  # a worker names itself once it first runs: wait for the names, up to 20 s
        "import os, time\n"
        "from foldline.runtime import Model\n"
        "workers = lambda: sum(open(f'/proc/self/task/{t}/comm').read().startswith('iree-worker')\n"
        "                      for t in os.listdir('/proc/self/task'))\n"
        "def settled(n):\n"
        "    end = time.monotonic() + 20\n"
        "    while workers() < n and time.monotonic() < end:\n"
        "        time.sleep(0.05)\n"
        "    return workers()\n"
        f"two = Model.load({str(two)!r}, threads=2)\n"
        "before = settled(4)\n"
        f"one = Model.load({str(one)!r})\n"
        f"print(before, settled({expected}) - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    two_devices, one_device = map(int, out.stdout.strip().splitlines()[-1].split())
    assert (two_devices, one_device) == (4, min(physical_cores(), 64))


@pytest.mark.slow
def test_each_devices_workers_are_told_apart_and_their_time_counted(bundle_factory):
    """worker_seconds: one figure per device, from that device's own threads, growing as it computes;
    a one-device bundle has none."""
    model = Model.load(bundle_factory("llama-tiny", devices=2), threads=2)
    threads = model.ctx.device_threads
    assert len(threads) == 2 and not threads[0] & threads[1]
    for tids in threads:  # the executor's threads: its workers among them
        assert _settled(lambda tids=tids: _thread_names(tids), 2) == ["iree-worker-0", "iree-worker-1"]
    before = model.worker_seconds()
    session = model.session()
    for _ in range(20):
        session.reset()
        session.prefill(list(range(1, 100)))
    after = model.worker_seconds()
    assert len(before) == len(after) == 2
    assert all(b > a for a, b in zip(before, after)), (before, after)  # both devices computed
    assert Model.load(bundle_factory("llama-tiny")).worker_seconds() is None
