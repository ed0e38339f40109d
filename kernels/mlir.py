"""What the kernel generators share: type spellings, exact float bits, and which float operations a CPU has.

The float kernels are templates (templates/*.mlir) and the int8 kernels build
their ops (builder.py); both name types and constants through these, so a type
is written the same way everywhere.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import dtypes

CACHE_LINE = 64  # bytes: what one prefetch asks the memory for


def element_bytes(element: str) -> int:
    """The size of an MLIR float element type ("f16", "bf16", "f32"), from the one dtype table."""
    return dtypes.itemsize(dtypes.canonical(element))


def tensor_type(shape: Sequence[int], element: str) -> str:
    """`tensor<2x3xf32>`."""
    return f"tensor<{'x'.join(map(str, shape))}x{element}>"


def memref_type(shape: Sequence[int], element: str) -> str:
    """`memref<2x3xf32>`."""
    return f"memref<{'x'.join(map(str, shape))}x{element}>"


def as_tensor(memref: str) -> str:
    """The tensor type of a memref type's shape and element."""
    return memref.replace("memref", "tensor")


def f32_bits(value: float) -> str:
    """A float32's bits in hex: a symbol-safe name and an exact MLIR constant."""
    return f"{struct.unpack('<I', struct.pack('<f', value))[0]:08x}"


@dataclass(frozen=True)
class FloatIsa:
    """Which float operations a CPU target does in hardware; the float kernels spell the others out.

    A kernel that asks LLVM for an operation the CPU lacks gets a library call per element:
    `math.fma` becomes libm's `fmaf` and `arith.extf` from f16 compiler-rt's `__extendhfsf2`.
    x86-64 CPUs before Haswell (`x86-64-v2`, `generic`) have neither FMA nor F16C, and their
    float decode kernels ran many times slower than with the instructions (docs/quantization.md,
    "Float kernels on CPUs without FMA or F16C").
    """

    fma: bool = True  # fused multiply-add: x86-64 `fma`, every aarch64 core
    f16: bool = True  # f16 -> f32 conversion: x86-64 `f16c`, every aarch64 core
    # Registers for 128 floats or more: x86-64 with AVX (16 of 8 floats), every aarch64 core (32 of 4).
    # SSE's 16 registers of 4 floats hold four rows' partial sums and nothing else.
    wide_registers: bool = True

    @classmethod
    def of(cls, cpu_flags: Iterable[str], arch: str) -> FloatIsa:
        """The float operations of a CPU of `arch` with these flags (cpuinfo spelling)."""
        if arch != "x86_64":
            return cls()
        flags = set(cpu_flags)
        return cls(fma="fma" in flags, f16="f16c" in flags, wide_registers="avx" in flags)


HARDWARE_FLOAT = FloatIsa()
