"""Whether the host is quiet enough to bench on: the 1-minute load average against the cores.

On a host whose cores are busy with other work, every engine's figures
measure that work too, and unevenly (it comes and goes between runs).
`foldline bench` refuses such a host unless told `--busy-ok`, and then
flags every table it prints.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from .child import BenchError

# The 1-minute load average, per core, above which the host counts as busy.
BUSY_LOAD_PER_CORE = 0.5


def host_cpu() -> str:
    """This machine's CPU and the best int8 kernel form it runs, as every table names them:
    "AMD EPYC (int8-avx512vnni)"; the float kernels where it runs none."""
    from ..contract.isa.registry import kernel_forms
    from ..runtime.device import host_arch, host_cpu_features

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        named = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.split(":", 1)[0].strip() in ("model name", "Model")]
        model = named[0] if named else model
    flags, arch = host_cpu_features() or set(), host_arch()
    form = next((f.name for f in kernel_forms(arch) if f.runs_on(flags, arch)), "float kernels")
    return f"{model} ({form})"


@dataclass(frozen=True)
class HostLoad:
    load: float  # 1-minute load average at the start of the run
    cores: int
    limit_per_core: float
    cpu: str = field(default_factory=host_cpu)

    @property
    def busy(self) -> bool:
        return self.load > self.limit_per_core * self.cores

    def describe(self) -> str:
        return f"1-minute load {self.load:.1f} on {self.cores} cores of {self.cpu}"

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
