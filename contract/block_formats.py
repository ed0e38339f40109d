"""The block formats' array layouts, as params.irpa holds them (frontend/quant.py makes them,
the kernels read them)."""

from __future__ import annotations

FORMATS = ("q8", "q4", "q5")


def codes_dims(fmt: str, n: int, k: int) -> tuple[int, int]:
    """The codes array of an [N, K] weight in a block format: q8 a byte per code, q4 two codes per
    byte, q5 those nibbles then a plane of fifth bits (one bit per code)."""
    return (n, {"q4": k // 2, "q5": k // 2 + k // 8}.get(fmt, k))


def row_length(fmt: str, width: int) -> int:
    """K, the codes per row, of a codes array `width` bytes wide (the inverse of codes_dims)."""
    return {"q4": width * 2, "q5": width * 8 // 5}.get(fmt, width)
