"""AVX2: `vpmaddubsw` (unsigned times signed bytes, adjacent pairs summed to int16 with saturation),
then `vpmaddwd` against ones (pairs of int16 to int32), 32 bytes at a time.

A pair sum must stay within int16: q4 codes against activations reach
2 * 15 * 127 = 3810. For q8 codes the unsigned operand is |q| (`vpabsb`:
|-128| is the byte 128, read unsigned) and the sign of q moves onto the
activation (`vpsignb`: x * sign(q), in [-127, 127]), so a pair reaches
2 * 128 * 127 = 32512 < 32767: exact, with no offset to take out. (llama.cpp
does the same with the roles swapped, |x| against sign-moved codes, which is
exact only because its q8 codes never hold -128.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import x86 as forms
from ..builder import Builder, Value
from ..isa import LANES, Int8Isa, lane_pieces, lane_pieces_of_pairs, zero_lanes

INT16_MAX = 32767


@dataclass(frozen=True)
class Avx2(Int8Isa):
    @property
    def unsigned_bytes_exact(self) -> bool:
        return False  # 2 * 255 * 127 saturates the int16 pair sum

    @property
    def _pieces(self) -> int:
        return 64 // self.vector_bytes

    def constants(self, b: Builder) -> None:
        zero_lanes(b)
        zero_lanes(b, LANES // self._pieces)
        self._ones(b)

    def _ones(self, b: Builder) -> Value:
        """int16 ones, the other operand of `vpmaddwd` (pairs of int16 summed to int32)."""
        return b.shared(1, b.vector(self.vector_bytes // 2, "i16"))

    def dot_unsigned(self, b: Builder, acc: Value | None, u: Value, s: Value) -> Value:
        return lane_pieces(b, acc, u, s, self._pieces, lambda c, x, y: self._madd(b, c, [(x, y)]))

    def unsigned_products_per_sum(self, max_code: int) -> int:
        """Pair sums of `vpmaddubsw` reach 2 * max_code * 127; that many of them stay within int16."""
        return max(1, INT16_MAX // (2 * max_code * 127))

    def dot_unsigned_sum(self, b: Builder, acc: Value | None, pairs: list[tuple[Value, Value]]) -> Value:
        """Each product's `vpmaddubsw`, added in int16 (exact: unsigned_products_per_sum bounds the sum),
        then one `vpmaddwd` against ones: two instructions per product fewer than dot_unsigned's."""
        if len(pairs) == 1:
            return self.dot_unsigned(b, acc, *pairs[0])
        return lane_pieces_of_pairs(b, acc, pairs, self._pieces, lambda c, piece: self._madd(b, c, piece))

    def dot_signed(self, b: Builder, acc: Value | None, x: Value, q: Value) -> Value:
        def sign_moved(c: Value, xh: Value, qh: Value) -> Value:  # |q| against x * sign(q)
            v = b.vector(self.vector_bytes, "i8")
            magnitude = b.absi(qh)
            return self._madd(b, c, [(magnitude, b.intrinsic("llvm.x86.avx2.psign.b", v, xh, qh))])

        return lane_pieces(b, acc, x, q, self._pieces, sign_moved)

    def _madd(self, b: Builder, acc: Value, pairs: list[tuple[Value, Value]]) -> Value:
        """`acc` + the lane sums of every u * s of `pairs` on one piece: a vpmaddubsw each, added in int16,
        then vpmaddwd against ones."""
        v16, v32 = b.vector(self.vector_bytes // 2, "i16"), b.vector(self.vector_bytes // 4, "i32")
        total = None
        for u, s in pairs:
            product = b.intrinsic("llvm.x86.avx2.pmadd.ub.sw", v16, u, s)
            total = product if total is None else b.addi(total, product)
        return b.addi(acc, b.intrinsic("llvm.x86.avx2.pmadd.wd", v32, total, self._ones(b)))


AVX2 = Avx2(forms.AVX2, 32, "vpmaddubsw", False)
