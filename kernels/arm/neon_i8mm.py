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
  (int8_gemm.unpack_codes: q4 and q5 codes 0..31 are signed bytes as they
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
from ..builder import Builder, Value, stream_executable
from ..int8_gemm import (
    GemmOperands,
    Int8GemmShape,
    gemm_bindings,
    gemm_prologue,
    supports,
    unpack_codes,
)
from ..isa import zero_lanes
from .neon_dotprod import NeonDotprod

ROW_PAIRS = 4  # row pairs per register block: 8 rows
CHANNEL_PAIRS = 2  # channel pairs per register block: 4 channels


def smmla(b: Builder, acc: Value, x: Value, y: Value) -> Value:
    """`acc` + x (2x8 signed bytes, row-major) times the transpose of y (2x8): [x0.y0, x0.y1, x1.y0, x1.y1]."""
    return b.intrinsic("llvm.aarch64.neon.smmla.v4i32.v16i8", b.vector(4, "i32"), acc, x, y)


@dataclass(frozen=True)
class NeonI8mm(NeonDotprod):
    """The prefill GEMM on `smmla` (its dot products, for shapes it leaves to them, are sdot's)."""

    @property
    def row_pairs(self) -> bool:
        return True

    def gemm_executable(self, shape: Int8GemmShape) -> str:
        return gemm_executable(shape)


NEON_I8MM = NeonI8mm(forms.NEON_I8MM, 16, "smmla", False)


@dataclass
class _Block:
    """One register block's indices: its row pairs' first rows (mr) and byte columns (rc), its channels in
    the tile (jc) and in y (nc)."""

    mr: list[Value]
    rc: list[Value]
    jc: list[Value]
    nc: list[Value]


@dataclass
class _Constants:
    blocks: Value  # k blocks of 8 per group
    block: list[Value]  # 0, 1, ... per k block of a group
    block_quads: list[Value]  # 0, 2, ...: each k block's first quad in w


def _group_step(b: Builder, s: Int8GemmShape, o: GemmOperands, g0: Value, k: _Constants, at: _Block, gl: Value,
                acc_in: list[Value]) -> list[Value]:
    """One group (gl) of the register block: its 2 x 2 int32 sums, then scaled into the float sums."""
    P, C = ROW_PAIRS, CHANNEL_PAIRS
    v4f = b.vector(4, "f32")
    gi = b.addi(g0, gl)
    wq0 = b.muli(gl, o.n_q)  # the group's first quad in w
    kb0 = b.muli(gi, k.blocks)  # its first k block in xq
    acc = {(p, c): zero_lanes(b, 4) for p in range(P) for c in range(C)}
    for i in range(s.group // 8):
        kb, wk = b.addi(kb0, k.block[i]), b.addi(wq0, k.block_quads[i])
        rows = [b.load(b.vector(16, "i8"), o.xq, [kb, at.rc[p]]) for p in range(P)]
        columns = []
        for c in range(C):
            halves = [b.vbitcast(b.load(b.vector(2, "i32"), o.w, [at.jc[2 * c + h], wk]), b.vector(8, "i8"))
                      for h in range(2)]
            columns.append(b.shuffle(halves[0], halves[1], list(range(16))))
        for p in range(P):
            for c in range(C):
                acc[p, c] = smmla(b, acc[p, c], rows[p], columns[c])
    per_row: dict[tuple[str, int], Value] = {}
    for p in range(P):
        for what, ref in (("dx", o.dx), ("cg", o.cg)) if s.has_min else (("dx", o.dx),):
            pair = b.load(b.vector(2, "f32"), ref, [gi, at.mr[p]])
            per_row[what, p] = b.shuffle(pair, pair, [0, 0, 1, 1])
    per_channel: dict[tuple[str, int], Value] = {}
    for c in range(C):
        for what, ref in (("s", o.scales), ("mn", o.mins)) if s.has_min else (("s", o.scales),):
            values = []
            for h in range(2):
                value = b.load_scalar(ref, [at.nc[2 * c + h], gi])
                values.append(b.extf(value, b.element("f32")) if s.scale_type == "f16" else value)
            per_channel[what, c] = b.from_elements(v4f, [values[0], values[1], values[0], values[1]])
    out = []
    for p in range(P):
        for c in range(C):
            total = b.fma(b.sitofp(acc[p, c], v4f), b.mulf(per_row["dx", p], per_channel["s", c]), acc_in[p * C + c])
            if s.has_min:
                total = b.fma(per_row["cg", p], per_channel["mn", c], total)
            out.append(total)
    return out


def gemm_executable(s: Int8GemmShape) -> str:
    """y [M, N] from the row-paired activations and the codes: a workgroup owns NT channels, their float
    sums held in an [M, NT] stack tile between K chunks, written to y row by row at the end."""
    if not supports(s) or s.m % (2 * ROW_PAIRS) or s.tile_channels % (2 * CHANNEL_PAIRS):
        raise ValueError(f"no i8mm GEMM kernel for {s}")
    P, C, nt = ROW_PAIRS, CHANNEL_PAIRS, s.tile_channels
    blocks = s.group // 8

    def body(b: Builder, args: list[Value]) -> None:
        o = gemm_prologue(b, s, args)
        n_blocks = b.index(blocks)
        zero_lanes(b, 4)
        v2f = b.vector(2, "f32")
        zf = b.const(0.0, v2f)
        c_m, c_mb, c_cb, c2, c8 = b.index(s.m), b.index(2 * P), b.index(2 * C), b.index(2), b.index(8)
        k = _Constants(n_blocks, [b.index(i) for i in range(blocks)], [b.index(2 * i) for i in range(blocks)])
        pair_rows = [b.index(2 * p) for p in range(P)]
        channels = [b.index(j) for j in range(2 * C)]
        yt = b.alloca(b.memref((s.m, nt), "f32"))

        def zero_row(mz: Value) -> None:
            b.loop(o.c0, o.n_tile, c2, lambda tz: b.store(zf, yt, [mz, tz]))

        b.loop(o.c0, c_m, o.c1, zero_row)

        def chunk(g0: Value) -> None:
            unpack_codes(b, s, o, g0)

            def row_block(mb: Value) -> None:
                mr = [b.addi(mb, pair_rows[p]) for p in range(P)]
                mq = [b.addi(mr[p], o.c1) for p in range(P)]
                rc = [b.muli(mr[p], c8) for p in range(P)]

                def channel_block(jb: Value) -> None:
                    jc = [b.addi(jb, channels[j]) for j in range(2 * C)]
                    at = _Block(mr, rc, jc, [b.addi(o.n0, jc[j]) for j in range(2 * C)])
                    sums = []
                    for p in range(P):
                        for c in range(C):
                            lo, hi = b.load(v2f, yt, [mr[p], jc[2 * c]]), b.load(v2f, yt, [mq[p], jc[2 * c]])
                            sums.append(b.shuffle(lo, hi, [0, 1, 2, 3]))
                    sums = b.loop(o.c0, o.n_chunk_groups, o.c1,
                                  lambda gl, *acc: _group_step(b, s, o, g0, k, at, gl, list(acc)), sums)
                    for p in range(P):
                        for c in range(C):
                            total = sums[p * C + c]
                            low, high = b.shuffle(total, total, [0, 1]), b.shuffle(total, total, [2, 3])
                            b.store(low, yt, [mr[p], jc[2 * c]])
                            b.store(high, yt, [mq[p], jc[2 * c]])

                b.loop(o.c0, o.n_tile, c_cb, channel_block)

            b.loop(o.c0, c_m, c_mb, row_block)

        b.loop(o.c0, o.n_groups, o.n_chunk_groups, chunk)

        def write_row(mo: Value) -> None:
            b.store(b.load(b.vector(nt, "f32"), yt, [mo, o.c0]), o.y, [mo, o.n0])

        b.loop(o.c0, c_m, o.c1, write_row)

    return stream_executable(s.name, s.n // nt, gemm_bindings(s), body)
