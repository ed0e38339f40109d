"""Element types: one table shared by the compiler, the bundle manifest and the runtime.

A leaf module (numpy and ml_dtypes only, never torch): the runtime reads it to
allocate state buffers, the frontend to build modules, the importer to spell
MLIR types. Manifests name dtypes by `DType.name` ("bfloat16").

numpy has no bfloat16 of its own; on the host a bf16 buffer is an
`ml_dtypes.bfloat16` array, the type IREE's Python runtime already maps to
HAL's BFLOAT_16 (ml_dtypes is a dependency of iree-base-runtime), so bf16
state uploads, downloads and snapshots need no bit-pattern juggling.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import FoldlineError


class DTypeError(FoldlineError, ValueError):
    """A dtype name foldline does not know, or one that cannot be used where it was asked for."""


@dataclass(frozen=True)
class DType:
    """One element type: its names, size and spelling in each layer."""

    name: str  # canonical (torch / manifest) name: "bfloat16"
    short: str  # command-line spelling: "bf16"
    nbytes: int
    mlir: str  # MLIR element type: "bf16" (signless integers: "i8")
    hal: str  # iree.runtime.HalElementType member: "BFLOAT_16"
    numpy: np.dtype  # host representation
    floating: bool


_TABLE = (
    DType("float32", "f32", 4, "f32", "FLOAT_32", np.dtype(np.float32), True),
    DType("float16", "f16", 2, "f16", "FLOAT_16", np.dtype(np.float16), True),
    DType("bfloat16", "bf16", 2, "bf16", "BFLOAT_16", np.dtype(ml_dtypes.bfloat16), True),
    DType("int8", "i8", 1, "i8", "SINT_8", np.dtype(np.int8), False),
    DType("uint8", "u8", 1, "i8", "UINT_8", np.dtype(np.uint8), False),
    DType("int32", "i32", 4, "i32", "SINT_32", np.dtype(np.int32), False),
    DType("int64", "i64", 8, "i64", "SINT_64", np.dtype(np.int64), False),
    DType("bool", "i1", 1, "i1", "BOOL_8", np.dtype(np.bool_), False),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
# The floating types a model computes in or keeps state in.
FLOAT_DTYPES: tuple[str, ...] = tuple(d.name for d in _TABLE if d.floating)
# Every spelling a user may type, to the canonical name.
ALIASES = {
    **{d.name: d.name for d in _TABLE if d.floating},
    **{d.short: d.name for d in _TABLE if d.floating},
    "fp32": "float32", "fp16": "float16",
}


def get(name: str) -> DType:
    """The table entry for a canonical name (as in a manifest); DTypeError when unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def canonical(text: str) -> str:
    """A user's spelling of a floating dtype ("bf16", "fp32", "float16") -> its canonical name."""
    try:
        return ALIASES[text.lower()]
    except KeyError:
        raise DTypeError(f"unknown floating dtype {text!r}; expected one of {', '.join(sorted(ALIASES))}") from None


def itemsize(name: str) -> int:
    return get(name).nbytes


def numpy_dtype(name: str) -> np.dtype:
    """The host numpy dtype of a manifest dtype (bfloat16 -> ml_dtypes.bfloat16)."""
    return get(name).numpy


def short_name(name: str) -> str:
    return get(name).short
