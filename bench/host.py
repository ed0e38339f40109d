"""Whether the host is quiet enough to bench on: the 1-minute load average against the cores.

On a host whose cores are busy with other work, every engine's figures
measure that work too, and unevenly (it comes and goes between runs).
`foldline bench` refuses such a host unless told `--busy-ok`, and then
flags every table it prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .child import BenchError

# The 1-minute load average, per core, above which the host counts as busy.
BUSY_LOAD_PER_CORE = 0.5


@dataclass(frozen=True)
class HostLoad:
    load: float  # 1-minute load average at the start of the run
    cores: int
    limit_per_core: float

    @property
    def busy(self) -> bool:
        return self.load > self.limit_per_core * self.cores

    def describe(self) -> str:
        return f"1-minute load {self.load:.1f} on {self.cores} cores"

    def flag(self) -> str:
        """The line every table's header starts with on a busy host (empty on a quiet one)."""
        if not self.busy:
            return ""
        return (f"!!! HOST BUSY: {self.describe()} (over {self.limit_per_core:g} per core): "
                "these figures include other work !!!")


def check_host(busy_ok: bool, limit_per_core: float = BUSY_LOAD_PER_CORE) -> HostLoad:
    """The host's load now; refuses a busy host unless `busy_ok`."""
    host = HostLoad(os.getloadavg()[0], os.cpu_count() or 1, limit_per_core)
    if host.busy and not busy_ok:
        raise BenchError(f"the host is busy ({host.describe()}, over {limit_per_core:g} per core): its other work "
                         "would be timed with every engine; wait for it, or pass --busy-ok to bench anyway "
                         "(every table is then flagged)")
    return host
