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

from collections.abc import Callable
from dataclasses import dataclass

from ..isa import LANES, VECTOR, Int8Isa


@dataclass(frozen=True)
class Avx2(Int8Isa):
    @property
    def unsigned_bytes_exact(self) -> bool:
        return False  # 2 * 255 * 127 saturates the int16 pair sum

    def constants(self) -> list[str]:
        return ["%isa_zi = arith.constant dense<0> : vector<16xi32>",
                f"%isa_ones = arith.constant dense<1> : vector<{self.vector_bytes // 2}xi16>"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        return self._pieces(out, acc, u, s, lambda p, uh, sh: ([], uh, sh))

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        v = f"vector<{self.vector_bytes}xi8>"

        def sign_moved(p: str, xh: str, qh: str) -> tuple[list[str], str, str]:  # |q| against x * sign(q)
            return ([f"{p}_a = math.absi {qh} : {v}",
                     f'{p}_s = llvm.call_intrinsic "llvm.x86.avx2.psign.b"({xh}, {qh}) : ({v}, {v}) -> {v}'],
                    f"{p}_a", f"{p}_s")

        return self._pieces(out, acc, x, q, sign_moved)

    def _pieces(self, out: str, acc: str, a: str, b: str,
                prepare: Callable[[str, str, str], tuple[list[str], str, str]]) -> list[str]:
        """The product of 64 bytes: per 32-byte piece, (u, s) = prepare(a, b), vpmaddubsw, vpmaddwd with ones."""
        vb = self.vector_bytes
        v, v16, v32 = f"vector<{vb}xi8>", f"vector<{vb // 2}xi16>", f"vector<{vb // 4}xi32>"
        lines, sums = [], []
        for h in range(64 // vb):
            p = f"{out}_h{h}"
            for name, whole in (("x", a), ("y", b)):
                piece = list(range(h * vb, (h + 1) * vb))
                lines.append(f"{p}_{name} = vector.shuffle {whole}, {whole} {piece} : {VECTOR}, {VECTOR}")
            prep, u, s = prepare(p, f"{p}_x", f"{p}_y")
            lines += [*prep,
                      f'{p}_w = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"({u}, {s}) : ({v}, {v}) -> {v16}',
                      f'{p}_d = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({p}_w, %isa_ones) '
                      f": ({v16}, {v16}) -> {v32}"]
            sums.append(f"{p}_d")
        joined = out if acc == "%isa_zi" else f"{out}_j"
        lines.append(f"{joined} = vector.shuffle {sums[0]}, {sums[1]} {list(range(LANES))} : {v32}, {v32}")
        if joined != out:
            lines.append(f"{out} = arith.addi {acc}, {joined} : vector<16xi32>")
        return lines


AVX2 = Avx2("int8-avx2", "x86_64", frozenset({"avx2", "fma", "f16c"}), 32, "vpmaddubsw", False)
