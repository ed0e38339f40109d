"""Shared by the reliability tests: run scale, case counters, RSS, an address-space cap.

FOLDLINE_RELIABILITY=full scales hypothesis examples, fuzz cases and soak
steps (docs/reliability.md).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager

FULL = os.environ.get("FOLDLINE_RELIABILITY", "quick") == "full"


def scaled(quick: int, full: int) -> int:
    """A count for this run: `quick` in CI, `full` under FOLDLINE_RELIABILITY=full."""
    return full if FULL else quick


# Counts recorded by the tests (cases tried per property or format), printed at the end of the run.
COUNTS: dict[str, int] = {}


def record(name: str, n: int = 1) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + n


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextmanager
def address_space_headroom(extra: int = 2 << 30) -> Iterator[None]:
    """Cap this process's address space at what it maps now plus `extra` while fuzzing.

    A loader that believes a header and asks for terabytes then fails with a
    MemoryError (which the fuzz reports as a crash) instead of paging the
    shared machine to death; the previous soft limit is restored afterwards.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
