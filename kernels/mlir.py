"""Spelling MLIR text for the kernel generators: types, exact float constants, executables.

The generators that write MLIR as text (the float kernels, the `flow.dispatch`
calls of the int8 ones) spell the few things they share here once, so a type or
an executable is written the same way everywhere. The int8 kernels build their
ops instead (builder.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .template import instantiate


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


def f32_const(value: float) -> str:
    """An exact f32 constant: `0x3F800000 : f32`."""
    return f"0x{f32_bits(value).upper()} : f32"


def stream_executable(name: str, workgroups: int, bindings: list[str], body: list[str]) -> str:
    """A `stream.executable` @{name}_exe exporting @{name}: a fixed 1-D workgroup count, one func of `body`.

    A hand-written dispatch: the kernel's `util.func` reaches it with `flow.dispatch`.
    """
    return "\n".join([
        f"stream.executable private @{name}_exe {{",
        f"  stream.executable.export public @{name} workgroups() -> (index, index, index) {{",
        f"    %n = arith.constant {workgroups} : index",
        "    %one = arith.constant 1 : index",
        "    stream.return %n, %one, %one : index, index, index",
        "  }",
        "  builtin.module {",
        f"    func.func @{name}({', '.join(bindings)}) {{",
        *[f"      {line}" for line in body],
        "      return",
        "    }",
        "  }",
        "}",
    ])


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


def multiply_add(out: str, a: str, b: str, acc: str | None, type_: str, isa: FloatIsa = HARDWARE_FLOAT,
                 zero: str = "%zf") -> list[str]:
    """`out` = a * b + acc: one `math.fma` where the CPU has FMA, else a multiply and an add
    (acc None: a * b + 0, the FMA form's way to spell a product, a plain multiply without it).

    On a CPU without FMA, `math.fma`'s fused rounding costs a call to libm's `fmaf` per element.
    The spelling is templates/multiply_add.mlir, which the templated kernels include.
    """
    return _lines(instantiate("multiply_add", out=out, a=a, b=b, acc=acc, type=type_, fma=isa.fma, zero=zero,
                              pad=""))


def _lines(text: str) -> list[str]:
    return text.split("\n")


def widen_f16(src: str, dst: str, f16_type: str, isa: FloatIsa = HARDWARE_FLOAT) -> list[str]:
    """`dst` = `src` (f16, or a vector of f16 named by `f16_type`) as f32, exactly.

    Where the CPU converts f16 in hardware (`isa.f16`: x86-64 with F16C, every aarch64 core):
    `arith.extf`, one instruction per vector. Without it (`x86-64-v2`, `generic` x86-64) LLVM
    turns `extf` into a call to compiler-rt's `__extendhfsf2` per element; the integer form
    (`f16_bits_to_f32`) is a few vector instructions instead. The spelling is
    templates/widen_f16.mlir.
    """
    return _lines(instantiate("widen_f16", src=src, dst=dst, f16_type=f16_type, f16=isa.f16, pad=""))


def f16_bits_to_f32(src: str, dst: str, i16_type: str) -> list[str]:
    """`dst` = the f16 values whose bits `src` holds (i16, or a vector of i16 named by `i16_type`) as
    f32, exactly, in integer and f32 instructions only (`widen_f16` without F16C): the exponent
    rebiased, a subnormal's mantissa scaled by 2^-24, the sign on top (templates/f16_bits_to_f32.mlir)."""
    return _lines(instantiate("f16_bits_to_f32", src=src, dst=dst, i16_type=i16_type, pad=""))
