"""NEON dotprod (Armv8.2-A's optional `sdot`, mandatory from Armv8.4-A): signed bytes times signed
bytes, four products summed into each 32-bit lane, 16 bytes at a time.

Cortex-A55/A76 and later cores, Raspberry Pi 5 (Cortex-A76), Apple M1 and later,
AWS Graviton 2 and later. Both operands are signed, so neither product needs an
offset: q4 codes (0..15) and activations in [-127, 127] are already int8, and a
q8 code meets the activation as it is; four products reach 4 * 128 * 127 < 2^31.
A 64-byte step is four instructions, each on its own quarter of the sixteen
lanes (lane i sums bytes 4i..4i+3, as in every x86 form), so no lanes move
between quarters. Unsigned bytes above 127 would read as negative: the kernels
take the signed form for q8 codes (`unsigned_bytes_exact` is false).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import arm as forms
from ..builder import Builder, Value
from ..isa import LANES, Int8Isa, lane_pieces, zero_lanes

QUARTERS = 4  # sdot instructions per 64-byte step


def sdot(b: Builder, acc: Value, x: Value, y: Value) -> Value:
    """`acc` + the 4-byte lane sums of x * y (both signed), 16 bytes."""
    return b.intrinsic("llvm.aarch64.neon.sdot.v4i32.v16i8", b.vector(4, "i32"), acc, x, y)


@dataclass(frozen=True)
class NeonDotprod(Int8Isa):
    @property
    def unsigned_bytes_exact(self) -> bool:
        return False  # sdot reads every byte signed: q8 codes take dot_signed

    def constants(self, b: Builder) -> None:
        zero_lanes(b)
        zero_lanes(b, LANES // QUARTERS)

    def dot_unsigned(self, b: Builder, acc: Value | None, u: Value, s: Value) -> Value:
        # q4 codes (0..15): the same bytes signed
        return lane_pieces(b, acc, u, s, QUARTERS, lambda c, x, y: sdot(b, c, x, y))

    def dot_signed(self, b: Builder, acc: Value | None, x: Value, q: Value) -> Value:
        return lane_pieces(b, acc, x, q, QUARTERS, lambda c, xq, qq: sdot(b, c, xq, qq))


NEON_DOTPROD = NeonDotprod(forms.NEON_DOTPROD, 16, "sdot", False)
