"""What a compiled module (.vmfb) says about where it runs, read from its bytes.

The manifest says what a module was built for; this reads what it actually
contains, so a module swapped in from another build cannot pass for this one.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .isa import isa_flags

# ELF e_machine -> the runtime's arch spelling (for the executables embedded in a CPU vmfb)
ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv"}
# IREE executable format prefix/name -> what it runs on
_FORMAT_RE = re.compile(rb"(embedded-elf-[a-z0-9_]+|system-elf-[a-z0-9_]+|vulkan-spirv-fb|cuda-nvptx-fb|rocm-hsaco-fb)")
_PTX_TARGET_RE = re.compile(rb"\.target (sm_[0-9]+a?)")
# IREE keeps each executable's target attributes (as text) in the module: the LLVM CPU features
# its code was compiled for, whatever the manifest says.
_CPU_FEATURES_RE = re.compile(rb'cpu_features = "([^"]*)"')


@dataclass
class VmfbInfo:
    """Executable formats, embedded ELF machines, PTX targets and CPU features inside a module."""

    formats: list[str] = field(default_factory=list)  # e.g. embedded-elf-arm_64, cuda-nvptx-fb
    elf_machines: list[str] = field(default_factory=list)  # arch of each embedded ELF executable
    ptx_targets: list[str] = field(default_factory=list)  # e.g. sm_80
    # contract.isa flags (cpuinfo spelling) some embedded executable was compiled to use
    cpu_flags: list[str] = field(default_factory=list)

    @property
    def arches(self) -> set[str]:
        return set(self.elf_machines)


def vmfb_info(path: str | Path) -> VmfbInfo:
    """Read a .vmfb's executable formats, embedded ELF machines, PTX targets and CPU features."""
    data = Path(path).read_bytes()
    info = VmfbInfo()
    info.formats = sorted({m.decode() for m in _FORMAT_RE.findall(data)})
    info.ptx_targets = sorted({m.decode() for m in _PTX_TARGET_RE.findall(data)})
    info.cpu_flags = sorted({f for m in _CPU_FEATURES_RE.findall(data) for f in isa_flags(m.decode())})
    machines = set()
    start = data.find(b"\x7fELF")
    while start != -1:
        # a little-endian shared object (ET_DYN): what IREE embeds for each CPU executable
        if len(data) >= start + 20 and data[start + 5] == 1 and struct.unpack_from("<H", data, start + 16)[0] == 3:
            (machine,) = struct.unpack_from("<H", data, start + 18)
            machines.add(ELF_MACHINES.get(machine, f"elf-machine-{machine}"))
        start = data.find(b"\x7fELF", start + 4)
    info.elf_machines = sorted(machines)
    return info
