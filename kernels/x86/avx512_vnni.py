"""AVX-512 VNNI: `vpdpbusd`, unsigned bytes times signed bytes, four products per 32-bit lane, 64 bytes.

Signed q8 codes meet the activation offset by 128 (an unsigned byte), and a
second `vpdpbusd` against bytes of 128 takes 128 * sum q back out: exact in
int32 for activations in [-127, 127] and any int8 code.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import x86 as forms
from ..builder import Builder, Value
from ..isa import Int8Isa, zero_lanes


def vpdpbusd(b: Builder, acc: Value, u: Value, s: Value, width: int = 512) -> Value:
    """`acc` + the 4-byte lane sums of u * s (u unsigned, s signed), `width` bits wide."""
    return b.intrinsic(f"llvm.x86.avx512.vpdpbusd.{width}", b.vector(width // 32, "i32"), acc, u, s)


def minus_128(b: Builder) -> Value:
    """Bytes of -128: xor-ed into a signed byte it adds 128 (read unsigned), and 128 as an unsigned operand."""
    return b.shared(-128, b.vector(64, "i8"))


@dataclass(frozen=True)
class Avx512Vnni(Int8Isa):
    def constants(self, b: Builder) -> None:
        zero_lanes(b)
        minus_128(b)

    def dot_unsigned(self, b: Builder, acc: Value | None, u: Value, s: Value) -> Value:
        return vpdpbusd(b, zero_lanes(b) if acc is None else acc, u, s)

    def dot_signed(self, b: Builder, acc: Value | None, x: Value, q: Value) -> Value:
        shifted = b.xori(x, minus_128(b))  # x + 128, read unsigned
        product = vpdpbusd(b, zero_lanes(b) if acc is None else acc, shifted, q)
        offset = vpdpbusd(b, zero_lanes(b), minus_128(b), q)  # 128 * sum q
        return b.subi(product, offset)


AVX512_VNNI = Avx512Vnni(forms.AVX512_VNNI, 64, "vpdpbusd", True)
