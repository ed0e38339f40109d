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
(`_offset_codes`), else met by each ISA's signed form. A q5 step reads
the 32 nibble bytes of its 64 codes and their 8 bytes of fifth bits
(`fifth_bit_lines`): 40 bytes where the same codes as q8 take 64. The dot-product lines come
from kernels/isa.py (the shape's `isa`): on CPUs without VNNI the same
kernel runs each 64-code step as two 256-bit `vpmaddubsw` + `vpmaddwd`, and
each form (kernels/x86/) says why it is exact in int32.

The codes keep the bundle's layout (frontend/quant.py: [N, K/2] q4 bytes in
ggml's nibble order, [N, K] q8 codes), so the prefill, embedding and GPU paths
read the same parameters. The kernel is a hand-written dispatch
(`stream.executable` with vector-dialect code and the ISA's x86 intrinsics,
called with `flow.dispatch`): linalg offers no way to keep an int32
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

from ..contract.block_formats import codes_dims
from .isa import Int8Isa
from .mlir import as_tensor, f32_bits, f32_const, memref_type, stream_executable
from .x86 import AVX512_VNNI

# Workgroups per call below LARGE_N rows: every workgroup quantizes (and normalizes) the whole
# activation row again, a sizeable share of its instructions at a few dozen rows, and each costs the
# task system a tile; 8 (N / 8 rows each) made SmolLM2's decode step faster than 32-64-row tiles
# (docs/quantization.md, "The kernels"). Larger matrices take 1024 rows per workgroup.
WORKGROUPS = 8
ROWS_PER_WORKGROUP_LARGE = 1024
LARGE_N = 8192
MIN_ROWS_PER_WORKGROUP = 16
CODES_PER_STEP = 64  # codes per row step: one 512-bit vector, two 256-bit ones
CHAINS = 2  # independent accumulators per row


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
    def rows_per_workgroup(self) -> int:
        """Rows per workgroup: N / WORKGROUPS below LARGE_N (supports() makes N a multiple of 16);
        above, a power of two dividing N, halved until the count is even (two threads share it
        evenly: 9 workgroups leave one thread idle for a ninth of the call)."""
        if self.n < LARGE_N:
            return self.n // WORKGROUPS
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
        return (f"foldline_i8dot_{self.fmt}g{self.group}{self.scale_type}{'m' if self.has_min else ''}"
                f"_k{self.k}_n{self.n}{fused}")






def supports(shape: Int8DotShape) -> bool:
    """Whether these kernels take this shape: groups of 16, 32 or 64, whole vectors of codes, whole row steps."""
    return (shape.fmt in ("q4", "q5", "q8") and shape.group in (16, 32, 64) and shape.k % CODES_PER_STEP == 0
            and shape.n % 16 == 0 and shape.scale_type in ("f16", "f32")
            and (shape.fmt == "q8" or shape.has_min) and (shape.gate is None or shape.gate in GATES))




def _offset_codes(s: Int8DotShape) -> bool:
    """q8 codes met as q + 128 (unsigned) where the form's unsigned product is exact for any byte.

    sum_k (q + 128) x = sum_k q x + 128 sum_k x, and the second term is the row-independent
    dx * sum xq of each group (%cg) times 128 and the row's scale: one short dot per row takes it
    out, as the mins' term does, where the signed form spent a second dot product per step.
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


def fifth_bit_constants(codes: int) -> list[str]:
    """The constants `fifth_bit_lines` uses for runs of `codes` codes (once per function)."""
    v = f"vector<{codes}xi8>"
    return [f"%q5_zero{codes} = arith.constant dense<0> : {v}", f"%q5_16_{codes} = arith.constant dense<16> : {v}"]


def fifth_bit_lines(out: str, packed: str, codes: int) -> list[str]:
    """Lines making `out` (vector<codes x i8>: 16 or 0 per code) from `packed` (vector<codes/8 x i8>), the
    q5 fifth bits of `codes` consecutive codes, bit t of byte j belonging to code 8j + t (frontend/quant.py).

    The bytes are read as a vector of codes bits, the order LLVM gives a bitcast to i1 elements; on
    AVX-512 that is a mask register, and the select one masked move (`vpmovm2b`-like). Or-ed into the
    codes' nibbles this gives the 5-bit codes.
    """
    v = f"vector<{codes}xi8>"
    return [f"{out}_m = vector.bitcast {packed} : vector<{codes // 8}xi8> to vector<{codes}xi1>",
            f"{out} = arith.select {out}_m, %q5_16_{codes}, %q5_zero{codes} : vector<{codes}xi1>, {v}"]


def quantize_group_lines(g: int) -> list[str]:
    """Lines quantizing %v (vector<g x f32>, one group) to int8 as llama.cpp's Q8 rows do.

    Defines %i8v (vector<g x i8> codes), %iv (the codes as i32), %isum (their i32 sum) and %d
    (the scale, max |x| / 127). Shared by the decode kernel and the prefill GEMM's
    activation pass, so both quantize a row identically.
    """
    vf, vi = f"vector<{g}xf32>", f"vector<{g}xi32>"
    return [
        f"%av = math.absf %v : {vf}",
        # max |x| as an integer max of the bit patterns (same order for non-negative floats): a float
        # max reduction keeps NaN semantics and lowers to a serial chain of scalar compares.
        f"%ab = arith.bitcast %av : {vf} to {vi}",
        f"%amaxb = vector.reduction <maxui>, %ab : {vi} into i32",
        "%amax = arith.bitcast %amaxb : i32 to f32",
        "%d = arith.divf %amax, %f127 : f32",
        "%nz = arith.cmpf ogt, %amax, %f0 : f32",
        "%inv = arith.divf %f127, %amax : f32",
        "%id = arith.select %nz, %inv, %f0 : f32",
        f"%idv = vector.broadcast %id : f32 to {vf}",
        f"%sv = arith.mulf %v, %idv : {vf}",
        # LLVM's own roundeven (one vrndscaleps): math.roundeven expands to ~50 bit operations per vector.
        f"%rv = llvm.intr.roundeven(%sv) : ({vf}) -> {vf}",
        f"%iv = arith.fptosi %rv : {vf} to {vi}",
        f"%isum = vector.reduction <add>, %iv : {vi} into i32",
        f"%i8v = arith.trunci %iv : {vi} to vector<{g}xi8>",
    ]


def _row_norm(s: Int8DotShape) -> list[str]:
    """Lines defining %rr = rsqrt(mean(h^2) + eps) over the K values of %x (the un-normalized row)."""
    assert s.norm is not None
    return [
        "%zs = arith.constant dense<0.0> : vector<16xf32>",
        f"%nK = arith.constant {s.k} : index",
        "%c16 = arith.constant 16 : index",
        "%ssq = scf.for %i = %c0 to %nK step %c16 iter_args(%acc = %zs) -> (vector<16xf32>) {",
        f"  %hv = vector.load %x[%i] : memref<{s.k}xf32>, vector<16xf32>",
        "  %acc2 = math.fma %hv, %hv, %acc : vector<16xf32>",
        "  scf.yield %acc2 : vector<16xf32>",
        "}",
        "%sumsq = vector.reduction <add>, %ssq : vector<16xf32> into f32",
        f"%kf = arith.constant {float(s.k)} : f32",
        "%mean = arith.divf %sumsq, %kf : f32",
        f"%eps = arith.constant {f32_const(s.norm.eps)}",
        "%meps = arith.addf %mean, %eps : f32",
        "%rr = math.rsqrt %meps : f32",
    ]


def _normed_group(s: Int8DotShape) -> list[str]:
    """Lines turning group %v of h (at %off) into (h * rr) * (w + offset), the graph's order of operations."""
    assert s.norm is not None
    g = s.group
    vf = f"vector<{g}xf32>"
    lines = [
        f"%rrv = vector.broadcast %rr : f32 to {vf}",
        f"%hr = arith.mulf %v0, %rrv : {vf}",
        f"%wv0 = vector.load %w[%off] : memref<{s.k}xf32>, {vf}",
    ]
    weight = "%wv0"
    if s.norm.offset is not None:
        lines += [f"%wo = arith.constant {f32_const(s.norm.offset)}",
                  f"%wov = vector.broadcast %wo : f32 to {vf}",
                  f"%wv = arith.addf %wv0, %wov : {vf}"]
        weight = "%wv"
    return lines + [f"%v = arith.mulf %hr, {weight} : {vf}"]


def _gated_group(s: Int8DotShape) -> list[str]:
    """Lines making group %v (at %off) of act(g) * u from the row [g, u].

    silu: g * (1 / (1 + exp(-g))), the operations IREE lowers torch's sigmoid and
    product to; gelu_tanh: 0.5 g (1 + tanh(beta (g + kappa g^3))), torch's formula.
    """
    g = s.group
    vf, mem = f"vector<{g}xf32>", f"memref<{s.x_len}xf32>"
    lines = [
        f"%gv = vector.load %x[%off] : {mem}, {vf}",
        "%uoff = arith.addi %off, %nK : index",
        f"%uv = vector.load %x[%uoff] : {mem}, {vf}",
        f"%one = arith.constant dense<1.0> : {vf}",
    ]
    if s.gate == "silu":
        lines += [
            f"%gneg = arith.negf %gv : {vf}",
            f"%gexp = math.exp %gneg : {vf}",
            f"%gden = arith.addf %gexp, %one : {vf}",
            f"%gsig = arith.divf %one, %gden : {vf}",
            f"%gact = arith.mulf %gv, %gsig : {vf}",
        ]
    else:
        lines += [
            f"%half = arith.constant dense<0.5> : {vf}",
            f"%kappa = arith.constant dense<{GELU_TANH_KAPPA}> : {vf}",
            f"%beta = arith.constant dense<{GELU_TANH_BETA}> : {vf}",
            f"%g2 = arith.mulf %gv, %gv : {vf}",
            f"%g3 = arith.mulf %g2, %gv : {vf}",
            f"%inner0 = math.fma %kappa, %g3, %gv : {vf}",
            f"%inner = arith.mulf %beta, %inner0 : {vf}",
            f"%th = math.tanh %inner : {vf}",
            f"%th1 = arith.addf %th, %one : {vf}",
            f"%hg = arith.mulf %half, %gv : {vf}",
            f"%gact = arith.mulf %hg, %th1 : {vf}",
        ]
    return lines + [f"%v = arith.mulf %gact, %uv : {vf}"]


def _quantize_activation(s: Int8DotShape) -> list[str]:
    """Lines filling %xq (int8 activations, k order), %dxe (dx per lane) and %cg (dx * sum xq per group).

    With a fused norm the row is normalized group by group on its way in; a gated row is
    turned into silu(g) * u the same way.
    """
    g, G, lanes = s.group, s.groups, s.group // 4
    if s.norm is not None:
        load = ["%v0 = " + f"vector.load %x[%off] : memref<{s.k}xf32>, vector<{g}xf32>", *_normed_group(s)]
    elif s.gated:
        load = _gated_group(s)
    else:
        load = [f"%v = vector.load %x[%off] : memref<{s.k}xf32>, vector<{g}xf32>"]
    lines = [*(_row_norm(s) if s.norm is not None else []),
        *([f"%nK = arith.constant {s.k} : index"] if s.gated else []),
        f"%xq = memref.alloca() : memref<{s.k}xi8>",
        f"%dxe = memref.alloca() : memref<{s.k // 4}xf32>",
        f"%cg = memref.alloca() : memref<{G}xf32>",
        f"%nG = arith.constant {G} : index",
        f"%ng = arith.constant {g} : index",
        f"%nl = arith.constant {lanes} : index",
        "%f0 = arith.constant 0.0 : f32",
        "%f127 = arith.constant 127.0 : f32",
        "scf.for %gi = %c0 to %nG step %c1 {",
        "  %off = arith.muli %gi, %ng : index",
        *[f"  {line}" for line in load],
        *[f"  {line}" for line in quantize_group_lines(g)],
        f"  vector.store %i8v, %xq[%off] : memref<{s.k}xi8>, vector<{g}xi8>",
        "  %fsum = arith.sitofp %isum : i32 to f32",
        "  %dsum = arith.mulf %fsum, %d : f32",
        f"  %dv = vector.broadcast %d : f32 to vector<{lanes}xf32>",
        "  %loff = arith.muli %gi, %nl : index",
        f"  vector.store %dv, %dxe[%loff] : memref<{s.k // 4}xf32>, vector<{lanes}xf32>",
        f"  memref.store %dsum, %cg[%gi] : memref<{G}xf32>",
        "}",
    ]
    return lines


def _step(s: Int8DotShape, i: int, acc: str) -> list[str]:
    """Step i of a row: its 64 codes against activations [64 i, 64 i + 64), added to acc into %acc_{i}."""
    per = CODES_PER_STEP // s.group  # groups per step
    st = s.scale_type
    lines = [f"%xs{i} = vector.load %xq[%k{i}] : memref<{s.k}xi8>, vector<64xi8>"]
    if s.fmt in ("q4", "q5"):
        nibbles = "%q" if s.fmt == "q4" else "%ql"
        lines += [
            f"%b{i} = vector.load %codes[%row, %h{i}] : {_codes_memref(s)}, vector<32xi8>",
            f"%lo{i} = arith.andi %b{i}, %m15 : vector<32xi8>",
            f"%hi{i} = arith.shrui %b{i}, %s4 : vector<32xi8>",
            f"{nibbles}{i} = vector.shuffle %lo{i}, %hi{i} {_nibble_mask(s)} : vector<32xi8>, vector<32xi8>",
        ]
        if s.fmt == "q5":
            lines += [f"%fb{i} = vector.load %codes[%row, %fi{i}] : {_codes_memref(s)}, vector<8xi8>",
                      *fifth_bit_lines(f"%fx{i}", f"%fb{i}", CODES_PER_STEP),
                      f"%q{i} = arith.ori %ql{i}, %fx{i} : vector<64xi8>"]
        lines += s.isa.dot_unsigned(f"%d{i}", "%isa_zi", f"%q{i}", f"%xs{i}")
    elif _offset_codes(s):
        lines += [
            f"%q{i} = vector.load %codes[%row, %k{i}] : {_codes_memref(s)}, vector<64xi8>",
            f"%qu{i} = arith.xori %q{i}, %q8_x128 : vector<64xi8>",  # q + 128, read unsigned
            *s.isa.dot_unsigned(f"%d{i}", "%isa_zi", f"%qu{i}", f"%xs{i}"),
        ]
    else:
        lines += [
            f"%q{i} = vector.load %codes[%row, %k{i}] : {_codes_memref(s)}, vector<64xi8>",
            *s.isa.dot_signed(f"%d{i}", "%isa_zi", f"%xs{i}", f"%q{i}"),
        ]
    spread = _spread_mask(s)
    lines += [
        f"%df{i} = arith.sitofp %d{i} : vector<16xi32> to vector<16xf32>",
        f"%sg{i} = vector.load %scales[%row, %g{i}] : {_scales_memref(s)}, vector<{per}x{st}>",
    ]
    sg = f"%sg{i}"
    if st == "f16":
        lines.append(f"%sgf{i} = arith.extf %sg{i} : vector<{per}xf16> to vector<{per}xf32>")
        sg = f"%sgf{i}"
    lines += [
        f"%dxv{i} = vector.load %dxe[%l{i}] : memref<{s.k // 4}xf32>, vector<16xf32>",
        f"%sl{i} = vector.shuffle {sg}, {sg} {spread} : vector<{per}xf32>, vector<{per}xf32>",
        f"%sx{i} = arith.mulf %sl{i}, %dxv{i} : vector<16xf32>",
        f"%acc_{i} = math.fma %df{i}, %sx{i}, {acc} : vector<16xf32>",
    ]
    return lines


def _dot_with_group_sums(s: Int8DotShape, per_group: str, tag: str) -> list[str]:
    """Lines defining {tag}sum = sum_g per_group[%row, g] * %cg[g] (%cg: each group's dx * sum xq)."""
    G, st = s.groups, s.scale_type
    lines = [f"{tag}row = vector.load {per_group}[%row, %c0] : {_scales_memref(s)}, vector<{G}x{st}>"]
    row = f"{tag}row"
    if st == "f16":
        lines.append(f"{tag}rowf = arith.extf {row} : vector<{G}xf16> to vector<{G}xf32>")
        row = f"{tag}rowf"
    return lines + [f"{tag}cgv = vector.load %cg[%c0] : memref<{G}xf32>, vector<{G}xf32>",
                    f"{tag}prod = arith.mulf {row}, {tag}cgv : vector<{G}xf32>",
                    f"{tag}sum = vector.reduction <add>, {tag}prod : vector<{G}xf32> into f32"]


def _row(s: Int8DotShape) -> list[str]:
    """The body computing y[%row]: every step of the row unrolled, CHAINS independent accumulators."""
    steps = s.k // CODES_PER_STEP
    per = CODES_PER_STEP // s.group
    lines = []
    for i in range(steps):
        lines += [f"%k{i} = arith.constant {i * CODES_PER_STEP} : index",
                  f"%l{i} = arith.constant {i * CODES_PER_STEP // 4} : index",
                  f"%g{i} = arith.constant {i * per} : index"]
        if s.fmt in ("q4", "q5"):
            lines.append(f"%h{i} = arith.constant {i * CODES_PER_STEP // 2} : index")
        if s.fmt == "q5":  # the fifth bits follow the K/2 nibble bytes of the row
            lines.append(f"%fi{i} = arith.constant {s.k // 2 + i * CODES_PER_STEP // 8} : index")
    last: dict[int, str] = {}  # chain -> its latest accumulator
    for i in range(steps):
        c = i % CHAINS
        lines += _step(s, i, last.get(c, "%zf"))
        last[c] = f"%acc_{i}"
    total = last[0]
    for c in range(1, min(CHAINS, steps)):
        lines.append(f"%sum_a{c} = arith.addf {total}, {last[c]} : vector<16xf32>")
        total = f"%sum_a{c}"
    lines.append(f"%sum = vector.reduction <add>, {total} : vector<16xf32> into f32")
    out = "%sum"
    if s.has_min:
        # sum_g m[n, g] * dx[g] * sum_k xq[g, k]: one short dot per row, not a term of every step
        # (docs/quantization.md, "The kernels")
        lines += [*_dot_with_group_sums(s, "%mins", "%m"), f"%withmin = arith.addf {out}, %msum : f32"]
        out = "%withmin"
    if _offset_codes(s):
        # - sum_g s[n, g] * 128 * dx[g] * sum_k xq[g, k]: the codes' offset, taken out once per row
        lines += [*_dot_with_group_sums(s, "%scales", "%o"),
                  "%o128 = arith.constant 128.0 : f32",
                  "%ooff = arith.mulf %osum, %o128 : f32",
                  f"%unoffset = arith.subf {out}, %ooff : f32"]
        out = "%unoffset"
    if s.residual:  # r + y, the graph's add (IEEE addition commutes exactly)
        lines += [f"%rrow = memref.load %res[%row] : memref<{s.n}xf32>", f"%withres = arith.addf %rrow, {out} : f32"]
        out = "%withres"
    lines.append(f"memref.store {out}, %y[%row] : memref<{s.n}xf32>")
    return lines


def int8_dot_executable(s: Int8DotShape) -> str:
    """The `stream.executable` computing y[N] from x[K] and the codes, for one shape.

    Each workgroup walks its rows one at a time, each row's codes in order:
    interleaving four rows' reads (as the float kernel's row tiles do) halves
    the bandwidth DRAM gives two threads (docs/quantization.md, "Rows one at a
    time"). The steps of a row are unrolled into CHAINS independent
    accumulators, so consecutive rows overlap in the out-of-order core.
    """
    if not supports(s):
        raise ValueError(f"no int8-dot kernel for {s}")
    rows = s.rows_per_workgroup
    bindings = ["%xb: !stream.binding"] + (["%wb: !stream.binding"] if s.norm is not None else [])
    bindings += ["%cb: !stream.binding", "%sb: !stream.binding"] + (["%mb: !stream.binding"] if s.has_min else [])
    bindings += (["%rb: !stream.binding"] if s.residual else []) + ["%yb: !stream.binding"]
    body = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%x = stream.binding.subspan %xb[%c0] : !stream.binding -> memref<{s.x_len}xf32>",
        *([f"%w = stream.binding.subspan %wb[%c0] : !stream.binding -> memref<{s.k}xf32>"]
          if s.norm is not None else []),
        f"%codes = stream.binding.subspan %cb[%c0] : !stream.binding -> {_codes_memref(s)}",
        f"%scales = stream.binding.subspan %sb[%c0] : !stream.binding -> {_scales_memref(s)}",
        *([f"%mins = stream.binding.subspan %mb[%c0] : !stream.binding -> {_scales_memref(s)}"]
          if s.has_min else []),
        *([f"%res = stream.binding.subspan %rb[%c0] : !stream.binding -> memref<{s.n}xf32>"] if s.residual else []),
        f"%y = stream.binding.subspan %yb[%c0] : !stream.binding -> memref<{s.n}xf32>",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        *_quantize_activation(s),
        *s.isa.constants(),
        "%zf = arith.constant dense<0.0> : vector<16xf32>",
        "%m15 = arith.constant dense<15> : vector<32xi8>",
        "%s4 = arith.constant dense<4> : vector<32xi8>",
        *(fifth_bit_constants(CODES_PER_STEP) if s.fmt == "q5" else []),
        *(["%q8_x128 = arith.constant dense<-128> : vector<64xi8>"] if _offset_codes(s) else []),
        f"%nrows = arith.constant {rows} : index",
        "%rowbase = arith.muli %wg, %nrows : index",
        "%rowend = arith.addi %rowbase, %nrows : index",
        "scf.for %row = %rowbase to %rowend step %c1 {",
        *[f"  {line}" for line in _row(s)],
        "}",
    ]
    return stream_executable(s.name, s.n // rows, bindings, body)




def int8_dot_dispatch(s: Int8DotShape, x: str, codes: str, scales: str, mins: str | None, result: str,
                      norm_weight: str | None = None, residual: str | None = None) -> str:
    """The `flow.dispatch` line computing `result` (tensor<N x f32>) from x (tensor<K x f32>) and the codes.

    norm_weight (tensor<K x f32>) with s.norm, residual (tensor<N x f32>) with s.residual.
    """
    if (norm_weight is None) != (s.norm is None) or (residual is None) == s.residual:
        raise ValueError(f"{s.name}: the norm weight and residual operands must match the shape's fusions")
    if s.gated and s.norm is not None:
        raise ValueError(f"{s.name}: a row is either normalized or gated")
    codes_t = as_tensor(_codes_memref(s))
    scales_t = as_tensor(_scales_memref(s))
    row_t = f"tensor<{s.k}xf32>"
    operands = [x] + ([norm_weight] if norm_weight else []) + [codes, scales] + ([mins] if s.has_min else [])
    types = [f"tensor<{s.x_len}xf32>"] + ([row_t] if norm_weight else []) + [codes_t, scales_t] + (
        [scales_t] if s.has_min else [])
    if residual:
        operands.append(residual)
        types.append(f"tensor<{s.n}xf32>")
    return (f"{result} = flow.dispatch @{s.name}_exe::@{s.name}({', '.join(operands)}) "
            f": ({', '.join(types)}) -> tensor<{s.n}xf32>")
