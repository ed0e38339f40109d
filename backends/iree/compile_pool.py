"""How many iree-compile runs a build starts at once, and running them.

`iree.compiler.compile_str` runs the iree-compile binary in a subprocess, so a
thread per module is enough to overlap them. The bound is the machine: one run
per core, and one per PEAK_BYTES of available memory (one iree-compile's peak:
docs/backends.md, "One bundle for every x86 host"), so several modules never
push the build into swap or the OOM killer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

PEAK_BYTES = int(1.2e9)  # one iree-compile's peak resident memory, with a margin

T = TypeVar("T")
R = TypeVar("R")


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class PoolSize:
    """The number of concurrent runs and what bounded it, for the progress output."""

    workers: int
    cores: int
    by_memory: int | None  # runs the available memory allows; None: unknown

    def describe(self, jobs: int) -> str:
        memory = "" if self.by_memory is None else f", memory for {self.by_memory}"
        return f"{min(self.workers, jobs)} at a time ({self.cores} cores{memory})"


def pool_size(jobs: int, cores: int | None = None, memory: int | None = None) -> PoolSize:
    """At most one run per job, per core and per PEAK_BYTES of available memory; at least one."""
    cores = cores or os.cpu_count() or 1
    memory = available_memory() if memory is None else memory
    by_memory = None if memory is None else max(1, memory // PEAK_BYTES)
    return PoolSize(max(1, min(jobs, cores, by_memory or cores)), cores, by_memory)


def run_concurrently(work: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[tuple[T, R]]:
    """(item, work(item)) for every item, in the order they finish; the first failure is raised.

    With one worker the items run in turn on the calling thread.
    """
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield item, work(item)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(work, item): item for item in items}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()
