"""AVX-VNNI: `vpdpbusd` on 256-bit registers, without AVX-512 (Intel Alder Lake and later client CPUs,
Zen 5 beside its AVX-512).

The same product as AVX-512 VNNI (avx512_vnni.py), 32 bytes per instruction:
unsigned bytes times signed bytes, four products per 32-bit lane; signed q8
codes meet the activation offset by 128 and a second product takes 128 * sum q
back out. LLVM encodes the intrinsic with VEX where the CPU has AVX-VNNI and no
AVX-512 VL. A 64-byte step is two instructions, each on its own half of the
sixteen lanes, so no lanes move between halves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import x86 as forms
from ..builder import Builder, Value
from ..isa import LANES, Int8Isa, lane_pieces, zero_lanes
from .avx512_vnni import minus_128, vpdpbusd


@dataclass(frozen=True)
class AvxVnni(Int8Isa):
    def constants(self, b: Builder) -> None:
        zero_lanes(b)
        zero_lanes(b, LANES // 2)
        minus_128(b)

    def dot_unsigned(self, b: Builder, acc: Value | None, u: Value, s: Value) -> Value:
        return lane_pieces(b, acc, u, s, 2, lambda c, x, y: vpdpbusd(b, c, x, y, width=256))

    def dot_signed(self, b: Builder, acc: Value | None, x: Value, q: Value) -> Value:
        shifted = b.xori(x, minus_128(b))  # x + 128, read unsigned
        product = self.dot_unsigned(b, acc, shifted, q)
        offset = self.dot_unsigned(b, None, minus_128(b), q)  # 128 * sum q
        return b.subi(product, offset)


AVX_VNNI = AvxVnni(forms.AVX_VNNI, 32, "vpdpbusd", False)
