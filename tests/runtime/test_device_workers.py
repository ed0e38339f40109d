"""A bundle over several CPU devices gives each device a task executor and workers of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foldline.errors import InputError
from foldline.runtime import Model
from foldline.runtime.device import physical_cores, workers_per_device


def _thread_names() -> list[str]:
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def _started_by(load) -> list[str]:
    """The IREE worker threads that `load()` started in this process."""
    before = _thread_names()
    model = load()
    started = _thread_names()
    for name in before:
        started.remove(name)
    return model, sorted(n for n in started if n.startswith("iree-worker"))


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
    model, started = _started_by(lambda: Model.load(bundle_factory("llama-tiny", devices=2), threads=threads))
    assert started == workers
    tokens = list(model.session().generate_ids([1, 5, 9, 3], max_new_tokens=4))
    assert len(tokens) == 4


@pytest.mark.slow
def test_a_later_one_device_load_keeps_iree_default_workers(bundle_factory):
    """The per-device worker count is set through IREE's flags; the process-wide CPU driver a later
    one-device load creates must still get IREE's default (one worker per physical core)."""
    two, one = bundle_factory("llama-tiny", devices=2), bundle_factory("llama-tiny")
    script = (
        "import os\n"
        "from foldline.runtime import Model\n"
        "workers = lambda: sum(open(f'/proc/self/task/{t}/comm').read().startswith('iree-worker')\n"
        "                      for t in os.listdir('/proc/self/task'))\n"
        f"two = Model.load({str(two)!r}, threads=2)\n"
        "before = workers()\n"
        f"one = Model.load({str(one)!r})\n"
        "print(before, workers() - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    two_devices, one_device = map(int, out.stdout.strip().splitlines()[-1].split())
    assert (two_devices, one_device) == (4, min(physical_cores(), 64))
