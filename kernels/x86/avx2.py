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
from ..isa import LANES, Int8Isa, lane_pieces, lane_pieces_of_pairs

INT16_MAX = 32767


@dataclass(frozen=True)
class Avx2(Int8Isa):
    @property
    def unsigned_bytes_exact(self) -> bool:
        return False  # 2 * 255 * 127 saturates the int16 pair sum

    @property
    def _pieces(self) -> int:
        return 64 // self.vector_bytes

    def constants(self) -> list[str]:
        lanes = LANES // self._pieces
        return ["%isa_zi = arith.constant dense<0> : vector<16xi32>",
                f"%isa_zh = arith.constant dense<0> : vector<{lanes}xi32>",
                f"%isa_ones = arith.constant dense<1> : vector<{self.vector_bytes // 2}xi16>"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        return lane_pieces(out, acc, u, s, self._pieces, "%isa_zh", self._madd)

    def unsigned_products_per_sum(self, max_code: int) -> int:
        """Pair sums of `vpmaddubsw` reach 2 * max_code * 127; that many of them stay within int16."""
        return max(1, INT16_MAX // (2 * max_code * 127))

    def dot_unsigned_sum(self, out: str, acc: str, pairs: list[tuple[str, str]]) -> list[str]:
        """Each product's `vpmaddubsw`, added in int16 (exact: unsigned_products_per_sum bounds the sum),
        then one `vpmaddwd` against ones: two instructions per product fewer than dot_unsigned's."""
        if len(pairs) == 1:
            return self.dot_unsigned(out, acc, *pairs[0])
        return lane_pieces_of_pairs(out, acc, pairs, self._pieces, "%isa_zh", self._madd_sum)

    def _madd_sum(self, out: str, acc: str, pairs: list[tuple[str, str]]) -> list[str]:
        vb = self.vector_bytes
        v, v16, v32 = f"vector<{vb}xi8>", f"vector<{vb // 2}xi16>", f"vector<{vb // 4}xi32>"
        lines, total = [], None
        for i, (u, s) in enumerate(pairs):
            lines.append(f'{out}_w{i} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"({u}, {s}) : ({v}, {v}) -> {v16}')
            if total is not None:
                lines.append(f"{out}_t{i} = arith.addi {total}, {out}_w{i} : {v16}")
            total = f"{out}_t{i}" if total is not None else f"{out}_w{i}"
        return lines + [
            f'{out}_m = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({total}, %isa_ones) : ({v16}, {v16}) -> {v32}',
            f"{out} = arith.addi {acc}, {out}_m : {v32}"]

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        v = f"vector<{self.vector_bytes}xi8>"

        def sign_moved(o: str, c: str, xh: str, qh: str) -> list[str]:  # |q| against x * sign(q)
            return [f"{o}_a = math.absi {qh} : {v}",
                    f'{o}_s = llvm.call_intrinsic "llvm.x86.avx2.psign.b"({xh}, {qh}) : ({v}, {v}) -> {v}',
                    *self._madd(o, c, f"{o}_a", f"{o}_s")]

        return lane_pieces(out, acc, x, q, self._pieces, "%isa_zh", sign_moved)

    def _madd(self, out: str, acc: str, u: str, s: str) -> list[str]:
        """`out` = `acc` + the lane sums of u * s on one piece: vpmaddubsw, then vpmaddwd against ones."""
        vb = self.vector_bytes
        v, v16, v32 = f"vector<{vb}xi8>", f"vector<{vb // 2}xi16>", f"vector<{vb // 4}xi32>"
        return [f'{out}_w = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"({u}, {s}) : ({v}, {v}) -> {v16}',
                f'{out}_m = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({out}_w, %isa_ones) : ({v16}, {v16}) -> {v32}',
                f"{out} = arith.addi {acc}, {out}_m : {v32}"]


AVX2 = Avx2(forms.AVX2, 32, "vpmaddubsw", False)
