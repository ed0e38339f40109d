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
from ..isa import VECTOR, Int8Isa, lane_pieces
from .avx512_vnni import vpdpbusd


@dataclass(frozen=True)
class AvxVnni(Int8Isa):
    def constants(self) -> list[str]:
        return ["%isa_zi = arith.constant dense<0> : vector<16xi32>",
                "%isa_zh = arith.constant dense<0> : vector<8xi32>",
                "%isa_x128 = arith.constant dense<-128> : vector<64xi8>"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        return lane_pieces(out, acc, u, s, 2, "%isa_zh", lambda o, c, x, y: [vpdpbusd(o, c, x, y, width=256)])

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        return [f"{out}_xu = arith.xori {x}, %isa_x128 : {VECTOR}",  # x + 128, read unsigned
                *self.dot_unsigned(f"{out}_p", acc, f"{out}_xu", q),
                *self.dot_unsigned(f"{out}_o", "%isa_zi", "%isa_x128", q),  # 128 * sum q
                f"{out} = arith.subi {out}_p, {out}_o : vector<16xi32>"]


AVX_VNNI = AvxVnni(forms.AVX_VNNI, 32, "vpdpbusd", False)
