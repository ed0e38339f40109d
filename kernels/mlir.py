"""Spelling MLIR text for the kernel generators: types, exact float constants, executables.

Every generator in this package writes MLIR as text; the few things they all
spell live here once, so a type or an executable is written the same way
everywhere.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


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
    float decode kernels ran fifty times slower than with the instructions (docs/quantization.md,
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
    """
    if isa.fma:
        return [f"{out} = math.fma {a}, {b}, {acc or zero} : {type_}"]
    if acc is None:
        return [f"{out} = arith.mulf {a}, {b} : {type_}"]
    return [f"{out}_mul = arith.mulf {a}, {b} : {type_}", f"{out} = arith.addf {out}_mul, {acc} : {type_}"]


def _constant(value: int | float, type_: str) -> str:
    if type_.startswith("vector<"):
        return f"arith.constant dense<{value}> : {type_}"
    return f"arith.constant {value} : {type_}"


def widen_f16(src: str, dst: str, f16_type: str, isa: FloatIsa = HARDWARE_FLOAT) -> list[str]:
    """`dst` = `src` (f16, or a vector of f16 named by `f16_type`) as f32, exactly.

    Where the CPU converts f16 in hardware (`isa.f16`: x86-64 with F16C, every aarch64 core):
    `arith.extf`, one instruction per vector. Without it (`x86-64-v2`, `generic` x86-64) LLVM
    turns `extf` into a call to compiler-rt's `__extendhfsf2` per element; the integer form
    here is a few vector instructions instead: the exponent rebiased from 15 to 127 for
    normal numbers and infinities or NaNs (exponent 31 to 255), and a subnormal's mantissa
    m read as m * 2^-24 (exact: m < 1024, and the product is a normal f32); the sign on top.
    """
    if isa.f16:
        return [f"{dst} = arith.extf {src} : {f16_type} to {f16_type.replace('f16', 'f32')}"]
    i16 = f16_type.replace("f16", "i16")
    return [f"{dst}_h = arith.bitcast {src} : {f16_type} to {i16}", *f16_bits_to_f32(f"{dst}_h", dst, i16)]


def f16_bits_to_f32(src: str, dst: str, i16_type: str) -> list[str]:
    """`dst` = the f16 values whose bits `src` holds (i16, or a vector of i16 named by `i16_type`) as
    f32, exactly, in integer and f32 instructions only (`widen_f16` without F16C)."""
    i32, f32, i1 = (i16_type.replace("i16", t) for t in ("i32", "f32", "i1"))
    p = dst
    return [
        f"{p}_u = arith.extui {src} : {i16_type} to {i32}",
        f"{p}_c7fff = {_constant(0x7FFF, i32)}",
        f"{p}_c8000 = {_constant(0x8000, i32)}",
        f"{p}_c400 = {_constant(0x400, i32)}",
        f"{p}_c7c00 = {_constant(0x7C00, i32)}",
        f"{p}_c13 = {_constant(13, i32)}",
        f"{p}_c16 = {_constant(16, i32)}",
        f"{p}_rebias = {_constant(112 << 23, i32)}",
        f"{p}_rebias_inf = {_constant(224 << 23, i32)}",
        f"{p}_tiny = {_constant('5.9604644775390625E-8', f32)}",  # 2^-24, exactly
        f"{p}_em = arith.andi {p}_u, {p}_c7fff : {i32}",
        f"{p}_sgn0 = arith.andi {p}_u, {p}_c8000 : {i32}",
        f"{p}_sgn = arith.shli {p}_sgn0, {p}_c16 : {i32}",
        f"{p}_sh = arith.shli {p}_em, {p}_c13 : {i32}",
        f"{p}_is_inf = arith.cmpi uge, {p}_em, {p}_c7c00 : {i32}",
        f"{p}_bias = arith.select {p}_is_inf, {p}_rebias_inf, {p}_rebias : {i1}, {i32}",
        f"{p}_normal = arith.addi {p}_sh, {p}_bias : {i32}",
        f"{p}_mf = arith.uitofp {p}_em : {i32} to {f32}",
        f"{p}_subf = arith.mulf {p}_mf, {p}_tiny : {f32}",
        f"{p}_sub = arith.bitcast {p}_subf : {f32} to {i32}",
        f"{p}_is_sub = arith.cmpi ult, {p}_em, {p}_c400 : {i32}",
        f"{p}_mag = arith.select {p}_is_sub, {p}_sub, {p}_normal : {i1}, {i32}",
        f"{p}_bits = arith.ori {p}_mag, {p}_sgn : {i32}",
        f"{dst} = arith.bitcast {p}_bits : {i32} to {f32}",
    ]
