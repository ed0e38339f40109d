"""Decode kernels for x86 CPUs with AVX-512 VNNI or AVX2: 8-bit activations against the narrow codes.

The float decode kernel (qlinear.half_group_mlir) converts every code to
float32 before its multiply, so its Q4 matvecs are bounded by instructions,
not by memory (docs/history.md, "Where the time goes, and what is next").
These kernels do what llama.cpp does on the same CPUs: the activation row is
quantized to int8 per weight group (scale max|x| / 127, round half to even),
and the group's dot product is one `vpdpbusd` per 64 codes (unsigned bytes
times signed bytes, four products summed into each 32-bit lane), then scaled
in float:

    y[n] = sum_g s[n, g] * dx[g] * sum_k q[n, g, k] * xq[g, k]   (+ m[n, g] * dx[g] * sum_k xq[g, k])

q4 and q5 codes are unsigned (0..15, 0..31) and meet the signed activation
directly; q8 codes are signed: offset by 128 where the form's unsigned product is exact
(`offset_codes`), else met by each ISA's signed form. A q5 step reads
the 32 nibble bytes of its 64 codes and their 8 bytes of fifth bits
(`fifth_bits`): 40 bytes where the same codes as q8 take 64. The dot product's ops come
from kernels/isa.py (the shape's `isa`): on CPUs without VNNI the same
kernel runs each 64-code step as two 256-bit `vpmaddubsw` + `vpmaddwd`, and
each form (kernels/x86/) says why it is exact in int32.

A batched bundle's decode calls of k rows (k <= MAX_ROWS) take, on aarch64,
the same kernel with `rows` activation rows per dispatch (x86 takes the
channel-lane kernel, kernels/int8_channels.py, for every row count): every row is
quantized as one row is, and each weight block is read and unpacked once for
all rows, whose products, scaling and sums are the one-row kernel's, in its
order (`_rows`), so each row's result is the one-row kernel's to the bit,
however many rows a call computes.

The codes keep the bundle's layout (frontend/quant.py: [N, K/2] q4 bytes in
ggml's nibble order, [N, K] q8 codes), so the prefill, embedding and GPU paths
read the same parameters. The kernel is a hand-written dispatch
(`stream.executable` with vector-dialect code and the ISA's x86 intrinsics,
called with `flow.dispatch`; its ops made with kernels/builder.py): linalg offers no way to keep an int32
sum per group and a float sum across groups in one op. Each workgroup
quantizes the activation row itself (K values, a few percent of its work) and
computes its rows one at a time, each row's codes read in order (see
int8_dot_executable for why).

This is a lossy activation path, as llama.cpp's: activations keep 8 bits per
group of 16 to 64 values. docs/quantization.md gives the measured error and
the bounds the tests state; `foldline compile --activations f32` keeps the
exact float kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from iree.compiler import ir

from ..contract.block_formats import codes_dims
from .builder import Builder, Value, stream_executable
from .isa import Int8Isa, zero_lanes
from .mlir import CACHE_LINE, as_tensor, element_bytes, f32_bits, memref_type
from .template import instantiate
from .x86 import AVX512_VNNI

# Workgroups per call below LARGE_N rows: every workgroup quantizes (and normalizes) the whole
# activation row again, a sizeable share of its instructions at a few dozen rows, and each costs the
# task system a tile; 8 (N / 8 rows each) made SmolLM2's decode step faster than 32-64-row tiles
# (docs/quantization.md, "The kernels"). Larger matrices take 1024 rows per workgroup.
WORKGROUPS = 8
ROWS_PER_WORKGROUP_LARGE = 1024
LARGE_N = 8192
MIN_ROWS_PER_WORKGROUP = 16
PREFETCH_BYTES = 2048  # how far ahead of the row read its codes are asked for
CODES_PER_STEP = 64  # codes per row step: one 512-bit vector, two 256-bit ones
CHAINS = 2  # independent accumulators per row
# Activation rows one dispatch takes (decode of a bundle compiled with --batch up to this), and the
# stack their quantized activations may fill (IREE's limit is 32 KiB): beyond it a call is split.
MAX_ROWS = 8
ROWS_STACK_BYTES = 24576


# The gated MLP activations a kernel can take in, and their name suffixes.
GATES = {"silu": "_swiglu", "gelu_tanh": "_geglu"}
# GELU's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
GELU_TANH_BETA = 0.7978845608028654
GELU_TANH_KAPPA = 0.044715


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm taken into the kernel: x = (h * rsqrt(mean(h^2) + eps)) * (w + offset).

    The decode step's norm before a projection is two small dispatches of its
    own (the sum of squares, then the scaling); inside the kernel it costs a
    pass over K values per workgroup. offset None: the graph multiplies by w as it is.
    """

    eps: float
    offset: float | None


