"""CPU time each device's worker threads spent, from /proc: how busy each device of a bundle kept its cores.

A bundle compiled for several CPU devices gives each device a task executor of
its own (runtime/device.py); the threads a device's driver starts are told
apart by the thread ids that appear while it is created. Their time on a CPU,
read from /proc/self/task/TID/schedstat (nanoseconds; `stat`'s 10 ms ticks
where schedstat is missing), is the time the device computed (workers park
without spinning long when idle). Linux only: elsewhere there are no figures,
never an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

TASKS = Path("/proc/self/task")


def task_ids() -> set[int]:
    """This process's thread ids now (empty where /proc is not there)."""
    try:
        return {int(t) for t in os.listdir(TASKS)}
    except OSError:
        return set()


def cpu_seconds(tids: Iterable[int]) -> float:
    """CPU seconds the threads `tids` have run (those that have ended count zero)."""
    return sum(_thread_seconds(tid) for tid in tids)


def _thread_seconds(tid: int) -> float:
    task = TASKS / str(tid)
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: proc(5) fields 14, 15
