"""The instruction-set forms of the int8 dot product, and which kernels a target gets.

The int8-activation kernels (decode: int8_decode.py, prefill: int8_gemm.py) are
one generator each; what differs between CPUs is the instruction that turns
bytes into int32 sums of four products per lane. An `Int8Isa` says what a CPU
must have for it (its arch and feature flags, in /proc/cpuinfo spelling, as a
Target's cpu_flags) and emits that product for 64 bytes at a time. Each ISA
family lives in a folder of its own (kernels/x86/), and kernels/select.py says
which forms each kernel family is written for and gives a target the first
form its CPU runs, or the float kernels (kernels/qlinear.py) when it runs none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

VECTOR = "vector<64xi8>"  # the byte operands the kernels hand over: 64 bytes, 16 int32 lanes of four
LANES = 16
FLOAT = "f32"  # the manifest's kernel ISA of a module with float-activation kernels


@dataclass(frozen=True)
class Int8Isa(ABC):
    """One form of the int8 dot product: what it needs of the CPU and how it is emitted.

    Both products are exact in int32 for what the kernels feed them: activations
    are int8 in [-127, 127] (max |x| / 127 per group, never -128), codes are q4
    (0..15, unsigned) or q8 (any int8); each form says why.
    """

    name: str  # recorded in the manifest's module entry: "int8-avx512vnni", "int8-avx2"
    arch: str  # the target arch it runs on ("x86_64")
    cpu_flags: frozenset[str]  # feature flags the CPU must have (cpuinfo spelling)
    vector_bytes: int  # bytes one dot-product instruction takes (64: zmm, 32: ymm)
    instruction: str  # what the compiled code must hold (the tests look for it)
    zmm: bool  # whether its code uses 512-bit registers

    @property
    def unsigned_bytes_exact(self) -> bool:
        """Whether dot_unsigned is exact for any unsigned byte (0..255) against the activations, not
        only q4 codes: true of VNNI's four products per int32 lane, false where pairs meet in int16."""
        return True

    def available(self, cpu_flags: Iterable[str], arch: str = "x86_64") -> bool:
        return arch == self.arch and self.cpu_flags <= set(cpu_flags)

    @abstractmethod
    def constants(self) -> list[str]:
        """Lines defining the constants dot_unsigned / dot_signed use (once per function): %isa_zi, ..."""

    @abstractmethod
    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        """Lines making `out` = `acc` + the lane sums of u * s (vector<64xi8> each, u read unsigned).

        Exact while every pair 2 * u * |s| stays below 2^15: q4 codes against activations.
        """

    @abstractmethod
    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        """Lines making `out` = `acc` + the lane sums of x * q, both signed (x in [-127, 127], q any int8)."""




@dataclass(frozen=True)
class Int8Kernels:
    """The int8 kernel ISA each family takes on one target; None: that family's float kernels."""

    decode: Int8Isa | None = None
    prefill: Int8Isa | None = None

    def record(self) -> dict[str, str]:
        """The manifest's `kernel_isa` of a module: {"decode": "int8-avx2", "prefill": "f32"}, ..."""
        return {family: isa.name if isa else FLOAT for family, isa in (("decode", self.decode),
                                                                      ("prefill", self.prefill))}


FLOAT_KERNELS = Int8Kernels()
