"""IREE target presets: the iree-compile flags for each foldline target."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

# x86 ISA extensions that LLVM may use when compiling for a named/host CPU;
# the runtime refuses a module whose recorded flags this CPU lacks.
X86_ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2",
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
)


class TargetError(ValueError):
    """An unknown or unsupported compile target."""


@dataclass
class Target:
    """One compiled module of a bundle."""

    device: str  # cpu, vulkan, cuda: the runtime device that runs it
    flags: list[str]
    description: str
    arch: str | None = None
    cpu_flags: list[str] = field(default_factory=list)


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _host_isa_flags() -> list[str]:
    from ..runtime.device import host_cpu_features

    have = host_cpu_features() or set()
    return [f for f in X86_ISA_FLAGS if f in have]


def cpu_target(cpu: str = "host", triple: str | None = None) -> Target:
    flags = ["--iree-hal-target-backends=llvm-cpu"]
    arch = host_arch()
    if triple:
        flags.append(f"--iree-llvmcpu-target-triple={triple}")
        arch = triple.split("-")[0]
    cpu_flags: list[str] = []
    if cpu == "host":
        if triple and arch != host_arch():
            raise TargetError("--cpu host cannot be combined with a cross-compile --triple; name the CPU")
        flags.append("--iree-llvmcpu-target-cpu=host")
        cpu_flags = _host_isa_flags() if arch == "x86_64" else []
    elif cpu != "generic":
        flags.append(f"--iree-llvmcpu-target-cpu={cpu}")
    return Target("cpu", flags, f"llvm-cpu ({cpu}{', ' + triple if triple else ''})", arch, cpu_flags)


def vulkan_target(vulkan_target: str = "generic") -> Target:
    flags = ["--iree-hal-target-backends=vulkan-spirv", f"--iree-vulkan-target={vulkan_target}"]
    return Target("vulkan", flags, f"vulkan-spirv ({vulkan_target})")


def cuda_target(arch: str = "sm_80") -> Target:
    flags = ["--iree-hal-target-backends=cuda", f"--iree-cuda-target={arch}"]
    return Target("cuda", flags, f"cuda ({arch})", arch=arch)


def make_target(name: str, cpu: str = "host", triple: str | None = None,
                vulkan: str = "generic", cuda_arch: str = "sm_80") -> Target:
    if name == "cpu":
        return cpu_target(cpu, triple)
    if name == "vulkan":
        return vulkan_target(vulkan)
    if name == "cuda":
        return cuda_target(cuda_arch)
    raise TargetError(f"unknown target {name!r}; expected cpu, vulkan or cuda")
