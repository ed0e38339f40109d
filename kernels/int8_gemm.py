"""Prefill kernels for x86 CPUs with VNNI or AVX2: a chunk of int8 activations against the narrow codes.

A prefill chunk (M rows, M a multiple of 16) otherwise dequantizes each weight
to a float tile and runs IREE's float32 matmul, which is compute-bound there
(docs/history.md, "Where the time goes, and what is next"). `vpdpbusd` does 64
byte products per instruction against the 16 of a float32 FMA. The decode
kernel's layout (the 64 codes of one output row against 64 activations,
reduced across lanes per group) needs a float scale, a multiply and a
conversion per 64 products, as many vector instructions per product as
float32. This kernel turns the product around: the 16 lanes of a vector are 16
activation rows, each lane holding the four int8 activations k..k+3 of its
row, and one output channel's four codes are broadcast across the lanes. Each
`vpdpbusd` then adds 4 products to 16 independent int32 sums, and an int32 sum
lives for a whole group of codes (8 instructions for a group of 32) before it
is scaled once:

    y[m, n] = sum_g s[n, g] dx[m, g] sum_k q[n, g, k] xq[m, g, k]   (+ m[n, g] dx[m, g] sum_k xq[m, g, k])

Two dispatches per call:

- `quantize`: each activation row to int8 per weight group (int8_decode's
  quantize_group, identical to the decode kernel's), written in the
  interleaved layout [K/4][M][4] (16 rows' four bytes per 64-byte vector),
  with each group's scale dx, dx * sum xq (for mins) and -128 * sum xq (for
  signed codes);
- `gemm`: each workgroup takes NT output channels, unpacks their codes once
  into a stack tile of unsigned bytes in k order (q4: the two nibbles; q8:
  code + 128, whose extra 128 * sum xq the int32 sum starts without), then
  runs 2 x 4 blocks (32 rows, 4 channels: 8 int32 and 8 float accumulators in
  registers) over every group, and writes its [NT, M] sums into y [M, N]
  transposed in registers (a transpose as a separate op, fused into the
  next elementwise dispatch, was slow in IREE: docs/quantization.md).

The dot product is the shape's ISA form (kernels/isa.py): with VNNI (512- or
256-bit) the unpacked codes are unsigned bytes against the activations, q8
codes offset by 128 as above; AVX2's int16 step would saturate on 255 * 127
pairs, so its q8 codes stay signed and take the form's signed product (|q|
against the activation with q's sign), with no offset. A form on 256-bit
registers holds one row vector per block (its 16 lanes are two registers).

Activations keep 8 bits per group, as in decode and as llama.cpp's Q8 rows:
the same lossy path and bounds (docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.block_formats import codes_dims
from .builder import Builder, Value, stream_executable
from .int8_decode import fifth_bit_constants, fifth_bits, quantize_group
from .isa import Int8Isa
from .mlir import as_tensor, memref_type
from .template import instantiate
from .x86 import AVX512_VNNI

ROW_VECTORS = 2  # row vectors of 16 per register block (on 512-bit registers)
MAX_CODE = {"q4": 15, "q5": 31, "q8": 255}  # the largest unsigned byte the unpacked codes of a format hold
CHANNELS = 4  # output channels per register block
MAX_TILE_CHANNELS = 32
STACK_BYTES = 24576  # a workgroup's float tile and unpacked codes (IREE's stack limit is 32 KiB)
# Codes per K chunk: a chunk's activations for one row block (32 x 256 bytes) and its unpacked codes
# (32 x 256) stay in L1 while every channel block runs over them.
MAX_CHUNK = 256
# Activation rows per quantize workgroup: a k block of 16 rows fills one 64-byte line of the layout, so
# no two workgroups (threads) write into the same line. supports() makes M a multiple of 16.
QUANTIZE_ROWS = 16


@dataclass(frozen=True)
class Int8GemmShape:
    """What shapes one kernel: codes format, group, scale dtype, mins, M (rows), K, N."""

    fmt: str  # "q4", "q5" or "q8"
    group: int
    scale_type: str  # "f16" or "f32"
    has_min: bool
    m: int
    k: int
    n: int
    isa: Int8Isa = AVX512_VNNI  # the form of the dot product (not in the name: a module holds one ISA's kernels)

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def signed_codes(self) -> bool:
        """q8 codes met signed: the form's unsigned product would saturate on codes offset by 128 (AVX2)."""
        return self.fmt == "q8" and not self.isa.unsigned_bytes_exact

    @property
    def row_vectors(self) -> int:
        wide = self.isa.zmm and self.m % (16 * ROW_VECTORS) == 0
        return ROW_VECTORS if wide else 1

    @property
    def tile_channels(self) -> int:
        """Channels per workgroup: MAX_TILE_CHANNELS or fewer dividing N whose stack tiles fit, halved
        while the workgroup count is odd (two threads share it evenly) and above CHANNELS."""
        nt = MAX_TILE_CHANNELS
        while nt > CHANNELS and (self.n % nt or self.stack_bytes(nt) > STACK_BYTES):
            nt //= 2
        while nt > CHANNELS and (self.n // nt) % 2:
            nt //= 2
        return nt

    def stack_bytes(self, channels: int) -> int:
        """Stack a workgroup of `channels` channels takes: its float sums [NT, M] and unpacked codes."""
        return channels * (4 * self.m + self.chunk)

    @property
    def chunk(self) -> int:
        """Codes per K chunk: the largest multiple of the group dividing K, at most MAX_CHUNK."""
        return max(c for c in range(self.group, min(self.k, MAX_CHUNK) + 1, self.group) if self.k % c == 0)

    @property
    def name(self) -> str:
        return (f"foldline_i8gemm_{self.fmt}g{self.group}{self.scale_type}{'m' if self.has_min else ''}"
                f"_m{self.m}_k{self.k}_n{self.n}")

    @property
    def quantize_name(self) -> str:
        return f"foldline_i8quant_g{self.group}_m{self.m}_k{self.k}"


def supports(s: Int8GemmShape) -> bool:
    """Whether these kernels take this shape: whole row vectors, whole channel blocks, a tile that fits."""
    return (s.fmt in ("q4", "q5", "q8") and s.group in (16, 32, 64) and s.k % s.group == 0 and s.m % 16 == 0
            and s.n % CHANNELS == 0 and s.scale_type in ("f16", "f32") and (s.fmt == "q8" or s.has_min)
            and s.n % s.tile_channels == 0 and s.stack_bytes(s.tile_channels) <= STACK_BYTES)


def _row_bytes(s: Int8GemmShape) -> int:
    """Bytes of one row per k block of the quantized activations: 4 (16 rows' four bytes per 64-byte
    vector), or 8 beside its pair's where the form reads rows in pairs ([K/8][M/2][2][8])."""
    return 8 if s.isa.row_pairs else 4


def _xq_memref(s: Int8GemmShape) -> str:
    """[K/w][w M]: row r's w bytes of k block b at [b, w r]."""
    w = _row_bytes(s)
    return f"memref<{s.k // w}x{w * s.m}xi8>"


def _per_group_memref(s: Int8GemmShape, element: str) -> str:
    return f"memref<{s.groups}x{s.m}x{element}>"


def _xq_type(b: Builder, s: Int8GemmShape):
    w = _row_bytes(s)
    return b.memref((s.k // w, w * s.m), "i8")


def _per_group_type(b: Builder, s: Int8GemmShape, element: str):
    return b.memref((s.groups, s.m), element)


def _codes_memref(s: Int8GemmShape) -> str:
    return memref_type(codes_dims(s.fmt, s.n, s.k), "i8")


def _scales_memref(s: Int8GemmShape) -> str:
    return memref_type((s.n, s.groups), s.scale_type)



def quantize_executable(s: Int8GemmShape) -> str:
    """Int8 codes per group in the interleaved layout of _xq_memref, QUANTIZE_ROWS rows per workgroup.

    A k block of 16 rows shares one 64-byte line of the layout (and of the per-group sums): with one
    row per workgroup the two threads wrote into the same lines, and each row cost several times its
    arithmetic. Groups are the outer loop, so a group's 16 rows fill their
    lines one after the other; row by row, a 2048-wide row touched ~900 lines, more than L1 holds
    (docs/quantization.md, "Prefill chunks").
    """
    g, width = s.group, _row_bytes(s)

    def body(b: Builder, args: list[Value]) -> None:
        c0, c1 = b.index(0), b.index(1)
        quads = [b.index(q) for q in range(g // 4)]
        x = b.subspan(args[0], c0, b.memref((s.m, s.k), "f32"))
        xq = b.subspan(args[1], c0, _xq_type(b, s))
        dx, cg, ofs = (b.subspan(a, c0, _per_group_type(b, s, t)) for a, t in zip(args[2:], ("f32", "f32", "i32")))
        workgroup = b.workgroup_id()
        n_rows = b.index(QUANTIZE_ROWS)
        first = b.muli(workgroup, n_rows)
        end = b.addi(first, n_rows)
        c_width, n_groups, n_g, n_q = b.index(width), b.index(s.groups), b.index(g), b.index(g // width)
        f0, f127 = b.const(0.0, "f32"), b.const(127.0, "f32")
        minus_128 = b.const(-128, "i32")

        def group(gi: Value) -> None:
            off, q0 = b.muli(gi, n_g), b.muli(gi, n_q)

            def row(r: Value) -> None:
                column = b.muli(r, c_width)
                q = quantize_group(b, b.load(b.vector(g, "f32"), x, [r, off]), f0, f127)
                for i in range(g // width):
                    piece = b.shuffle(q.codes, q.codes, list(range(width * i, width * i + width)))
                    b.store(piece, xq, [b.addi(q0, quads[i]), column])
                b.store_scalar(q.scale, dx, [gi, r])
                b.store_scalar(b.mulf(b.sitofp(q.code_sum, b.element("f32")), q.scale), cg, [gi, r])
                b.store_scalar(b.muli(q.code_sum, minus_128), ofs, [gi, r])

            b.loop(first, end, c1, row)

        b.loop(c0, n_groups, c1, group)

    return stream_executable(s.quantize_name, s.m // QUANTIZE_ROWS, 5, body)


@dataclass
class GemmOperands:
    """What every GEMM form opens with (`gemm_prologue`): its bindings' memrefs, the workgroup's first
    channel n0, the stack tile w [NT, chunk/4] of unpacked codes, the counts `unpack_codes` reads."""

    c0: Value
    c1: Value
    xq: Value  # the quantized activations (_xq_memref)
    dx: Value  # each row's scale per group
    cg: Value  # dx * sum xq per group and row
    ofs: Value  # -128 * sum xq per group and row
    codes: Value
    scales: Value
    mins: Value | None
    y: Value
    n_tile: Value  # channels per workgroup
    n0: Value
    w: Value
    n_q: Value  # quads (4 codes) per group
    n_chunk_groups: Value
    n_groups: Value


def gemm_prologue(b: Builder, s: Int8GemmShape, args: list[Value]) -> GemmOperands:
    """The ops every GEMM form opens with, on its bindings: the quantize dispatch's four results, codes,
    scales, mins, y."""
    c0, c1 = b.index(0), b.index(1)
    per_f32 = _per_group_type(b, s, "f32")
    arg = iter(args)
    xq, dx, cg = b.subspan(next(arg), c0, _xq_type(b, s)), b.subspan(next(arg), c0, per_f32), b.subspan(
        next(arg), c0, per_f32)
    ofs = b.subspan(next(arg), c0, _per_group_type(b, s, "i32"))
    codes = b.subspan(next(arg), c0, b.memref(codes_dims(s.fmt, s.n, s.k), "i8"))
    scales_t = b.memref((s.n, s.groups), s.scale_type)
    scales = b.subspan(next(arg), c0, scales_t)
    mins = b.subspan(next(arg), c0, scales_t) if s.has_min else None
    y = b.subspan(next(arg), c0, b.memref((s.m, s.n), "f32"))
    workgroup = b.workgroup_id()
    n_tile = b.index(s.tile_channels)
    n0 = b.muli(workgroup, n_tile)
    w = b.alloca(b.memref((s.tile_channels, s.chunk // 4), "i32"))
    o = GemmOperands(c0, c1, xq, dx, cg, ofs, codes, scales, mins, y, n_tile, n0, w, b.index(s.group // 4),
                     b.index(s.chunk // s.group), b.index(s.groups))
    if s.fmt == "q5":
        fifth_bit_constants(b, s.group, s.isa.bit_vectors)
    return o


def gemm_bindings(s: Int8GemmShape) -> int:
    """The GEMM executable's bindings: the quantize dispatch's four results, codes, scales, mins, y."""
    return 7 + s.has_min


def unpack_codes(b: Builder, s: Int8GemmShape, o: GemmOperands, g0: Value) -> None:
    """Fill o.w [NT, chunk/4] i32 with the chunk's codes (groups from g0) as unsigned bytes in k order."""
    g = s.group

    def channel(t: Value) -> None:
        cn = b.addi(o.n0, t)

        def group(gl: Value) -> None:
            gi = b.addi(g0, gl)
            q0 = b.muli(gl, o.n_q)
            words = b.vector(g // 4, "i32")
            if s.fmt in ("q4", "q5"):  # a group's g/2 bytes: byte b holds code b (low nibble) and b + g/2 (high)
                half = g // 2
                vh = b.vector(half, "i8")
                packed = b.load(vh, o.codes, [cn, b.muli(gi, b.index(half))])
                m15, s4 = b.const(15, vh), b.const(4, vh)
                lo, hi = b.andi(packed, m15), b.shrui(packed, s4)
                if s.fmt == "q5":  # the group's g codes in k order with their fifth bits (g/8 bytes after the nibbles)
                    f_base, n_f = b.index(s.k // 2), b.index(g // 8)
                    f_off = b.addi(f_base, b.muli(gi, n_f))
                    fifth = fifth_bits(b, b.load(b.vector(g // 8, "i8"), o.codes, [cn, f_off]), g,
                                       s.isa.bit_vectors)
                    q5 = b.ori(b.shuffle(lo, hi, list(range(g))), fifth)
                    b.store(b.vbitcast(q5, words), o.w, [t, q0])
                else:
                    half_words = b.vector(g // 8, "i32")
                    lo32, hi32 = b.vbitcast(lo, half_words), b.vbitcast(hi, half_words)
                    q1 = b.addi(q0, b.index(g // 8))
                    b.store(lo32, o.w, [t, q0])
                    b.store(hi32, o.w, [t, q1])
                return
            packed = b.load(b.vector(g, "i8"), o.codes, [cn, b.muli(gi, b.index(g))])
            if not s.signed_codes:  # signed codes + 128 as unsigned bytes (else met by the form's signed product)
                packed = b.xori(packed, b.const(-128, b.vector(g, "i8")))
            b.store(b.vbitcast(packed, words), o.w, [t, q0])

        b.loop(o.c0, o.n_chunk_groups, o.c1, group)

    b.loop(o.c0, o.n_tile, o.c1, channel)


@dataclass
class _Block:
    """One register block's indices: its row vectors' rows (mr) and byte columns (mb4), its channels in the
    tile (jc) and in y (nc)."""

    mr: list[Value]
    mb4: list[Value]
    jc: list[Value]
    nc: list[Value]


def _group_step(b: Builder, s: Int8GemmShape, o: GemmOperands, g0: Value, quads: list[Value], at: _Block,
                gl: Value, acc_in: list[Value]) -> list[Value]:
    """One group (gl) of the register block: its int32 sums, then scaled into the float sums `acc_in`."""
    R, J, g = s.row_vectors, CHANNELS, s.group
    gi = b.addi(g0, gl)
    q0 = b.muli(gi, o.n_q)  # quads: global in the activations, chunk-local in w
    wq0 = b.muli(gl, o.n_q)
    offset = s.fmt == "q8" and not s.signed_codes  # codes + 128: the sum starts at -128 * sum xq
    v16i, v16f = b.vector(16, "i32"), b.vector(16, "f32")
    init = [b.load(v16i, o.ofs, [gi, at.mr[r]]) if offset else None for r in range(R)]
    acc = {(r, j): init[r] for r in range(R) for j in range(J)}
    a, wb = {}, {}
    for q in range(g // 4):
        kq, wk = b.addi(q0, quads[q]), b.addi(wq0, quads[q])
        for r in range(R):
            a[q, r] = b.load(b.vector(64, "i8"), o.xq, [kq, at.mb4[r]])
        for j in range(J):
            word = b.broadcast(b.load_scalar(o.w, [at.jc[j], wk]), v16i)
            wb[q, j] = b.vbitcast(word, b.vector(64, "i8"))
    # Products per sum: several where the form adds them narrow before widening (AVX2's int16, q4/q5 codes).
    per = 1 if s.signed_codes else s.isa.unsigned_products_per_sum(MAX_CODE[s.fmt])
    for j in range(J):
        for r in range(R):
            for first in range(0, g // 4, per):
                if s.signed_codes:
                    acc[r, j] = s.isa.dot_signed(b, acc[r, j], a[first, r], wb[first, j])
                else:
                    pairs = [(wb[q, j], a[q, r]) for q in range(first, min(first + per, g // 4))]
                    acc[r, j] = s.isa.dot_unsigned_sum(b, acc[r, j], pairs)
    dxv = {}
    cgv = {}
    for r in range(R):
        dxv[r] = b.load(v16f, o.dx, [gi, at.mr[r]])
        if s.has_min:
            cgv[r] = b.load(v16f, o.cg, [gi, at.mr[r]])
    out: dict[int, Value] = {}  # accumulator index (r * J + j) -> its value after this group
    for j in range(J):
        per_channel = {}
        for what, ref in (("s", o.scales), ("mn", o.mins)) if s.has_min else (("s", o.scales),):
            value = b.load_scalar(ref, [at.nc[j], gi])
            if s.scale_type == "f16":
                value = b.extf(value, b.element("f32"))
            per_channel[what] = b.broadcast(value, v16f)
        for r in range(R):
            i = r * J + j
            total = b.fma(b.sitofp(acc[r, j], v16f), b.mulf(dxv[r], per_channel["s"]), acc_in[i])
            if s.has_min:
                total = b.fma(cgv[r], per_channel["mn"], total)
            out[i] = total
    return [out[i] for i in range(R * J)]


def gemm_executable(s: Int8GemmShape) -> str:
    """The `stream.executable` computing y [M, N] from the quantized activations and the codes.

    A workgroup owns NT channels, their float sums held in a [NT, M] stack tile between K chunks. For
    each chunk of K it unpacks its channels' codes, then runs every (row block, channel block) over the
    chunk; at the end it writes the tile to y transposed, 16 x 16 blocks at a time.
    """
    if s.isa.row_pairs:
        return s.isa.gemm_executable(s)
    if not supports(s):
        raise ValueError(f"no int8 GEMM kernel for {s}")
    R, J, nt, g = s.row_vectors, CHANNELS, s.tile_channels, s.group
    tb = min(nt, 16)

    def body(b: Builder, args: list[Value]) -> None:
        o = gemm_prologue(b, s, args)
        s.isa.constants(b)
        v16f = b.vector(16, "f32")
        zf = b.const(0.0, v16f)
        c_j, c_m, c_mr, c4, c16 = b.index(J), b.index(s.m), b.index(16 * R), b.index(4), b.index(16)
        quads = [b.index(q) for q in range(g // 4)]
        row_starts = [b.index(16 * r) for r in range(R)]
        channels = [b.index(j) for j in range(J)]
        # the tile's float sums, [NT, M], live on the stack between K chunks
        yt = b.alloca(b.memref((nt, s.m), "f32"))

        def zero_channel(t: Value) -> None:
            b.loop(o.c0, c_m, c16, lambda mz: b.store(zf, yt, [t, mz]))

        b.loop(o.c0, o.n_tile, o.c1, zero_channel)

        def chunk(g0: Value) -> None:
            unpack_codes(b, s, o, g0)

            def row_block(mb: Value) -> None:
                mr = [b.addi(mb, row_starts[r]) for r in range(R)]
                mb4 = [b.muli(mr[r], c4) for r in range(R)]

                def channel_block(jb: Value) -> None:
                    jc = [b.addi(jb, channels[j]) for j in range(J)]
                    at = _Block(mr, mb4, jc, [b.addi(o.n0, jc[j]) for j in range(J)])
                    sums = [b.load(v16f, yt, [jc[j], mr[r]]) for r in range(R) for j in range(J)]
                    sums = b.loop(o.c0, o.n_chunk_groups, o.c1,
                                  lambda gl, *acc: _group_step(b, s, o, g0, quads, at, gl, list(acc)), sums)
                    for r in range(R):
                        for j in range(J):
                            b.store(sums[r * J + j], yt, [jc[j], mr[r]])

                b.loop(o.c0, o.n_tile, c_j, channel_block)

            b.loop(o.c0, c_m, c_mr, row_block)

        b.loop(o.c0, o.n_groups, o.n_chunk_groups, chunk)
        # y [M, N]: the tile transposed in blocks of (up to) 16 channels x 16 rows
        c_t = b.index(tb)
        zero_block = b.const(0.0, b.vector2d(tb, 16, "f32"))
        lanes = [b.index(i) for i in range(16)]

        def transpose_block(t0: Value) -> None:
            nb = b.addi(o.n0, t0)

            def rows(mz: Value) -> None:
                block = zero_block
                for i in range(tb):
                    block = b.insert(b.load(v16f, yt, [b.addi(t0, lanes[i]), mz]), block, i)
                transposed = b.transpose(block, [1, 0])
                for i in range(16):
                    b.store(b.extract(transposed, i), o.y, [b.addi(mz, lanes[i]), nb])

            b.loop(o.c0, c_m, c16, rows)

        b.loop(o.c0, o.n_tile, c_t, transpose_block)

    return stream_executable(s.name, s.n // nt, gemm_bindings(s), body)


def int8_gemm_dispatches(s: Int8GemmShape, x: str, codes: str, scales: str, mins: str | None,
                         result: str) -> list[str]:
    """Lines computing `result` (tensor<M x N x f32>) from x (tensor<M x K x f32>)."""
    per_f, per_i = as_tensor(_per_group_memref(s, "f32")), as_tensor(_per_group_memref(s, "i32"))
    xq_t = as_tensor(_xq_memref(s))
    q = f"{result}_q"
    operands = [f"{q}#0", f"{q}#1", f"{q}#2", f"{q}#3", codes, scales] + ([mins] if s.has_min else [])
    types = [xq_t, per_f, per_f, per_i, as_tensor(_codes_memref(s)), as_tensor(_scales_memref(s))]
    types += [as_tensor(_scales_memref(s))] if s.has_min else []
    return [instantiate("flow_dispatch", result=q, name=s.quantize_name, operands=[x], types=[f"tensor<{s.m}x{s.k}xf32>"],
                        result_types=[xq_t, per_f, per_f, per_i]),
            instantiate("flow_dispatch", result=result, name=s.name, operands=operands, types=types,
                        result_types=[f"tensor<{s.m}x{s.n}xf32>"])]
