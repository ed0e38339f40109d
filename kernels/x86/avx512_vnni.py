"""AVX-512 VNNI: `vpdpbusd`, unsigned bytes times signed bytes, four products per 32-bit lane, 64 bytes.

Signed q8 codes meet the activation offset by 128 (an unsigned byte), and a
second `vpdpbusd` against bytes of 128 takes 128 * sum q back out: exact in
int32 for activations in [-127, 127] and any int8 code.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import x86 as forms
from ..isa import VECTOR, Int8Isa


def vpdpbusd(out: str, acc: str, u: str, s: str, width: int = 512) -> str:
    """`out` = `acc` + the 4-byte lane sums of u * s (u unsigned, s signed), `width` bits wide."""
    lanes, v = width // 32, f"vector<{width // 8}xi8>"
    return (f'{out} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.{width}"({acc}, {u}, {s}) '
            f": (vector<{lanes}xi32>, {v}, {v}) -> vector<{lanes}xi32>")


@dataclass(frozen=True)
class Avx512Vnni(Int8Isa):
    def constants(self) -> list[str]:
        return ["%isa_zi = arith.constant dense<0> : vector<16xi32>",
                "%isa_x128 = arith.constant dense<-128> : vector<64xi8>"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        return [vpdpbusd(out, acc, u, s)]

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        return [f"{out}_xu = arith.xori {x}, %isa_x128 : {VECTOR}",  # x + 128, read unsigned
                vpdpbusd(f"{out}_p", acc, f"{out}_xu", q),
                vpdpbusd(f"{out}_o", "%isa_zi", "%isa_x128", q),  # 128 * sum q
                f"{out} = arith.subi {out}_p, {out}_o : vector<16xi32>"]


AVX512_VNNI = Avx512Vnni(forms.AVX512_VNNI, 64, "vpdpbusd", True)
