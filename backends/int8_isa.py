"""The x86 instruction sets the int8-activation kernels come in, and which one a target gets.

The hand-written int8 kernels (decode: vnni_kernels.py, prefill: vnni_gemm.py)
are one generator each; what differs between CPUs is only the instruction that
turns bytes into int32 sums of four products per lane. Each `Int8Isa` says
which CPU features it needs (cpuinfo spelling, as a Target's cpu_flags), how
many bytes one instruction takes, and emits that product. Each kernel family
lists the ISAs it has, best first (`DECODE_ISAS`, `PREFILL_ISAS`);
`best_isa` picks the first one the target's CPU has, and a target with none
keeps the float kernels (backends/quant_kernels.py).

Both products are exact in int32 for what the kernels feed them: activations
are int8 in [-127, 127] (max |x| / 127 per group, never -128), codes are q4
(0..15, unsigned) or q8 (any int8).

- AVX-512 VNNI: `vpdpbusd` (unsigned bytes times signed bytes, four products
  per 32-bit lane, 64 bytes). Signed q8 codes meet the activation offset by 128
  (an unsigned byte), and a second `vpdpbusd` against bytes of 128 takes
  128 * sum q back out.
- AVX2: `vpmaddubsw` (unsigned times signed bytes, adjacent pairs summed to
  int16 with saturation) then `vpmaddwd` against ones (pairs of int16 to
  int32), 32 bytes. A pair sum must stay within int16: q4 codes against
  activations reach 2 * 15 * 127 = 3810. For q8 codes the unsigned operand is
  |q| (`vpabsb`: |-128| is the byte 128, read unsigned) and the sign of q moves
  onto the activation (`vpsignb`: x * sign(q), in [-127, 127]), so a pair
  reaches 2 * 128 * 127 = 32512 < 32767: exact, with no offset to take out.
  (llama.cpp does the same with the roles swapped, |x| against sign-moved
  codes, which is exact only because its q8 codes never hold -128.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

VECTOR = "vector<64xi8>"  # the byte operands the kernels hand over: 64 bytes, 16 int32 lanes of four
LANES = 16


@dataclass(frozen=True)
class Int8Isa:
    """One x86 form of the int8 dot product: what it needs of the CPU and how it is emitted."""

    name: str  # recorded in the manifest's module entry: "int8-avx512vnni", "int8-avx2"
    cpu_flags: frozenset[str]  # cpuinfo flags the CPU must have
    vector_bytes: int  # bytes one dot-product instruction takes (64: zmm, 32: ymm)
    instruction: str  # what the compiled code must hold (the tests look for it)
    zmm: bool  # whether its code uses 512-bit registers

    def available(self, cpu_flags: Iterable[str]) -> bool:
        return self.cpu_flags <= set(cpu_flags)

    def constants(self) -> list[str]:
        """Lines defining the constants dot_unsigned / dot_signed use (once per function): %isa_zi, ..."""
        lines = ["%isa_zi = arith.constant dense<0> : vector<16xi32>"]
        if self.vector_bytes == 64:
            return lines + ["%isa_x128 = arith.constant dense<-128> : vector<64xi8>"]
        return lines + [f"%isa_ones = arith.constant dense<1> : vector<{self.vector_bytes // 2}xi16>"]

    def dot_unsigned(self, out: str, acc: str, u: str, s: str) -> list[str]:
        """Lines making `out` = `acc` + the lane sums of u * s (vector<64xi8> each, u read unsigned).

        Exact while every pair 2 * u * |s| stays below 2^15 (AVX2's int16 step): q4 codes against
        activations, or unpacked q8 codes (0..255) against activations on VNNI only.
        """
        if self.vector_bytes == 64:
            return [_vpdpbusd(out, acc, u, s)]
        return self._pieces(out, acc, u, s, lambda p, uh, sh: ([], uh, sh))

    def dot_signed(self, out: str, acc: str, x: str, q: str) -> list[str]:
        """Lines making `out` = `acc` + the lane sums of x * q, both signed (x in [-127, 127], q any int8)."""
        if self.vector_bytes == 64:
            return [f"{out}_xu = arith.xori {x}, %isa_x128 : {VECTOR}",  # x + 128, read unsigned
                    _vpdpbusd(f"{out}_p", acc, f"{out}_xu", q),
                    _vpdpbusd(f"{out}_o", "%isa_zi", "%isa_x128", q),  # 128 * sum q
                    f"{out} = arith.subi {out}_p, {out}_o : vector<16xi32>"]
        v = f"vector<{self.vector_bytes}xi8>"

        def sign_moved(p: str, xh: str, qh: str) -> tuple[list[str], str, str]:  # |q| against x * sign(q)
            return ([f"{p}_a = math.absi {qh} : {v}",
                     f'{p}_s = llvm.call_intrinsic "llvm.x86.avx2.psign.b"({xh}, {qh}) : ({v}, {v}) -> {v}'],
                    f"{p}_a", f"{p}_s")

        return self._pieces(out, acc, x, q, sign_moved)

    def _pieces(self, out: str, acc: str, a: str, b: str,
                prepare: Callable[[str, str, str], tuple[list[str], str, str]]) -> list[str]:
        """The AVX2 product of 64 bytes: per 32-byte piece, (u, s) = prepare(a, b), vpmaddubsw, vpmaddwd with ones."""
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


def _vpdpbusd(out: str, acc: str, u: str, s: str) -> str:
    return (f'{out} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc}, {u}, {s}) '
            f": (vector<16xi32>, {VECTOR}, {VECTOR}) -> vector<16xi32>")


AVX512_VNNI = Int8Isa("int8-avx512vnni", frozenset({"avx512f", "avx512bw", "avx512_vnni"}), 64, "vpdpbusd", True)
AVX2 = Int8Isa("int8-avx2", frozenset({"avx2", "fma", "f16c"}), 32, "vpmaddubsw", False)
ISAS = {isa.name: isa for isa in (AVX512_VNNI, AVX2)}

# What each kernel family is written for, best first.
DECODE_ISAS = (AVX512_VNNI, AVX2)
PREFILL_ISAS = (AVX512_VNNI,)
FLOAT = "f32"  # the manifest's kernel ISA of a module with float-activation kernels


def best_isa(isas: Iterable[Int8Isa], cpu_flags: Iterable[str]) -> Int8Isa | None:
    """The first of `isas` a CPU with these flags runs, or None (the float kernels)."""
    flags = set(cpu_flags)
    return next((isa for isa in isas if isa.available(flags)), None)


@dataclass(frozen=True)
class Int8Kernels:
    """The int8 kernel ISA each family takes on one target; None: that family's float kernels."""

    decode: Int8Isa | None = None
    prefill: Int8Isa | None = None

    def record(self) -> dict[str, str]:
        """The manifest's `kernel_isa` of a module: {"decode": "int8-avx2", "prefill": "f32"}, ..."""
        return {family: isa.name if isa else FLOAT for family, isa in (("decode", self.decode),
                                                                      ("prefill", self.prefill))}


FLOAT_KERNELS = Int8Kernels()


def choose_kernels(cpu_flags: Iterable[str]) -> Int8Kernels:
    """The best int8 kernels of each family a CPU with these flags runs."""
    flags = set(cpu_flags)
    return Int8Kernels(best_isa(DECODE_ISAS, flags), best_isa(PREFILL_ISAS, flags))
