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
from ..isa import Int8Isa, lane_pieces

QUARTERS = 4  # sdot instructions per 64-byte step
_V = "vector<16xi8>"
_ACC = "vector<4xi32>"


def sdot(out: str, acc: str, a: str, b: str) -> str:
    """`out` = `acc` + the 4-byte lane sums of a * b (both signed), 16 bytes."""
    return (f'{out} = llvm.call_intrinsic "llvm.aarch64.neon.sdot.v4i32.v16i8"({acc}, {a}, {b}) '
            f": ({_ACC}, {_V}, {_V}) -> {_ACC}")


def _sdot(out: str, acc: str, a: str, b: str) -> list[str]:
    return [sdot(out, acc, a, b)]


@dataclass(frozen=True)
class NeonDotprod(Int8Isa):
    @property
    def unsigned_bytes_exact(self) -> bool:
        return False  # sdot reads every byte signed: q8 codes take dot_signed

    def constants(self) -> list[str]:
        return ["%isa_zi = arith.constant dense<0> : vector<16xi32>",
                f"%isa_zq = arith.constant dense<0> : {_ACC}"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        return lane_pieces(out, acc, u, s, QUARTERS, "%isa_zq", _sdot)  # q4 codes (0..15): the same bytes signed

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        return lane_pieces(out, acc, x, q, QUARTERS, "%isa_zq", _sdot)


NEON_DOTPROD = NeonDotprod(forms.NEON_DOTPROD, 16, "sdot", False)
