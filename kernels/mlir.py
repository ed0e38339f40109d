"""Spelling MLIR text for the kernel generators: types, exact float constants, executables.

Every generator in this package writes MLIR as text; the few things they all
spell live here once, so a type or an executable is written the same way
everywhere.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence


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
