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
  quantize_group_lines, identical to the decode kernel's), written in the
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
from .int8_decode import fifth_bit_constants, fifth_bit_lines, quantize_group_lines
from .isa import Int8Isa
from .mlir import as_tensor, memref_type, stream_executable
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
    g, G, width = s.group, s.groups, _row_bytes(s)
    body = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        "%c4 = arith.constant 4 : index",
        *[f"%cq{q} = arith.constant {q} : index" for q in range(g // 4)],
        f"%x = stream.binding.subspan %xb[%c0] : !stream.binding -> memref<{s.m}x{s.k}xf32>",
        f"%xq = stream.binding.subspan %qb[%c0] : !stream.binding -> {_xq_memref(s)}",
        f"%dx = stream.binding.subspan %db[%c0] : !stream.binding -> {_per_group_memref(s, 'f32')}",
        f"%cg = stream.binding.subspan %cb[%c0] : !stream.binding -> {_per_group_memref(s, 'f32')}",
        f"%ofs = stream.binding.subspan %ob[%c0] : !stream.binding -> {_per_group_memref(s, 'i32')}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%nrows = arith.constant {QUANTIZE_ROWS} : index",
        "%row0 = arith.muli %wg, %nrows : index",
        "%rowend = arith.addi %row0, %nrows : index",
        f"%cw = arith.constant {width} : index",
        f"%nG = arith.constant {G} : index",
        f"%ng = arith.constant {g} : index",
        f"%nq = arith.constant {g // width} : index",
        "%f0 = arith.constant 0.0 : f32",
        "%f127 = arith.constant 127.0 : f32",
        "%im128 = arith.constant -128 : i32",
        "scf.for %gi = %c0 to %nG step %c1 {",
        "%off = arith.muli %gi, %ng : index",
        "%q0 = arith.muli %gi, %nq : index",
        "scf.for %row = %row0 to %rowend step %c1 {",
        "  %rowcol = arith.muli %row, %cw : index",
        f"  %v = vector.load %x[%row, %off] : memref<{s.m}x{s.k}xf32>, vector<{g}xf32>",
        *[f"  {line}" for line in quantize_group_lines(g)],
    ]
    for q in range(g // width):
        body += [
            f"  %p{q} = vector.shuffle %i8v, %i8v {list(range(width * q, width * q + width))} "
            f": vector<{g}xi8>, vector<{g}xi8>",
            f"  %kq{q} = arith.addi %q0, %cq{q} : index",
            f"  vector.store %p{q}, %xq[%kq{q}, %rowcol] : {_xq_memref(s)}, vector<{width}xi8>",
        ]
    body += [
        f"  memref.store %d, %dx[%gi, %row] : {_per_group_memref(s, 'f32')}",
        "  %fsum = arith.sitofp %isum : i32 to f32",
        "  %dsum = arith.mulf %fsum, %d : f32",
        f"  memref.store %dsum, %cg[%gi, %row] : {_per_group_memref(s, 'f32')}",
        "  %osum = arith.muli %isum, %im128 : i32",
        f"  memref.store %osum, %ofs[%gi, %row] : {_per_group_memref(s, 'i32')}",
        "}",
        "}",
    ]
    bindings = [f"%{b}: !stream.binding" for b in ("xb", "qb", "db", "cb", "ob")]
    return stream_executable(s.quantize_name, s.m // QUANTIZE_ROWS, bindings, body)


def _unpack_codes(s: Int8GemmShape) -> list[str]:
    """Lines filling %w [NT, chunk/4] i32 with the chunk's codes (groups %g0 ...) as unsigned bytes in k order."""
    g, nt, wq = s.group, s.tile_channels, s.chunk // 4
    w_t = f"memref<{nt}x{wq}xi32>"
    lines = [
        "scf.for %t = %c0 to %ntile step %c1 {",
        "  %cn = arith.addi %n0, %t : index",
        "  scf.for %gl = %c0 to %nGc step %c1 {",
        "    %gi = arith.addi %g0, %gl : index",
        "    %q0 = arith.muli %gl, %nq : index",
    ]
    if s.fmt in ("q4", "q5"):  # a group's g/2 bytes: byte b holds code b (low nibble) and b + g/2 (high)
        half, words = g // 2, g // 8
        lines += [
            f"    %nb = arith.constant {half} : index",
            "    %boff = arith.muli %gi, %nb : index",
            f"    %b = vector.load %codes[%cn, %boff] : {_codes_memref(s)}, vector<{half}xi8>",
            f"    %m15 = arith.constant dense<15> : vector<{half}xi8>",
            f"    %s4 = arith.constant dense<4> : vector<{half}xi8>",
            f"    %lo = arith.andi %b, %m15 : vector<{half}xi8>",
            f"    %hi = arith.shrui %b, %s4 : vector<{half}xi8>",
        ]
        if s.fmt == "q5":  # the group's g codes in k order with their fifth bits (g/8 bytes after the nibbles)
            lines += [
                f"    %fbase = arith.constant {s.k // 2} : index",
                f"    %nf = arith.constant {g // 8} : index",
                "    %fg = arith.muli %gi, %nf : index",
                "    %foff = arith.addi %fbase, %fg : index",
                f"    %fb = vector.load %codes[%cn, %foff] : {_codes_memref(s)}, vector<{g // 8}xi8>",
                *[f"    {line}" for line in fifth_bit_lines("%fx", "%fb", g)],
                f"    %q4k = vector.shuffle %lo, %hi {list(range(g))} : vector<{half}xi8>, vector<{half}xi8>",
                f"    %q5k = arith.ori %q4k, %fx : vector<{g}xi8>",
                f"    %q5w = vector.bitcast %q5k : vector<{g}xi8> to vector<{g // 4}xi32>",
                f"    vector.store %q5w, %w[%t, %q0] : {w_t}, vector<{g // 4}xi32>",
            ]
        else:
            lines += [
                f"    %lo32 = vector.bitcast %lo : vector<{half}xi8> to vector<{words}xi32>",
                f"    %hi32 = vector.bitcast %hi : vector<{half}xi8> to vector<{words}xi32>",
                f"    %nw = arith.constant {words} : index",
                "    %q1 = arith.addi %q0, %nw : index",
                f"    vector.store %lo32, %w[%t, %q0] : {w_t}, vector<{words}xi32>",
                f"    vector.store %hi32, %w[%t, %q1] : {w_t}, vector<{words}xi32>",
            ]
    elif s.signed_codes:  # q8 codes as they are, met by the form's signed product
        lines += [
            f"    %ng = arith.constant {g} : index",
            "    %koff = arith.muli %gi, %ng : index",
            f"    %b = vector.load %codes[%cn, %koff] : {_codes_memref(s)}, vector<{g}xi8>",
            f"    %b32 = vector.bitcast %b : vector<{g}xi8> to vector<{g // 4}xi32>",
            f"    vector.store %b32, %w[%t, %q0] : {w_t}, vector<{g // 4}xi32>",
        ]
    else:  # signed codes + 128 as unsigned bytes
        lines += [
            f"    %ng = arith.constant {g} : index",
            "    %koff = arith.muli %gi, %ng : index",
            f"    %b = vector.load %codes[%cn, %koff] : {_codes_memref(s)}, vector<{g}xi8>",
            f"    %x128 = arith.constant dense<-128> : vector<{g}xi8>",
            f"    %u = arith.xori %b, %x128 : vector<{g}xi8>",
            f"    %u32 = vector.bitcast %u : vector<{g}xi8> to vector<{g // 4}xi32>",
            f"    vector.store %u32, %w[%t, %q0] : {w_t}, vector<{g // 4}xi32>",
        ]
    lines += ["  }", "}"]
    return lines


def _group_step(s: Int8GemmShape) -> list[str]:
    """The body of the loop over a chunk's groups (%gl): int32 sums of a group for the register block, then
    scaled into the float accumulators."""
    R, J, g = s.row_vectors, CHANNELS, s.group
    st, w_t = s.scale_type, f"memref<{s.tile_channels}x{s.chunk // 4}xi32>"
    lines = ["%gi = arith.addi %g0, %gl : index",
             "%q0 = arith.muli %gi, %nq : index",  # quads: global in the activations, chunk-local in %w
             "%wq0 = arith.muli %gl, %nq : index"]
    offset = s.fmt == "q8" and not s.signed_codes  # codes + 128: the sum starts at -128 * sum xq
    for r in range(R):
        if offset:
            lines.append(f"%init{r} = vector.load %ofs[%gi, %mr{r}] : {_per_group_memref(s, 'i32')}, vector<16xi32>")
    acc = {(r, j): (f"%init{r}" if offset else "%isa_zi") for r in range(R) for j in range(J)}
    quads = g // 4
    for q in range(quads):
        lines += [f"%kq{q} = arith.addi %q0, %cq{q} : index", f"%wk{q} = arith.addi %wq0, %cq{q} : index"]
        for r in range(R):
            lines.append(f"%a{q}_{r} = vector.load %xq[%kq{q}, %mb4_{r}] : {_xq_memref(s)}, vector<64xi8>")
        for j in range(J):
            lines += [
                f"%wi{q}_{j} = memref.load %w[%jc{j}, %wk{q}] : {w_t}",
                f"%wv{q}_{j} = vector.broadcast %wi{q}_{j} : i32 to vector<16xi32>",
                f"%wb{q}_{j} = vector.bitcast %wv{q}_{j} : vector<16xi32> to vector<64xi8>",
            ]
    # Products per sum: several where the form adds them narrow before widening (AVX2's int16, q4/q5 codes).
    per = 1 if s.signed_codes else s.isa.unsigned_products_per_sum(MAX_CODE[s.fmt])
    for j in range(J):
        for r in range(R):
            for first in range(0, quads, per):
                new = f"%d{first}_{r}_{j}"
                if s.signed_codes:
                    lines += s.isa.dot_signed(new, acc[r, j], f"%a{first}_{r}", f"%wb{first}_{j}")
                else:
                    pairs = [(f"%wb{q}_{j}", f"%a{q}_{r}") for q in range(first, min(first + per, quads))]
                    lines += s.isa.dot_unsigned_sum(new, acc[r, j], pairs)
                acc[r, j] = new
    for r in range(R):
        lines.append(f"%dxv{r} = vector.load %dx[%gi, %mr{r}] : {_per_group_memref(s, 'f32')}, vector<16xf32>")
        if s.has_min:
            lines.append(f"%cgv{r} = vector.load %cg[%gi, %mr{r}] : {_per_group_memref(s, 'f32')}, vector<16xf32>")
    out: dict[int, str] = {}  # accumulator index (r * J + j) -> its value after this group
    for j in range(J):
        for what, ref in (("s", "%scales"), ("mn", "%mins")) if s.has_min else (("s", "%scales"),):
            lines.append(f"%{what}{j} = memref.load {ref}[%nc{j}, %gi] : {_scales_memref(s)}")
            value = f"%{what}{j}"
            if st == "f16":
                lines.append(f"%{what}f{j} = arith.extf %{what}{j} : f16 to f32")
                value = f"%{what}f{j}"
            lines.append(f"%{what}b{j} = vector.broadcast {value} : f32 to vector<16xf32>")
        for r in range(R):
            i = r * J + j
            lines += [
                f"%df{r}_{j} = arith.sitofp {acc[r, j]} : vector<16xi32> to vector<16xf32>",
                f"%sx{r}_{j} = arith.mulf %dxv{r}, %sb{j} : vector<16xf32>",
                f"%f{r}_{j} = math.fma %df{r}_{j}, %sx{r}_{j}, %acc{i} : vector<16xf32>",
            ]
            if s.has_min:
                lines.append(f"%fm{r}_{j} = math.fma %cgv{r}, %mnb{j}, %f{r}_{j} : vector<16xf32>")
            out[i] = f"%fm{r}_{j}" if s.has_min else f"%f{r}_{j}"
    lines.append(f"scf.yield {', '.join(out[i] for i in range(R * J))} : {', '.join(['vector<16xf32>'] * (R * J))}")
    return lines


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
    y_t, yt_t, tb = f"memref<{s.m}x{s.n}xf32>", f"memref<{nt}x{s.m}xf32>", min(nt, 16)
    n_acc = R * J
    acc_types = ", ".join(["vector<16xf32>"] * n_acc)
    body = [
        *gemm_prologue(s),
        *s.isa.constants(),
        "%zf = arith.constant dense<0.0> : vector<16xf32>",
        f"%cJ = arith.constant {J} : index",
        f"%cM = arith.constant {s.m} : index",
        f"%cMR = arith.constant {16 * R} : index",
        "%c4 = arith.constant 4 : index",
        "%c16 = arith.constant 16 : index",
        *[f"%cq{q} = arith.constant {q} : index" for q in range(g // 4)],
        *[f"%cr{r} = arith.constant {16 * r} : index" for r in range(R)],
        *[f"%cj{j} = arith.constant {j} : index" for j in range(J)],
        # the tile's float sums, [NT, M], live on the stack between K chunks
        f"%yt = memref.alloca() : {yt_t}",
        "scf.for %t = %c0 to %ntile step %c1 {",
        "  scf.for %mz = %c0 to %cM step %c16 {",
        f"    vector.store %zf, %yt[%t, %mz] : {yt_t}, vector<16xf32>",
        "  }",
        "}",
        "scf.for %g0 = %c0 to %nG step %nGc {",
        *[f"  {line}" for line in _unpack_codes(s)],
        "  scf.for %mb = %c0 to %cM step %cMR {",
        *[f"    %mr{r} = arith.addi %mb, %cr{r} : index" for r in range(R)],
        *[f"    %mb4_{r} = arith.muli %mr{r}, %c4 : index" for r in range(R)],
        "    scf.for %jb = %c0 to %ntile step %cJ {",
        *[f"      %jc{j} = arith.addi %jb, %cj{j} : index" for j in range(J)],
        *[f"      %nc{j} = arith.addi %n0, %jc{j} : index" for j in range(J)],
        *[f"      %y{r * J + j} = vector.load %yt[%jc{j}, %mr{r}] : {yt_t}, vector<16xf32>"
          for r in range(R) for j in range(J)],
        f"      %res:{n_acc} = scf.for %gl = %c0 to %nGc step %c1 "
        f"iter_args({', '.join(f'%acc{i} = %y{i}' for i in range(n_acc))}) -> ({acc_types}) {{",
        *[f"        {line}" for line in _group_step(s)],
        "      }",
        *[f"      vector.store %res#{r * J + j}, %yt[%jc{j}, %mr{r}] : {yt_t}, vector<16xf32>"
          for r in range(R) for j in range(J)],
        "    }",
        "  }",
        "}",
        # y [M, N]: the tile transposed in blocks of (up to) 16 channels x 16 rows
        f"%cT = arith.constant {tb} : index",
        f"%zblk = arith.constant dense<0.0> : vector<{tb}x16xf32>",
        *[f"%ci{i} = arith.constant {i} : index" for i in range(16)],
        "scf.for %tb = %c0 to %ntile step %cT {",
        "  %nb = arith.addi %n0, %tb : index",
        "  scf.for %mz = %c0 to %cM step %c16 {",
        *[line for i in range(tb) for line in (
            f"    %ti{i} = arith.addi %tb, %ci{i} : index",
            f"    %row{i} = vector.load %yt[%ti{i}, %mz] : {yt_t}, vector<16xf32>",
            f"    %blk{i + 1} = vector.insert %row{i}, {'%zblk' if i == 0 else f'%blk{i}'} [{i}] "
            f": vector<16xf32> into vector<{tb}x16xf32>")],
        f"    %blkt = vector.transpose %blk{tb}, [1, 0] : vector<{tb}x16xf32> to vector<16x{tb}xf32>",
        *[line for i in range(16) for line in (
            f"    %out{i} = vector.extract %blkt[{i}] : vector<{tb}xf32> from vector<16x{tb}xf32>",
            f"    %mi{i} = arith.addi %mz, %ci{i} : index",
            f"    vector.store %out{i}, %y[%mi{i}, %nb] : {y_t}, vector<{tb}xf32>")],
        "  }",
        "}",
    ]
    return stream_executable(s.name, s.n // nt, gemm_bindings(s), body)


def gemm_bindings(s: Int8GemmShape) -> list[str]:
    """The GEMM executable's bindings: the quantize dispatch's four results, codes, scales, mins, y."""
    bindings = [f"%{b}: !stream.binding" for b in ("xqb", "dxb", "cgb", "ob", "codeb", "sb")]
    return bindings + (["%mnb: !stream.binding"] if s.has_min else []) + ["%yb: !stream.binding"]


def gemm_prologue(s: Int8GemmShape) -> list[str]:
    """The lines every GEMM form opens with: its bindings' memrefs, the workgroup's first channel %n0, the
    stack tile %w [NT, chunk/4] of unpacked codes, the group counts _unpack_codes reads."""
    return [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%xq = stream.binding.subspan %xqb[%c0] : !stream.binding -> {_xq_memref(s)}",
        f"%dx = stream.binding.subspan %dxb[%c0] : !stream.binding -> {_per_group_memref(s, 'f32')}",
        f"%cg = stream.binding.subspan %cgb[%c0] : !stream.binding -> {_per_group_memref(s, 'f32')}",
        f"%ofs = stream.binding.subspan %ob[%c0] : !stream.binding -> {_per_group_memref(s, 'i32')}",
        f"%codes = stream.binding.subspan %codeb[%c0] : !stream.binding -> {_codes_memref(s)}",
        f"%scales = stream.binding.subspan %sb[%c0] : !stream.binding -> {_scales_memref(s)}",
        *([f"%mins = stream.binding.subspan %mnb[%c0] : !stream.binding -> {_scales_memref(s)}"]
          if s.has_min else []),
        f"%y = stream.binding.subspan %yb[%c0] : !stream.binding -> memref<{s.m}x{s.n}xf32>",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%ntile = arith.constant {s.tile_channels} : index",
        "%n0 = arith.muli %wg, %ntile : index",
        f"%w = memref.alloca() : memref<{s.tile_channels}x{s.chunk // 4}xi32>",
        f"%nq = arith.constant {s.group // 4} : index",
        f"%nGc = arith.constant {s.chunk // s.group} : index",
        f"%nG = arith.constant {s.groups} : index",
        *(fifth_bit_constants(s.group) if s.fmt == "q5" else []),
    ]


def int8_gemm_dispatches(s: Int8GemmShape, x: str, codes: str, scales: str, mins: str | None,
                         result: str) -> list[str]:
    """Lines computing `result` (tensor<M x N x f32>) from x (tensor<M x K x f32>)."""
    per_f, per_i = as_tensor(_per_group_memref(s, "f32")), as_tensor(_per_group_memref(s, "i32"))
    xq_t = as_tensor(_xq_memref(s))
    q = f"{result}_q"
    operands = [f"{q}#0", f"{q}#1", f"{q}#2", f"{q}#3", codes, scales] + ([mins] if s.has_min else [])
    types = [xq_t, per_f, per_f, per_i, as_tensor(_codes_memref(s)), as_tensor(_scales_memref(s))]
    types += [as_tensor(_scales_memref(s))] if s.has_min else []
    return [
        f"{q}:4 = flow.dispatch @{s.quantize_name}_exe::@{s.quantize_name}({x}) : (tensor<{s.m}x{s.k}xf32>) "
        f"-> ({xq_t}, {per_f}, {per_f}, {per_i})",
        f"{result} = flow.dispatch @{s.name}_exe::@{s.name}({', '.join(operands)}) "
        f": ({', '.join(types)}) -> tensor<{s.m}x{s.n}xf32>",
    ]