@dataclass(frozen=True)
class Int8DotShape:
    """What shapes one kernel: codes format, group, scale dtype, mins, K, N, and what it fuses.

    norm: the activation arrives un-normalized with its RMSNorm weight (RowNorm);
    gate: the activation is a gated MLP's act(g) * u, computed from the fused gate/up
    row [g, u] (2K values) it arrives as, act being `gate` (GATES: SwiGLU's silu,
    GeGLU's tanh-approximated GELU); residual: the kernel adds a residual row to its
    output (y = r + W x). Each saves the decode step a dispatch or two.
    """

    fmt: str  # "q4", "q5" or "q8"
    group: int
    scale_type: str  # "f16" or "f32"
    has_min: bool
    k: int
    n: int
    norm: RowNorm | None = None
    residual: bool = False
    gate: str | None = None  # a key of GATES: the gated activation taken in, if any
    # The dot-product form (kernels/isa.py, kernels/x86/). Not in the name: a module holds one ISA's kernels.
    isa: Int8Isa = AVX512_VNNI
    # Activation rows per dispatch (decode of a batched bundle): each weight block is read once for all.
    rows: int = 1
    # Output channels in the vector lanes, a group's products summed exactly and scaled once
    # (kernels/int8_channels.py), where the lanes otherwise hold four products of one row each.
    channel_lanes: bool = False

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def x_len(self) -> int:
        """Values of the activation input: K, or 2K for a gated row [g, u]."""
        return 2 * self.k if self.gated else self.k

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def workgroups_below_large_n(self) -> int:
        """Workgroups of a call below LARGE_N: WORKGROUPS for one activation row. Each workgroup
        quantizes (and normalizes or gates) every activation row again, so a call of several rows
        keeps about 16 rows' quantizing in all: 8, 4 and 2 workgroups for 2, up to 4 and up to 8 rows
        (two at least, one a thread; docs/quantization.md)."""
        if self.rows == 1:
            return WORKGROUPS
        return max(2, 2 * WORKGROUPS // (1 << (self.rows - 1).bit_length()))

    @property
    def rows_per_workgroup(self) -> int:
        """Rows per workgroup: N / workgroups_below_large_n below LARGE_N (supports() makes N a
        multiple of 16); above, a power of two dividing N, halved until the count is even (two threads
        share it evenly: 9 workgroups leave one thread idle for a ninth of the call)."""
        if self.n < LARGE_N:
            return self.n // self.workgroups_below_large_n
        rows = ROWS_PER_WORKGROUP_LARGE
        while self.n % rows or (rows > MIN_ROWS_PER_WORKGROUP and (self.n // rows) % 2):
            rows //= 2
        return rows

    @property
    def name(self) -> str:
        fused = ""
        if self.norm is not None:
            offset = "" if self.norm.offset is None else f"o{f32_bits(self.norm.offset)}"
            fused += f"_rms{f32_bits(self.norm.eps)}{offset}"
        if self.gated:
            fused += GATES[self.gate]
        if self.residual:
            fused += "_res"
        rows = f"_r{self.rows}" if self.rows > 1 else ""
        rows += "_cl" if self.channel_lanes else ""
        return (f"foldline_i8dot_{self.fmt}g{self.group}{self.scale_type}{'m' if self.has_min else ''}"
                f"_k{self.k}_n{self.n}{rows}{fused}")






def supports(shape: Int8DotShape) -> bool:
    """Whether these kernels take this shape: groups of 16, 32 or 64, whole vectors of codes, whole row steps,
    and (several rows) their quantized activations within ROWS_STACK_BYTES."""
    return (shape.fmt in ("q4", "q5", "q8") and shape.group in (16, 32, 64) and shape.k % CODES_PER_STEP == 0
            and shape.n % 16 == 0 and shape.scale_type in ("f16", "f32")
            and (shape.fmt == "q8" or shape.has_min) and (shape.gate is None or shape.gate in GATES)
            and (shape.rows == 1 or (2 <= shape.rows <= MAX_ROWS
                                     and shape.rows * _row_stack_bytes(shape) <= ROWS_STACK_BYTES)))


def _row_stack_bytes(shape: Int8DotShape) -> int:
    """Stack bytes of one activation row in the few-row kernel: K int8 codes, dx per group, dx * sum xq per
    group (padded to whole accumulators) and, for q8 codes met as q + 128, the offset's lane sums (K/4 int32)
    and, with channel lanes, their sums per group."""
    offsets = shape.k + (4 * shape.groups if shape.channel_lanes else 0) if offset_codes(shape) else 0
    return shape.k + 4 * shape.groups + 4 * _padded_groups(shape) + offsets


def _acc_lanes(shape: Int8DotShape) -> int:
    """float32 lanes of a row's accumulator: 16 (one AVX-512 register), 4 where group sums come first."""
    return 4 if shape.isa.group_sums_first else 16


def _padded_groups(shape: Int8DotShape) -> int:
    """Groups rounded up to whole accumulators: the length of the dx * sum xq table, zeros past the groups."""
    lanes = _acc_lanes(shape)
    return -(-shape.groups // lanes) * lanes


def dispatch_rows(shape: Int8DotShape, m: int) -> int:
    """Activation rows per dispatch for a call of `m` rows: the most dividing m whose stack fits (1: the
    one-row kernel, one dispatch per row)."""
    for rows in range(min(m, MAX_ROWS), 1, -1):
        if m % rows == 0 and rows * _row_stack_bytes(shape) <= ROWS_STACK_BYTES:
            return rows
    return 1




def offset_codes(s: Int8DotShape) -> bool:
    """q8 codes met as q + 128 (unsigned) where the form's unsigned product is exact for any byte.

    sum_k (q + 128) x = sum_k q x + 128 sum_k x: each step's dot product starts from -128 times the
    lane sums of its activations (computed once per activation row, `_offset_lanes`) in place of
    zero, so its int32 lanes are exact sums of q x, where the signed form spent a second dot
    product per step.
    """
    return s.fmt == "q8" and s.isa.unsigned_bytes_exact


def _codes_memref(s: Int8DotShape) -> str:
    return memref_type(codes_dims(s.fmt, s.n, s.k), "i8")


def _scales_memref(s: Int8DotShape) -> str:
    return memref_type((s.n, s.groups), s.scale_type)


def _spread_mask(shape: Int8DotShape) -> list[int]:
    """vector.shuffle mask putting each of the 64/g group values of one step on that group's g/4 lanes."""
    lanes = shape.group // 4
    return [i // lanes for i in range(16)]


def _nibble_mask(shape: Int8DotShape) -> list[int]:
    """vector.shuffle mask of (low nibbles, high nibbles) [32 + 32] into 64 codes in k order.

    A q4 group of g codes is g/2 bytes: byte b holds code b (low) and b + g/2 (high).
    """
    half = shape.group // 2
    mask = []
    for j in range(CODES_PER_STEP // shape.group):
        mask += [j * half + b for b in range(half)] + [32 + j * half + b for b in range(half)]
    return mask


def fifth_bit_constants(b: Builder, codes: int, bit_vectors: bool) -> None:
    """Make the constants `fifth_bits` uses for runs of `codes` codes here, once per function."""
    b.shared(0, b.vector(codes, "i8"))
    b.shared(16, b.vector(codes, "i8"))
    if not bit_vectors:
        b.shared(_bit_of_code(codes), b.vector(codes, "i8"))


def _bit_of_code(codes: int) -> tuple[int, ...]:
    """Lane c: the bit of its byte that holds code c's fifth bit (1 << c % 8), as a signed byte (bit 7 is
    -128)."""
    return tuple(1 << (c % 8) if c % 8 < 7 else -128 for c in range(codes))


def fifth_bits(b: Builder, packed: Value, codes: int, bit_vectors: bool) -> Value:
    """16 or 0 per code (vector<codes x i8>) from `packed` (vector<codes/8 x i8>), the q5 fifth bits of
    `codes` consecutive codes, bit t of byte j belonging to code 8j + t (frontend/quant.py). Or-ed into
    the codes' nibbles this gives the 5-bit codes.

    Where the form has `bit_vectors` (x86) the bytes are read as a vector of codes bits, the order LLVM
    gives a bitcast to i1 elements, and selected by them (with AVX-512 one masked move). On AArch64 LLVM
    expands that bitcast bit by bit (2.9 instructions per weight for a q5 decode row, against 0.6 for
    q8), so each byte is copied to its 8 codes' lanes (a shuffle: `tbl`), masked with its lane's bit and
    compared with zero: a few vector instructions per 16 codes, the same 16 or 0.
    """
    zero, sixteen = b.shared(0, b.vector(codes, "i8")), b.shared(16, b.vector(codes, "i8"))
    if bit_vectors:
        return b.select(b.vbitcast(packed, b.vector(codes, "i1")), sixteen, zero)
    spread = b.shuffle(packed, packed, [c // 8 for c in range(codes)])
    bit = b.andi(spread, b.shared(_bit_of_code(codes), b.vector(codes, "i8")))
    return b.select(b.cmpi_ne(bit, zero), sixteen, zero)


@dataclass
class QuantizedGroup:
    """One activation group quantized to int8 as llama.cpp's Q8 rows: codes (vector<g x i8>), their
    int32 sum (i32) and the scale d = max |x| / 127 (f32)."""

    codes: Value
    code_sum: Value
    scale: Value


def quantize_group(b: Builder, v: Value, f0: Value, f127: Value) -> QuantizedGroup:
    """Quantize v (vector<g x f32>, one group) to int8, rounding half to even; f0, f127: 0.0 and 127.0.

    Shared by the decode kernel and the prefill GEMM's activation pass, so both quantize a row
    identically.
    """
    g = ir.VectorType(v.type).shape[0]
    vi = b.vector(g, "i32")
    magnitude = b.absf(v)
    # max |x| as an integer max of the bit patterns (same order for non-negative floats): a float
    # max reduction keeps NaN semantics and lowers to a serial chain of scalar compares.
    amax = b.bitcast(b.reduce("maxui", b.bitcast(magnitude, vi)), b.element("f32"))
    d = b.divf(amax, f127)
    nonzero = b.cmpf_ogt(amax, f0)
    inverse = b.select(nonzero, b.divf(f127, amax), f0)
    scaled = b.mulf(v, b.broadcast(inverse, v.type))
    # LLVM's own roundeven (one vrndscaleps): math.roundeven expands to ~50 bit operations per vector.
    codes32 = b.fptosi(b.roundeven(scaled), vi)
    code_sum = b.reduce("add", codes32)
    return QuantizedGroup(b.trunci(codes32, b.vector(g, "i8")), code_sum, d)


@dataclass
class Operands:
    """The decode kernel's memrefs and the values every part of it reads."""

    c0: Value
    c1: Value
    x: Value  # the activation row (or the gated row [g, u]), f32
    w: Value | None  # the norm weight
    codes: Value
    scales: Value
    mins: Value | None
    res: Value | None  # the residual row
    y: Value
    xq: Value | None = None  # int8 activations in k order (stack)
    dxe: Value | None = None  # dx per lane (stack)
    cg: Value | None = None  # dx * sum xq per group, zeros to whole accumulators (stack)
    neg_offset: Value | None = None  # -128 * each lane's sum of xq, the start of a q8 step's dot (stack)
    zf: Value | None = None  # a zero float accumulator
    m15: Value | None = None  # the low-nibble mask
    s4: Value | None = None  # the high nibble's shift
    offset_bytes: Value | None = None  # -128: q8 codes offset by 128 (`offset_codes`)


def _row_norm(b: Builder, s: Int8DotShape, o: Operands) -> Value:
    """rsqrt(mean(h^2) + eps) over the K values of the un-normalized row."""
    assert s.norm is not None
    vf = b.vector(16, "f32")
    zero = b.const(0.0, vf)
    n_k = b.index(s.k)

    def square_add(i: Value, acc: Value) -> list[Value]:
        h = b.load(vf, o.x, [i])
        return [b.fma(h, h, acc)]

    sum_sq, = b.loop(o.c0, n_k, b.index(16), square_add, [zero])
    mean = b.divf(b.reduce("add", sum_sq), b.const(float(s.k), "f32"))
    return b.rsqrt(b.addf(mean, b.const(s.norm.eps, "f32")))


def _normed_group(b: Builder, s: Int8DotShape, o: Operands, rr: Value, off: Value) -> Value:
    """Group `off` of h turned into (h * rr) * (w + offset), the graph's order of operations."""
    assert s.norm is not None
    vf = b.vector(s.group, "f32")
    h = b.load(vf, o.x, [off])
    scaled = b.mulf(h, b.broadcast(rr, vf))
    weight = b.load(vf, o.w, [off])
    if s.norm.offset is not None:
        weight = b.addf(weight, b.broadcast(b.const(s.norm.offset, "f32"), vf))
    return b.mulf(scaled, weight)


def _gated_group(b: Builder, s: Int8DotShape, o: Operands, n_k: Value, off: Value) -> Value:
    """Group `off` of act(g) * u from the row [g, u].

    silu: g * (1 / (1 + exp(-g))), the operations IREE lowers torch's sigmoid and
    product to; gelu_tanh: 0.5 g (1 + tanh(beta (g + kappa g^3))), torch's formula.
    """
    vf = b.vector(s.group, "f32")
    g = b.load(vf, o.x, [off])
    u = b.load(vf, o.x, [b.addi(off, n_k)])
    one = b.const(1.0, vf)
    if s.gate == "silu":
        activated = b.mulf(g, b.divf(one, b.addf(b.exp(b.negf(g)), one)))
    else:
        half, kappa, beta = b.const(0.5, vf), b.const(GELU_TANH_KAPPA, vf), b.const(GELU_TANH_BETA, vf)
        cube = b.mulf(b.mulf(g, g), g)
        inner = b.mulf(beta, b.fma(kappa, cube, g))
        th1 = b.addf(b.tanh(inner), one)
        activated = b.mulf(b.mulf(half, g), th1)
    return b.mulf(activated, u)


def quantize_activation(b: Builder, s: Int8DotShape, o: Operands, per_lane: bool = True) -> None:
    """Fill o.xq (int8 activations, k order), o.dxe (dx per lane; per group where not per_lane, the
    few-row kernel's smaller stack), o.cg (dx * sum xq per group, then zeros to `_padded_groups`) and,
    for q8 codes met as q + 128, o.neg_offset (`_offset_lanes`).

    With a fused norm the row is normalized group by group on its way in; a gated row is
    turned into act(g) * u the same way.
    """
    g, lanes = s.group, s.group // 4
    rr = _row_norm(b, s, o) if s.norm is not None else None
    n_k = b.index(s.k) if s.gated else None
    o.xq = b.alloca(b.memref((s.k,), "i8"))
    o.dxe = b.alloca(b.memref((s.k // 4 if per_lane else s.groups,), "f32"))
    o.cg = b.alloca(b.memref((_padded_groups(s),), "f32"))
    n_groups, n_g, n_lanes = b.index(s.groups), b.index(g), b.index(lanes)
    f0, f127 = b.const(0.0, "f32"), b.const(127.0, "f32")

    def group(gi: Value) -> None:
        off = b.muli(gi, n_g)
        if rr is not None:
            v = _normed_group(b, s, o, rr, off)
        elif n_k is not None:
            v = _gated_group(b, s, o, n_k, off)
        else:
            v = b.load(b.vector(g, "f32"), o.x, [off])
        q = quantize_group(b, v, f0, f127)
        b.store(q.codes, o.xq, [off])
        dsum = b.mulf(b.sitofp(q.code_sum, b.element("f32")), q.scale)
        if per_lane:
            dv = b.broadcast(q.scale, b.vector(lanes, "f32"))
            b.store(dv, o.dxe, [b.muli(gi, n_lanes)])
        else:
            b.store_scalar(q.scale, o.dxe, [gi])
        b.store_scalar(dsum, o.cg, [gi])

    b.loop(o.c0, n_groups, o.c1, group)
    for pad in range(s.groups, _padded_groups(s)):
        b.store_scalar(f0, o.cg, [b.index(pad)])
    if offset_codes(s):
        _offset_lanes(b, s, o)


def _offset_lanes(b: Builder, s: Int8DotShape, o: Operands) -> None:
    """o.neg_offset: -128 times each int32 lane's sum of the activation codes (4 per lane), the start of
    each q8 step's dot product of q + 128 (`offset_codes`). The ISA's own dot product of bytes of 128
    with the codes makes the sums, exact as the steps' are."""
    o.neg_offset = b.alloca(b.memref((s.k // 4,), "i32"))
    v64 = b.vector(64, "i8")

    def step(i: Value) -> None:
        sums = s.isa.dot_unsigned(b, None, bytes_of_128(b), b.load(v64, o.xq, [b.muli(i, b.index(CODES_PER_STEP))]))
        b.store(b.subi(zero_lanes(b), sums), o.neg_offset, [b.muli(i, b.index(CODES_PER_STEP // 4))])

    b.loop(o.c0, b.index(s.k // CODES_PER_STEP), o.c1, step)


def bytes_of_128(b: Builder) -> Value:
    """The function's 64 bytes of -128: xor-ed into a q8 code it adds 128 (read unsigned), and read
    unsigned it is 128."""
    return b.shared(-128, b.vector(64, "i8"))


@dataclass
class StepOffsets:
    """Step i's index constants: its activations (k), lanes of dx (l), groups (g), nibble bytes (h),
    fifth-bit bytes (f)."""

    k: Value
    l: Value  # noqa: E741
    g: Value
    h: Value | None
    f: Value | None

    @classmethod
    def of_step(cls, b: Builder, s: Int8DotShape, i: Value) -> StepOffsets:
        """The offsets of step `i` (an index value: a loop's induction variable)."""
        def times(n: int) -> Value:
            return b.muli(i, b.index(n))

        halves = times(CODES_PER_STEP // 2) if s.fmt in ("q4", "q5") else None
        fifth = b.addi(b.index(s.k // 2), times(CODES_PER_STEP // 8)) if s.fmt == "q5" else None
        return cls(times(CODES_PER_STEP), times(CODES_PER_STEP // 4), times(CODES_PER_STEP // s.group), halves, fifth)


def _step(b: Builder, s: Int8DotShape, o: Operands, row: Value, at: StepOffsets, acc: Value) -> Value:
    """One step of a row: its 64 codes against activations [k, k + 64), added to acc (vector<16xf32>)."""
    per = CODES_PER_STEP // s.group  # groups per step
    xs = b.load(b.vector(64, "i8"), o.xq, [at.k])
    d = code_dot(b, s, o, step_codes(b, s, o, row, at), xs, at)
    vf = b.vector(16, "f32")
    df = None if s.isa.group_sums_first else b.sitofp(d, vf)  # first, as the x86 kernels always had it
    sg = _step_scales(b, s, o, row, at)
    if s.isa.group_sums_first:
        return _group_terms(b, s, d, sg, b.load(b.vector(per, "f32"), o.dxe, [at.g]), acc)
    dxv = b.load(vf, o.dxe, [at.l])
    sx = b.mulf(b.shuffle(sg, sg, _spread_mask(s)), dxv)
    return b.fma(df, sx, acc)


def step_codes(b: Builder, s: Int8DotShape, o: Operands, row: Value, at: StepOffsets) -> Value:
    """Row `row`'s 64 codes of a step (vector<64xi8>, k order): q4 nibbles unpacked, q5's fifth bits
    or-ed in, q8 codes as they are or plus 128 (`offset_codes`)."""
    if s.fmt in ("q4", "q5"):
        packed = b.load(b.vector(32, "i8"), o.codes, [row, at.h])
        q = b.shuffle(b.andi(packed, o.m15), b.shrui(packed, o.s4), _nibble_mask(s))
        if s.fmt == "q5":
            fifth = b.load(b.vector(8, "i8"), o.codes, [row, at.f])
            q = b.ori(q, fifth_bits(b, fifth, CODES_PER_STEP, s.isa.bit_vectors))
        return q
    q = b.load(b.vector(64, "i8"), o.codes, [row, at.k])
    return b.xori(q, o.offset_bytes) if offset_codes(s) else q


def _step_scales(b: Builder, s: Int8DotShape, o: Operands, row: Value, at: StepOffsets) -> Value:
    """Row `row`'s weight scales of a step's groups, float32 (vector<64/g>)."""
    per = CODES_PER_STEP // s.group
    sg = b.load(b.vector(per, s.scale_type), o.scales, [row, at.g])
    return b.extf(sg, b.vector(per, "f32")) if s.scale_type == "f16" else sg


def code_dot(b: Builder, s: Int8DotShape, o: Operands, q: Value, xs: Value, at: StepOffsets) -> Value:
    """The step's int32 lane sums of the codes (`step_codes`) times one activation row's xs: q + 128
    from o's -128 sum xq, q4 / q5 codes unsigned, other q8 codes signed."""
    start = b.load(b.vector(16, "i32"), o.neg_offset, [at.l]) if offset_codes(s) else None
    return dot(b, s, start, q, xs)


def dot(b: Builder, s: Int8DotShape, acc: Value | None, q: Value, x: Value) -> Value:
    """acc (None: zero) + the int32 lane sums of codes q (as `step_codes` gives them) times activations x:
    the form's unsigned product for q4 / q5 codes and q8 codes met as q + 128, its signed one otherwise."""
    if offset_codes(s) or s.fmt in ("q4", "q5"):
        return s.isa.dot_unsigned(b, acc, q, x)
    return s.isa.dot_signed(b, acc, x, q)


def _group_terms(b: Builder, s: Int8DotShape, d: Value, sg: Value, dx: Value, acc: Value) -> Value:
    """acc (vector<4xf32>) + a step's products with each group's int32 lanes added first: one 4-lane sum
    a group, converted and multiplied by that group's weight scale times its activation scale (the
    `group_sums_first` forms). d: vector<16xi32>; sg, dx: vector<groups of the step x f32>."""
    lanes, v4 = s.group // 4, b.vector(4, "f32")
    factors = b.mulf(sg, dx)
    for j in range(CODES_PER_STEP // s.group):
        part = b.shuffle(d, d, list(range(j * lanes, j * lanes + 4)))
        for r in range(4, lanes, 4):
            part = b.addi(part, b.shuffle(d, d, list(range(j * lanes + r, j * lanes + r + 4))))
        acc = b.fma(b.sitofp(part, v4), b.broadcast(b.extract(factors, j), v4), acc)
    return acc


def _prefetch_ahead(b: Builder, s: Int8DotShape, o: Operands, row: Value) -> None:
    """Ask for the codes and scales of the row PREFETCH_BYTES ahead (the last row at most), every
    cache line of them: the hardware's own prefetcher alone left each core's stream of rows waiting
    on memory."""
    code_bytes = codes_dims(s.fmt, s.n, s.k)[1]
    ahead = b.minsi(b.addi(row, b.index(max(1, PREFETCH_BYTES // code_bytes))), b.index(s.n - 1))
    for offset in range(0, code_bytes, CACHE_LINE):
        b.prefetch(o.codes, [ahead, b.index(offset)])
    per_line = CACHE_LINE // element_bytes(s.scale_type)
    for table in (o.scales, o.mins) if s.has_min else (o.scales,):
        for group in range(0, s.groups, per_line):
            b.prefetch(table, [ahead, b.index(group)])


def _row(b: Builder, s: Int8DotShape, o: Operands, row: Value) -> None:
    """y[row]: every step of the row unrolled, CHAINS independent accumulators."""
    _prefetch_ahead(b, s, o, row)
    offsets = _step_offsets(b, s)
    last: dict[int, Value] = {}  # chain -> its latest accumulator
    for i in range(len(offsets)):
        c = i % CHAINS
        last[c] = _step(b, s, o, row, offsets[i], last.get(c, o.zf))
    _finish_rows(b, s, [o], row, [last])


def _step_offsets(b: Builder, s: Int8DotShape) -> list[StepOffsets]:
    """The index constants of every step of a row."""
    per = CODES_PER_STEP // s.group
    offsets = []
    for i in range(s.k // CODES_PER_STEP):
        k, lanes, g = b.index(i * CODES_PER_STEP), b.index(i * CODES_PER_STEP // 4), b.index(i * per)
        h = b.index(i * CODES_PER_STEP // 2) if s.fmt in ("q4", "q5") else None
        # the fifth bits follow the K/2 nibble bytes of the row
        f = b.index(s.k // 2 + i * CODES_PER_STEP // 8) if s.fmt == "q5" else None
        offsets.append(StepOffsets(k, lanes, g, h, f))
    return offsets


def _rows(b: Builder, s: Int8DotShape, rows: list[Operands], row: Value, offsets: list[StepOffsets]) -> None:
    """y[r, row] for every activation row r, the codes and scales of each step read once for all of them.

    Each activation row meets exactly the operations `_row` applies to one (the same products, scaled
    and summed in the same order, the same chains), so it gets the one-row kernel's result to the bit.
    """
    o = rows[0]
    _prefetch_ahead(b, s, o, row)
    per = CODES_PER_STEP // s.group
    v64, vf = b.vector(64, "i8"), b.vector(16, "f32")
    last: list[dict[int, Value]] = [{} for _ in rows]
    for i, at in enumerate(offsets):
        c = i % CHAINS
        q = step_codes(b, s, o, row, at)
        sg = _step_scales(b, s, o, row, at)
        spread = None if s.isa.group_sums_first else b.shuffle(sg, sg, _spread_mask(s))
        for r, orow in enumerate(rows):
            d = code_dot(b, s, orow, q, b.load(v64, orow.xq, [at.k]), at)
            dx = b.load(b.vector(per, "f32"), orow.dxe, [at.g])
            if s.isa.group_sums_first:
                last[r][c] = _group_terms(b, s, d, sg, dx, last[r].get(c, o.zf))
                continue
            sx = b.mulf(spread, b.shuffle(dx, dx, _spread_mask(s)))
            last[r][c] = b.fma(b.sitofp(d, vf), sx, last[r].get(c, o.zf))
    _finish_rows(b, s, rows, row, last)


def _finish_rows(b: Builder, s: Int8DotShape, rows: list[Operands], row: Value,
                 chains: list[dict[int, Value]]) -> None:
    """y[r, row] for each activation row r from its chains' accumulators: their sum, the mins' term
    added lane-wise, the lanes summed (`lane_sums`), the residual.

    The mins' term sum_g m[n, g] * dx[g] * sum_k xq[g, k] is one product of the row's mins and the
    activation's cg table per accumulator's width of groups (not a term of every step), added into
    the accumulator before its lanes are summed. The one-row kernel is this with one row, so the
    few-row kernel's every row gets its result to the bit.
    """
    o, lanes = rows[0], _acc_lanes(s)
    vf = b.vector(lanes, "f32")
    totals = []
    for last in chains:
        total = last[0]
        for c in range(1, min(CHAINS, len(last))):
            total = b.addf(total, last[c])
        totals.append(total)
    if s.has_min:
        for first in range(0, s.groups, lanes):
            width = min(lanes, s.groups - first)
            mins = b.load(b.vector(width, s.scale_type), o.mins, [row, b.index(first)])
            if s.scale_type == "f16":
                mins = b.extf(mins, b.vector(width, "f32"))
            if width < lanes:  # lanes past the groups meet the table's zeros
                mins = b.shuffle(mins, mins, [i if i < width else 0 for i in range(lanes)])
            totals = [b.addf(t, b.mulf(mins, b.load(vf, orow.cg, [b.index(first)]))) for t, orow in zip(totals, rows)]
    sums = lane_sums(b, totals)
    for r, orow in enumerate(rows):
        out = b.extract(sums, r)
        if s.residual:  # r + y, the graph's add (IEEE addition commutes exactly)
            out = b.addf(b.load_scalar(orow.res, [row]), out)
        b.store_scalar(out, orow.y, [row])


def lane_sums(b: Builder, vectors: list[Value], widest: int = 16) -> Value:
    """The sum of each vector's lanes, as lane i of one vector<len(vectors)> (f32).

    Every vector is summed by halving: lanes j and j + L/2 of its L added, then again, to one. The
    vectors share each level's registers (two vectors' halves shuffled into one, up to `widest`
    lanes), so summing eight 16-lane rows costs about what two cost one at a time, and each vector
    meets the same additions in the same order however many are summed with it.
    """
    lanes = ir.VectorType(vectors[0].type).shape[0]
    blocks = [(v, 1) for v in vectors]  # (value, vectors in it: L lanes each, one after another)

    def halves(a: Value, ka: int, other: Value, kb: int, size: int) -> tuple[list[int], list[int]]:
        half = size // 2
        first = [v * size + j for v in range(ka) for j in range(half)]
        base = ir.VectorType(a.type).shape[0]
        first += [base + v * size + j for v in range(kb) for j in range(half)]
        return first, [i + half for i in first]

    while lanes > 1:
        merged = []
        i = 0
        while i < len(blocks):
            a, ka = blocks[i]
            if i + 1 < len(blocks) and (ka + blocks[i + 1][1]) * lanes // 2 <= widest:
                other, kb = blocks[i + 1]
                i += 2
            else:
                other, kb = a, 0
                i += 1
            low, high = halves(a, ka, other, kb, lanes)
            merged.append((b.addf(b.shuffle(a, other, low), b.shuffle(a, other, high)), ka + kb))
        blocks, lanes = merged, lanes // 2
    while len(blocks) > 1:  # one lane a vector: concatenate
        (a, ka), (other, kb) = blocks[0], blocks[1]
        blocks = [(b.shuffle(a, other, list(range(ka + kb))), ka + kb)] + blocks[2:]
    return blocks[0][0]


def row_views(b: Builder, s: Int8DotShape, binding: Value, size: int, zero: Value) -> list[Value]:
    """The f32 memref of each activation row of a binding holding s.rows rows of `size` one after another
    (zero: the function's index 0)."""
    if s.rows == 1:
        return [b.subspan(binding, zero, b.memref((size,), "f32"))]
    return [b.subspan(binding, b.index(r * size * 4), b.memref((size,), "f32")) for r in range(s.rows)]


def int8_dot_executable(s: Int8DotShape) -> str:
    """The `stream.executable` computing y[N] from x[K] and the codes, for one shape.

    Each workgroup walks its rows one at a time, each row's codes in order:
    interleaving four rows' reads (as the float kernel's row tiles do) halves
    the bandwidth DRAM gives two threads (docs/quantization.md, "Rows one at a
    time"). The steps of a row are unrolled into CHAINS independent
    accumulators, so consecutive rows overlap in the out-of-order core.
    With s.rows activation rows, the x, residual and y bindings hold the rows one
    after another, each read through a view of its own.
    """
    if not supports(s) or s.channel_lanes:
        raise ValueError(f"no int8-dot kernel for {s}" + (" (channel lanes: kernels/int8_channels.py)"
                                                            if s.channel_lanes else ""))
    rows = s.rows_per_workgroup
    bindings = 4 + (s.norm is not None) + s.has_min + s.residual

    def body(b: Builder, args: list[Value]) -> None:
        arg = iter(args)
        c0, c1 = b.index(0), b.index(1)
        scales_t = b.memref((s.n, s.groups), s.scale_type)

        xs = row_views(b, s, next(arg), s.x_len, c0)
        w = b.subspan(next(arg), c0, b.memref((s.k,), "f32")) if s.norm is not None else None
        codes = b.subspan(next(arg), c0, b.memref(codes_dims(s.fmt, s.n, s.k), "i8"))
        scales = b.subspan(next(arg), c0, scales_t)
        mins = b.subspan(next(arg), c0, scales_t) if s.has_min else None
        residuals = row_views(b, s, next(arg), s.n, c0) if s.residual else [None] * s.rows
        ys = row_views(b, s, next(arg), s.n, c0)
        operands = [Operands(c0, c1, x, w, codes, scales, mins, res, y) for x, res, y in zip(xs, residuals, ys)]
        workgroup = b.workgroup_id()
        for o in operands:
            quantize_activation(b, s, o, per_lane=s.rows == 1 and not s.isa.group_sums_first)
        s.isa.constants(b)
        zf = b.const(0.0, b.vector(4 if s.isa.group_sums_first else 16, "f32"))
        m15, s4 = b.const(15, b.vector(32, "i8")), b.const(4, b.vector(32, "i8"))
        if s.fmt == "q5":
            fifth_bit_constants(b, CODES_PER_STEP, s.isa.bit_vectors)
        offset_bytes = bytes_of_128(b) if offset_codes(s) else None
        for o in operands:
            o.zf, o.m15, o.s4, o.offset_bytes = zf, m15, s4, offset_bytes
        n_rows = b.index(rows)
        first = b.muli(workgroup, n_rows)
        if s.rows == 1:
            b.loop(first, b.addi(first, n_rows), c1, lambda row: _row(b, s, operands[0], row))
        else:
            b.loop(first, b.addi(first, n_rows), c1, lambda row: _rows(b, s, operands, row, _step_offsets(b, s)))

    return stream_executable(s.name, s.n // rows, bindings, body)


def int8_dot_dispatch(s: Int8DotShape, x: str, codes: str, scales: str, mins: str | None, result: str,
                      norm_weight: str | None = None, residual: str | None = None) -> str:
    """The `flow.dispatch` line computing `result` (tensor<rows*N x f32>) from x (tensor<rows*K x f32>, the
    activation rows one after another) and the codes.

    norm_weight (tensor<K x f32>) with s.norm, residual (tensor<rows*N x f32>) with s.residual.
    """
    if (norm_weight is None) != (s.norm is None) or (residual is None) == s.residual:
        raise ValueError(f"{s.name}: the norm weight and residual operands must match the shape's fusions")
    if s.gated and s.norm is not None:
        raise ValueError(f"{s.name}: a row is either normalized or gated")
    codes_t = as_tensor(_codes_memref(s))
    scales_t = as_tensor(_scales_memref(s))
    row_t = f"tensor<{s.k}xf32>"
    y_t = f"tensor<{s.rows * s.n}xf32>"
    operands = [x] + ([norm_weight] if norm_weight else []) + [codes, scales] + ([mins] if s.has_min else [])
    types = [f"tensor<{s.rows * s.x_len}xf32>"] + ([row_t] if norm_weight else []) + [codes_t, scales_t] + (
        [scales_t] if s.has_min else [])
    if residual:
        operands.append(residual)
        types.append(y_t)
    return instantiate("flow_dispatch", result=result, name=s.name, operands=operands, types=types,
                       result_types=[y_t])
