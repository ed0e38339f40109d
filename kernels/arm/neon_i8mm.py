"""NEON i8mm (Armv8.6-A's int8 matrix multiply, optional from Armv8.2-A): `smmla` for prefill.

Apple M2 and later, AWS Graviton 3 and later, Neoverse V1/N2, Cortex-A510/A710/X2
and later phones' cores. `smmla` multiplies a 2x8 matrix of signed bytes by the
transpose of another: four int32 sums of eight products each, 32 products
per instruction against sdot's 16. That needs operands of two rows side by
side, so this form brings a GEMM microkernel of its own (`gemm_executable`),
not only a dot-product instruction:

- the quantize dispatch writes each row's 8 bytes of a k block next to its
  pair's ([K/8][M/2][2][8], which is [K/8][8M] with row r at column 8r: the
  column of row 2p+1 is 16p + 8);
- the GEMM unpacks each tile channel's codes as the shared kernel does
  (int8_gemm._unpack_codes: q4 and q5 codes 0..31 are signed bytes as they
  are, q8 codes taken signed), pairs two channels' 8 bytes per k block, and
  keeps 4 x 2 blocks of 2 x 2 sums (8 rows, 4 channels) over every group,
  scaled per group into float sums: dx per row and scale per channel, laid
  out [d0, d0, d1, d1] * [s0, s1, s0, s1] like the 2 x 2 sums themselves.

The decode kernels take this CPU's sdot form (a decode row has no pair).
Exact in int32: 8 * 128 * 127 per instruction, a group of 64 at most 8 of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.isa import arm as forms
from .neon_dotprod import NeonDotprod

ROW_PAIRS = 4  # row pairs per register block: 8 rows
CHANNEL_PAIRS = 2  # channel pairs per register block: 4 channels
_ACC = "vector<4xi32>"
_V = "vector<16xi8>"


def smmla(out: str, acc: str, a: str, b: str) -> str:
    """`out` = `acc` + a (2x8 signed bytes, row-major) times the transpose of b (2x8): [a0.b0, a0.b1, a1.b0, a1.b1]."""
    return (f'{out} = llvm.call_intrinsic "llvm.aarch64.neon.smmla.v4i32.v16i8"({acc}, {a}, {b}) '
            f": ({_ACC}, {_V}, {_V}) -> {_ACC}")


@dataclass(frozen=True)
class NeonI8mm(NeonDotprod):
    """The prefill GEMM on `smmla` (its dot products, for shapes it leaves to them, are sdot's)."""

    @property
    def row_pairs(self) -> bool:
        return True

    def gemm_executable(self, s) -> str:
        return gemm_executable(s)


NEON_I8MM = NeonI8mm(forms.NEON_I8MM, 16, "smmla", False)


def _group_step(s) -> list[str]:
    """One group (%gl) of the register block: its 2 x 2 int32 sums, then scaled into the float sums."""
    from ..int8_gemm import _per_group_memref, _scales_memref, _xq_memref

    g, P, C = s.group, ROW_PAIRS, CHANNEL_PAIRS
    w_t = f"memref<{s.tile_channels}x{s.chunk // 4}xi32>"
    blocks = g // 8
    lines = ["%gi = arith.addi %g0, %gl : index",
             "%wq0 = arith.muli %gl, %nq : index",  # the group's first quad in %w
             f"%kb0 = arith.muli %gi, %c{blocks}b : index"]  # its first k block in %xq
    acc = {(p, c): "%zq" for p in range(P) for c in range(C)}
    for b in range(blocks):
        lines += [f"%kb{b}_ = arith.addi %kb0, %cb{b} : index",
                  f"%wk{b} = arith.addi %wq0, %c2x{b} : index"]
        for p in range(P):
            lines.append(f"%a{b}_{p} = vector.load %xq[%kb{b}_, %rc{p}] : {_xq_memref(s)}, {_V}")
        for c in range(C):
            for h in range(2):
                lines += [f"%w{b}_{c}_{h} = vector.load %w[%jc{2 * c + h}, %wk{b}] : {w_t}, vector<2xi32>",
                          f"%w8{b}_{c}_{h} = vector.bitcast %w{b}_{c}_{h} : vector<2xi32> to vector<8xi8>"]
            lines.append(f"%b{b}_{c} = vector.shuffle %w8{b}_{c}_0, %w8{b}_{c}_1 {list(range(16))} "
                         ": vector<8xi8>, vector<8xi8>")
        for p in range(P):
            for c in range(C):
                new = f"%i{b}_{p}_{c}"
                lines.append(smmla(new, acc[p, c], f"%a{b}_{p}", f"%b{b}_{c}"))
                acc[p, c] = new
    for p in range(P):
        for what, ref in (("dx", "%dx"), ("cg", "%cg")) if s.has_min else (("dx", "%dx"),):
            lines += [f"%{what}2_{p} = vector.load {ref}[%gi, %mr{p}] : {_per_group_memref(s, 'f32')}, vector<2xf32>",
                      f"%{what}4_{p} = vector.shuffle %{what}2_{p}, %{what}2_{p} [0, 0, 1, 1] "
                      ": vector<2xf32>, vector<2xf32>"]
    for c in range(C):
        for what, ref in (("s", "%scales"), ("mn", "%mins")) if s.has_min else (("s", "%scales"),):
            values = []
            for h in range(2):
                lines.append(f"%{what}{c}_{h} = memref.load {ref}[%nc{2 * c + h}, %gi] : {_scales_memref(s)}")
                value = f"%{what}{c}_{h}"
                if s.scale_type == "f16":
                    lines.append(f"%{what}f{c}_{h} = arith.extf %{what}{c}_{h} : f16 to f32")
                    value = f"%{what}f{c}_{h}"
                values.append(value)
            lines.append(f"%{what}4_{c} = vector.from_elements {values[0]}, {values[1]}, {values[0]}, {values[1]} "
                         ": vector<4xf32>")
    out = []
    for p in range(P):
        for c in range(C):
            i = p * C + c
            lines += [f"%df{p}_{c} = arith.sitofp {acc[p, c]} : {_ACC} to vector<4xf32>",
                      f"%sx{p}_{c} = arith.mulf %dx4_{p}, %s4_{c} : vector<4xf32>",
                      f"%f{p}_{c} = math.fma %df{p}_{c}, %sx{p}_{c}, %acc{i} : vector<4xf32>"]
            if s.has_min:
                lines.append(f"%fm{p}_{c} = math.fma %cg4_{p}, %mn4_{c}, %f{p}_{c} : vector<4xf32>")
            out.append(f"%fm{p}_{c}" if s.has_min else f"%f{p}_{c}")
    lines.append(f"scf.yield {', '.join(out)} : {', '.join(['vector<4xf32>'] * len(out))}")
    return lines


def gemm_executable(s) -> str:
    """y [M, N] from the row-paired activations and the codes: a workgroup owns NT channels, their float
    sums held in an [M, NT] stack tile between K chunks, written to y row by row at the end."""
    from ..int8_gemm import _unpack_codes, gemm_bindings, gemm_prologue, supports
    from ..mlir import stream_executable

    if not supports(s) or s.m % (2 * ROW_PAIRS) or s.tile_channels % (2 * CHANNEL_PAIRS):
        raise ValueError(f"no i8mm GEMM kernel for {s}")
    P, C, nt, g = ROW_PAIRS, CHANNEL_PAIRS, s.tile_channels, s.group
    y_t, yt_t = f"memref<{s.m}x{s.n}xf32>", f"memref<{s.m}x{nt}xf32>"
    n_acc = P * C
    acc_types = ", ".join(["vector<4xf32>"] * n_acc)
    blocks = g // 8
    body = [
        *gemm_prologue(s),
        f"%c{blocks}b = arith.constant {blocks} : index",
        f"%zq = arith.constant dense<0> : {_ACC}",
        "%zf = arith.constant dense<0.0> : vector<2xf32>",
        f"%cM = arith.constant {s.m} : index",
        f"%cMB = arith.constant {2 * P} : index",
        f"%cCB = arith.constant {2 * C} : index",
        "%c2 = arith.constant 2 : index",
        "%c8 = arith.constant 8 : index",
        *[f"%cb{b} = arith.constant {b} : index" for b in range(blocks)],
        *[f"%c2x{b} = arith.constant {2 * b} : index" for b in range(blocks)],
        *[f"%cp{p} = arith.constant {2 * p} : index" for p in range(P)],
        *[f"%cj{j} = arith.constant {j} : index" for j in range(2 * C)],
        f"%yt = memref.alloca() : {yt_t}",
        "scf.for %mz = %c0 to %cM step %c1 {",
        "  scf.for %tz = %c0 to %ntile step %c2 {",
        f"    vector.store %zf, %yt[%mz, %tz] : {yt_t}, vector<2xf32>",
        "  }",
        "}",
        "scf.for %g0 = %c0 to %nG step %nGc {",
        *[f"  {line}" for line in _unpack_codes(s)],
        "  scf.for %mb = %c0 to %cM step %cMB {",
        *[f"    %mr{p} = arith.addi %mb, %cp{p} : index" for p in range(P)],
        *[f"    %mq{p} = arith.addi %mr{p}, %c1 : index" for p in range(P)],
        *[f"    %rc{p} = arith.muli %mr{p}, %c8 : index" for p in range(P)],
        "    scf.for %jb = %c0 to %ntile step %cCB {",
        *[f"      %jc{j} = arith.addi %jb, %cj{j} : index" for j in range(2 * C)],
        *[f"      %nc{j} = arith.addi %n0, %jc{j} : index" for j in range(2 * C)],
        *[line for p in range(P) for c in range(C) for line in (
            f"      %lo{p}_{c} = vector.load %yt[%mr{p}, %jc{2 * c}] : {yt_t}, vector<2xf32>",
            f"      %hi{p}_{c} = vector.load %yt[%mq{p}, %jc{2 * c}] : {yt_t}, vector<2xf32>",
            f"      %y{p * C + c} = vector.shuffle %lo{p}_{c}, %hi{p}_{c} [0, 1, 2, 3] : vector<2xf32>, vector<2xf32>")],
        f"      %res:{n_acc} = scf.for %gl = %c0 to %nGc step %c1 "
        f"iter_args({', '.join(f'%acc{i} = %y{i}' for i in range(n_acc))}) -> ({acc_types}) {{",
        *[f"        {line}" for line in _group_step(s)],
        "      }",
        *[line for p in range(P) for c in range(C) for line in (
            f"      %sl{p}_{c} = vector.shuffle %res#{p * C + c}, %res#{p * C + c} [0, 1] "
            ": vector<4xf32>, vector<4xf32>",
            f"      %sh{p}_{c} = vector.shuffle %res#{p * C + c}, %res#{p * C + c} [2, 3] "
            ": vector<4xf32>, vector<4xf32>",
            f"      vector.store %sl{p}_{c}, %yt[%mr{p}, %jc{2 * c}] : {yt_t}, vector<2xf32>",
            f"      vector.store %sh{p}_{c}, %yt[%mq{p}, %jc{2 * c}] : {yt_t}, vector<2xf32>")],
        "    }",
        "  }",
        "}",
        "scf.for %mo = %c0 to %cM step %c1 {",
        f"  %row = vector.load %yt[%mo, %c0] : {yt_t}, vector<{nt}xf32>",
        f"  vector.store %row, %y[%mo, %n0] : {y_t}, vector<{nt}xf32>",
        "}",
    ]
    return stream_executable(s.name, s.n // nt, gemm_bindings(s), body)
