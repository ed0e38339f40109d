"""Kernels for `foldline::qlinear`, generated as linalg per shape and entry point.

The importer keeps `foldline::qlinear` out of the aten decompositions, so it
reaches MLIR as `torch.operator "torch.foldline.qlinear"`. `expand_qlinear_ops`
replaces each one with a `util.call` to a generated `util.func`:

- decode (1 to MAX_FUSED_ROWS activation rows) on CPU: `half_group_mlir`, a
  generic that reads the narrow codes in its reduction, one lane per pair of
  codes (b, b + g/2) of a group, keeping one partial sum per lane and output
  row in vector registers, then a small generic adding the lanes:

      q4 bytes [N, K/2] -> [N, G, g/2] (byte b: code b low nibble, code b + g/2 high)
      part[n, l] += s[n, g] * (xa[g, l] * lo + xb[g, l] * hi) (+ min[n, g] * (xa + xb))
      y[n] = sum_l part[n, l]

  There is no separate dequantization op to hoist or materialise: no float
  copy of the weight exists, and each decode step reads only the quantized
  bytes (tests/test_quant_compile.py checks the dispatches). With several
  rows (decode of a batched bundle) the codes are read once for all of them.
  Why this form, and what IREE does with the alternatives: docs/quantization.md.
  On a CPU without FMA or F16C (`x86-64-v2`) it is spelt with a multiply and
  an add, one row per step, and f32 scales converted by a dispatch before it
  (`mlir.FloatIsa`, `fused_rows_code`);
- decode (one row) on an x86 CPU with AVX2 or AVX-512 VNNI, int8 activations
  asked for (the default there): `int8_dot_mlir`, the hand-written int8-dot
  dispatch of kernels/int8_decode.py, in the target's best form
  (kernels/isa.py), behind the same util.func signature;
- prefill chunks (M rows, M a multiple of 16) of a one-row bundle on an x86
  CPU with AVX-512 VNNI, int8 activations asked for: `int8_gemm_mlir`, the two hand-written
  dispatches of kernels/int8_gemm.py (quantize the chunk's activations, then
  int8 products with 16 rows per vector);
- other prefill chunks on CPU, and every call on GPU targets:
  `dequantize_matmul_mlir`, the weight dequantized into a float tile once per
  call and multiplied by all M rows: far less CPU per prefill token than the
  fused form (docs/quantization.md, "Prefill chunks (M > 1) ...: dequantize,
  then matmul"), and the fused form's CPU-sized vectors do not lower to
  SPIR-V. CPU modules compile without constant-expression hoisting, so the
  tile is never moved into a load-time float copy of every weight.

Alternatives that lose with the pinned IREE (backends/targets.IREE_VERSION; docs/quantization.md
gives the figures):

- a dequant generic followed by a matmul for decode is not fused by default
  (`--iree-dispatch-creation-block-matmul-producer-fusion` is on and blocks it); with
  the fusion forced it runs several times slower than the fused matvec;
- nibble unpacking with shifts and masks in the torch graph is never fused;
  torch.uint4 does not import;
- dequantizing to [N, K] with a block-scale map `k floordiv g` stops the
  vectorizer.

CPU modules are compiled with `--iree-llvmcpu-reassociate-fp-reductions=true`
(backends/targets.py): without it each reduction is a chain of scalar adds and
the fused kernel runs several times slower.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from iree.compiler import ir

from ..contract.block_formats import codes_dims
from .fusion import match_gate, match_norm, match_residual
from .int8_decode import Int8DotShape, RowNorm, int8_dot_dispatch, int8_dot_executable
from .int8_decode import supports as supports_int8_dot
from .int8_gemm import Int8GemmShape, gemm_executable, int8_gemm_dispatches, quantize_executable
from .int8_gemm import supports as supports_int8_gemm
from .isa import FLOAT, FLOAT_KERNELS, Int8Isa, Int8Kernels
from .mlir import (
    HARDWARE_FLOAT,
    FloatIsa,
    f16_bits_to_f32,
    memref_type,
    multiply_add,
    stream_executable,
    tensor_type,
    widen_f16,
)
from .sites import (
    KernelCall,
    SiteError,
    builtin_tensor,
    constant,
    is_constant,
    rewrite_sites,
    shape_and_type,
)
from .template import instantiate
from .x86 import AVX512_VNNI

OP_NAME = "torch.foldline.qlinear"


class QuantKernelError(SiteError):
    """A foldline::qlinear site this generator cannot express."""


@dataclass(frozen=True)
class QLinearSpec:
    """Everything that shapes one generated kernel."""

    fmt: str  # "q8", "q4" or "q5" (the float kernels read q5 widened to q8's layout)
    group: int
    scale_type: str  # "f16" or "f32"
    has_min: bool
    x_shape: tuple[int, ...]  # [..., K]
    n: int

    @property
    def k(self) -> int:
        return self.x_shape[-1]

    @property
    def m(self) -> int:
        m = 1
        for d in self.x_shape[:-1]:
            m *= d
        return m

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def name(self) -> str:
        dims = "x".join(str(d) for d in self.x_shape)
        return (f"foldline_qlinear_{self.fmt}g{self.group}{self.scale_type}{'m' if self.has_min else ''}"
                f"_{dims}_n{self.n}")


# The decode kernel keeps one partial sum per half-group lane and output row in vector
# registers; rows per vector step give independent add chains. Two suit short rows of
# q4 codes; four suit long rows (LONG_ROW_GROUPS groups or more) and q8 codes, whose
# steps are longer chains (docs/quantization.md has the per-shape timings).
ROWS_PER_STEP = 2
ROWS_PER_STEP_LONG = 4
LONG_ROW_GROUPS = 32
ROWS_PER_WORKGROUP = 32
# Activation rows the fused form takes (decode of a bundle compiled with --batch up to this).
MAX_FUSED_ROWS = 8


def _half_lanes(spec: QLinearSpec) -> int | None:
    """Lanes of the half-group kernel (group / 2), or None where a dim would be unit (IREE then drops the tiles)."""
    lanes = spec.group // 2
    return lanes if spec.group % 2 == 0 and lanes >= 2 and spec.groups >= 2 else None


def _rows_per_step(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> int:
    """Output rows per vector step of the half-group kernel: four for long or byte-code rows, else two.

    Capped so that all activation rows times these rows stay within four chains' registers; one
    where the registers are narrow (SSE: four rows' partial sums would fill all sixteen, and the
    spills made SmolLM2's q8 head slower than one row per step, docs/quantization.md).
    """
    if not isa.wide_registers:
        return 1
    long = spec.fmt in ("q8", "q5") or spec.groups >= LONG_ROW_GROUPS  # q5 is read as q8 (_widen_q5)
    for rows in ((ROWS_PER_STEP_LONG, ROWS_PER_STEP) if long else (ROWS_PER_STEP,)):
        if spec.n % rows == 0 and spec.m * rows <= 4:
            return rows
    return 1


def _tiles(spec: QLinearSpec) -> tuple[list[int], list[int], list[int]]:
    """(distribution, vector_common_parallel, vector_reduction) of the horizontal-reduction kernel (M = 1)."""
    g = spec.groups
    gt = 2 if g % 2 == 0 else (3 if g % 3 == 0 else 1)
    return [min(32, spec.n), 0, 0, 0], [1, 0, 0, 0], [0, gt, spec.group // 2, 2]


def _compilation_info(distribution: list[int], parallel: list[int], reduction: list[int]) -> str:
    return (f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {distribution}, vector_common_parallel = {parallel}, vector_reduction = {reduction}>, "
            f"translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _body(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> tuple[str, list[str], str]:
    """(block arguments, dequantization lines, the value holding the weight element) of the fused
    horizontal kernel's body: %a the activation, %q an i4 (q4) or i8 (q8) code."""
    st = spec.scale_type
    q4 = spec.fmt == "q4"
    code_arg = f"%q: {'i4' if q4 else 'i8'}"
    lines = (["%qi = arith.extui %q : i4 to i32", "%qf = arith.uitofp %qi : i32 to f32"] if q4
             else ["%qf = arith.sitofp %q : i8 to f32"])
    args = ["%a: f32", code_arg, f"%s: {st}"] + ([f"%mn: {st}"] if spec.has_min else [])
    scale = "%s"
    if st == "f16":
        lines += widen_f16("%s", "%sf", "f16", isa)
        scale = "%sf"
    lines.append(f"%w0 = arith.mulf {scale}, %qf : f32")
    if not spec.has_min:
        return ", ".join(args), lines, "%w0"
    low = "%mn"
    if st == "f16":
        lines += widen_f16("%mn", "%mf", "f16", isa)
        low = "%mf"
    lines.append(f"%w = arith.addf %w0, {low} : f32")
    return ", ".join(args), lines, "%w"


def _reshape(op: str, src: str, src_t: str, dst_t: str, groups: list[list[int]], shape: list[int]) -> str:
    if op == "expand":
        return f"tensor.expand_shape {src} {groups} output_shape {shape} : {src_t} into {dst_t}"
    return f"tensor.collapse_shape {src} {groups} : {src_t} into {dst_t}"




def _stored_codes_t(spec: QLinearSpec) -> str:
    """The codes as the bundle stores them: what a kernel's util.func takes."""
    return tensor_type(codes_dims(spec.fmt, spec.n, spec.k), "i8")


def _codes_t(spec: QLinearSpec) -> str:
    """%codes as the float kernels read it: q5 widened to one byte per code (`_widen_q5`), else as stored."""
    return tensor_type(codes_dims("q8" if spec.fmt == "q5" else spec.fmt, spec.n, spec.k), "i8")


def _widen_q5(spec: QLinearSpec) -> list[str]:
    """Lines making %codes [N, K] (one byte per code, 0..31, in k order) from %codes_q5, the stored planes
    (templates/qlinear_widen_q5.mlir).

    The float kernels then read q5 codes as they read q8 ones: the portable form, which copies
    the planes apart and writes the widened codes each call (the pinned IREE fuses neither into the
    kernel's dispatch; reading the planes in place crashes the compiler). The int8 kernels read
    the planes as they lie; where a bundle would run the float kernels at every step, the
    quantize-weights pass widens the codes once instead (docs/quantization.md).
    """
    return instantiate("qlinear_widen_q5", **_shape(spec), pad="").split("\n")


def _shape(spec: QLinearSpec) -> dict[str, object]:
    """The shape of a site as the qlinear templates take it."""
    return dict(fmt=spec.fmt, group=spec.group, groups=spec.groups, scale_type=spec.scale_type,
                has_min=spec.has_min, x_shape=spec.x_shape, m=spec.m, n=spec.n, k=spec.k,
                stored_codes=codes_dims(spec.fmt, spec.n, spec.k))


def _scales_t(spec: QLinearSpec) -> str:
    return tensor_type((spec.n, spec.groups), spec.scale_type)


def _codes_by_half(spec: QLinearSpec) -> tuple[list[str], str]:
    """Lines making %qw, code h * g/2 + b of each group at index (b, h) (q4) or (h, b) (q8), and its type.

    q4: the bytes bitcast to i4 (no data movement), [N, G, g/2, 2]: byte b's
    low nibble at h = 0, its high one at h = 1, ggml's order (frontend/quant.py).
    q8: the codes as they lie, [N, G, 2, g/2]. `_code_map` reads either one.
    """
    n, g, half = spec.n, spec.groups, spec.group // 2
    if spec.fmt == "q4":
        packed_t, q_t = tensor_type((n, g, half), "i8"), tensor_type((n, g, half, 2), "i4")
        return ["%c3 = " + _reshape("expand", "%codes", _codes_t(spec), packed_t, [[0], [1, 2]], [n, g, half]),
                f"%qw = flow.tensor.bitcast %c3 : {packed_t} -> {q_t}"], q_t
    q_t = tensor_type((n, g, 2, half), "i8")
    return ["%qw = " + _reshape("expand", "%codes", _codes_t(spec), q_t, [[0], [1, 2, 3]], [n, g, 2, half])], q_t


def _code_map(spec: QLinearSpec, dims: str, row: str, group: str, b: str, h: str) -> str:
    """The indexing map reading code (row, group, h * g/2 + b) from `_codes_by_half`'s %qw."""
    index = f"{row}, {group}, {b}, {h}" if spec.fmt == "q4" else f"{row}, {group}, {h}, {b}"
    return f"affine_map<({dims}) -> ({index})>"


def _x_as_rows(spec: QLinearSpec) -> str:
    """%x2: the activation x [..., K] as [M, K] (templates/qlinear_x_rows.mlir)."""
    return instantiate("qlinear_x_rows", **_shape(spec), pad="")


def _rows_as_y(spec: QLinearSpec) -> str:
    """%y: the result %y2 [M, N] as [..., N], the activation's leading shape (templates/qlinear_y_rows.mlir)."""
    return instantiate("qlinear_y_rows", **_shape(spec), pad="")


def _params(spec: QLinearSpec, codes: str = "%codes") -> list[str]:
    """(x, codes, scales[, mins]): the util.func parameters of a site, the codes as stored."""
    params = [f"%x: {tensor_type(spec.x_shape, 'f32')}", f"{codes}: {_stored_codes_t(spec)}",
              f"%scales: {_scales_t(spec)}"]
    return params + ([f"%mins: {_scales_t(spec)}"] if spec.has_min else [])


def _function(spec: QLinearSpec, lines: list[str], params: list[str] | None = None, name: str | None = None) -> str:
    """The util.func @name (default spec.name) returning %y; params default to (x, codes, scales[, mins])."""
    if params is None:  # a float kernel: q5 codes are widened on the way in
        params = _params(spec, "%codes_q5" if spec.fmt == "q5" else "%codes")
        if spec.fmt == "q5":
            lines = _widen_q5(spec) + lines
    y_t = tensor_type((*spec.x_shape[:-1], spec.n), "f32")
    body = "\n  ".join(lines)
    return (f"util.func private @{name or spec.name}({', '.join(params)}) -> {y_t} {{\n  {body}\n"
            f"  util.return %y : {y_t}\n}}")


def fused_matvec_mlir(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """The decode kernel for one activation row: half-group lanes where the shape allows, else horizontal sums."""
    return half_group_mlir(spec, isa) if _half_lanes(spec) else horizontal_matvec_mlir(spec, isa)


def fuses_rows(spec: QLinearSpec) -> bool:
    """Whether a CPU call of this shape reads the codes in its reduction instead of dequantizing a float tile.

    One row (decode), or up to MAX_FUSED_ROWS rows (decode of a batched
    bundle) where the half-group form applies; longer prefill chunks
    dequantize once per call and run a matmul.
    """
    return spec.m == 1 or (spec.m <= MAX_FUSED_ROWS and _half_lanes(spec) is not None)


def fused_rows_mlir(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """The fused decode kernel for spec.m rows: one row, or a few rows sharing each code read."""
    return fused_matvec_mlir(spec, isa) if spec.m == 1 else half_group_mlir(spec, isa)


def fused_rows_code(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> list[str]:
    """What a site taking the fused decode kernel needs in the module: the scale conversion's executable
    where the kernel takes one (`_converts_scales`), then `fused_rows_mlir`'s util.func."""
    half_group = spec.m > 1 or _half_lanes(spec) is not None
    widen = [_widen_scales_executable(spec.n * spec.groups, 1 + spec.has_min)[1]] if (
        half_group and _converts_scales(spec, isa)) else []
    return [*widen, fused_rows_mlir(spec, isa)]


def _half_code_inputs(spec: QLinearSpec, dims: str) -> tuple[list[str], list[str], list[str], list[str], list[str]]:
    """(lines, operands, types, maps, body lines) giving the half-group body %lo and %hi: codes b and b + g/2.

    q4: one byte read, split into its two nibbles. q8: the two half-group
    slices of the codes, each a contiguous run of g/2 bytes.
    """
    n, g, half = spec.n, spec.groups, spec.group // 2
    row_map = f"affine_map<({dims}) -> (r, g, l)>"
    if spec.fmt == "q4":
        b_t = tensor_type((n, g, half), "i8")
        lines = ["%qb = " + _reshape("expand", "%codes", _codes_t(spec), b_t, [[0], [1, 2]], [n, g, half])]
        body = ["%c15 = arith.constant 15 : i8", "%c4 = arith.constant 4 : i8",
                "%lo8 = arith.andi %b0, %c15 : i8", "%hi8 = arith.shrui %b0, %c4 : i8",
                "%lo = arith.uitofp %lo8 : i8 to f32", "%hi = arith.uitofp %hi8 : i8 to f32"]
        return lines, ["%qb"], [b_t], [row_map], body
    c4_t, h_t = tensor_type((n, g, 2, half), "i8"), tensor_type((n, g, half), "i8")
    lines = ["%c4 = " + _reshape("expand", "%codes", _codes_t(spec), c4_t, [[0], [1, 2, 3]], [n, g, 2, half])]
    for h in (0, 1):
        lines.append(f"%q{h} = tensor.extract_slice %c4[0, 0, {h}, 0] [{n}, {g}, 1, {half}] [1, 1, 1, 1] "
                     f": {c4_t} to {h_t}")
    body = ["%lo = arith.sitofp %b0 : i8 to f32", "%hi = arith.sitofp %b1 : i8 to f32"]
    return lines, ["%q0", "%q1"], [h_t, h_t], [row_map, row_map], body


WIDEN_LANES = 8  # f16 values one vector step of the scale conversion takes (two SSE registers of f32)
WIDEN_WORKGROUPS = 8


def _widen_scales_executable(size: int, count: int) -> tuple[str, str]:
    """(name, `stream.executable`) converting `count` arrays of `size` f16 bit patterns (i16) to f32.

    Hand-written, as kernels/attention.py: IREE's own dispatch of the same generic drops the
    tiles it is given and masks every vector of a partial tile element by element.
    """
    name = f"foldline_widen_f16_{size}x{count}"
    per = size // WIDEN_WORKGROUPS
    src_m, dst_m = memref_type((size,), "i16"), memref_type((size,), "f32")
    v16, v32 = f"vector<{WIDEN_LANES}xi16>", f"vector<{WIDEN_LANES}xf32>"
    body = ["%c0 = arith.constant 0 : index",
            f"%step = arith.constant {WIDEN_LANES} : index",
            f"%per = arith.constant {per} : index",
            "%wg = stream.dispatch.workgroup.id[0] : index",
            "%lo = arith.muli %wg, %per : index",
            "%hi = arith.addi %lo, %per : index"]
    for i in range(count):
        body += [f"%src{i} = stream.binding.subspan %sb{i}[%c0] : !stream.binding -> {src_m}",
                 f"%dst{i} = stream.binding.subspan %db{i}[%c0] : !stream.binding -> {dst_m}"]
    body.append("scf.for %i = %lo to %hi step %step {")
    for i in range(count):
        body += [f"  %h{i} = vector.load %src{i}[%i] : {src_m}, {v16}",
                 *[f"  {line}" for line in f16_bits_to_f32(f"%h{i}", f"%f{i}", v16)],
                 f"  vector.store %f{i}, %dst{i}[%i] : {dst_m}, {v32}"]
    body.append("}")
    bindings = [f"%sb{i}: !stream.binding" for i in range(count)] + [f"%db{i}: !stream.binding" for i in range(count)]
    return name, stream_executable(name, WIDEN_WORKGROUPS, bindings, body)


def _converts_scales(spec: QLinearSpec, isa: FloatIsa) -> bool:
    """Whether the half-group kernel reads f32 scales converted by `_widen_scales_executable`: f16 scales
    on a CPU without F16C, N x G a whole number of vector steps per workgroup (else it converts them
    in its loop)."""
    return (spec.scale_type == "f16" and not isa.f16
            and (spec.n * spec.groups) % (WIDEN_LANES * WIDEN_WORKGROUPS) == 0)


def _scales_as_f32(spec: QLinearSpec, names: list[str]) -> list[str]:
    """Lines making `{name}_f32` of each f16 [N, G] operand in `names` with `_widen_scales_executable`.

    For a CPU without f16 conversion: the kernel's body then reads f32 scales instead of converting
    each (row, group)'s scale and min in integer code inside its reduction, a third of the loop's
    instructions on SmolLM2's Q4_1 rows (docs/quantization.md). The halves cross as i16: SSE has
    no f16 vector loads (LLVM would insert them one at a time).
    """
    size = spec.n * spec.groups
    t16, t32 = _scales_t(spec), tensor_type((spec.n, spec.groups), "f32")
    bits2_t, bits_t, flat_t = tensor_type((spec.n, spec.groups), "i16"), tensor_type((size,), "i16"), \
        tensor_type((size,), "f32")
    name, _ = _widen_scales_executable(size, len(names))
    wide = [f"{n}_f32" for n in names]
    lines = []
    for n, w in zip(names, wide):
        lines += [f"{w}_h = flow.tensor.bitcast {n} : {t16} -> {bits2_t}",
                  f"{w}_bits = " + _reshape("collapse", f"{w}_h", bits2_t, bits_t, [[0, 1]], [])]
    lines.append(f"{', '.join(w + '_flat' for w in wide)} = flow.dispatch @{name}_exe::@{name}"
                 f"({', '.join(w + '_bits' for w in wide)}) : ({', '.join([bits_t] * len(names))}) "
                 f"-> ({', '.join([flat_t] * len(names))})")
    lines += [f"{w} = " + _reshape("expand", f"{w}_flat", flat_t, t32, [[0, 1]], [spec.n, spec.groups])
              for w in wide]
    return lines


def half_group_mlir(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """Decode (1 to MAX_FUSED_ROWS activation rows) reading each code once, with one lane per half-group pair.

    Each group of g codes is two halves of g/2: lane l takes codes l and
    l + g/2, which meet x[l] and x[l + g/2], two contiguous vectors (for q4 one
    byte holds both codes: ggml's nibble order). The body sums the pair
    unscaled, then scales once: out[r, l] += s * (xa * qa + xb * qb) (+ min *
    (xa + xb)), so a vector step is elementwise over the lanes and the partial
    sums stay in registers for the whole row; a small generic adds the lanes.
    Against the form that scaled each code (w = s * q + m, then x * w) this
    takes less time per call on every shape measured (docs/quantization.md,
    "The kernels").

    The pinned IREE's constraints the form keeps: the accumulator is combined by an
    `addf` (a `math.fma` on %out is not a reduction the vectorizer recognises:
    the op stays scalar); the products are `math.fma` (a mulf+addf body is
    recognised as a contraction and lowered lane by lane); no operand has a
    unit dimension (IREE's unit-dim folding rebuilds the generic without its
    compilation_info, and drops the tiles). With M > 1 rows (batched decode),
    every row keeps its own partial sums and the codes are read once for all.
    """
    lanes = _half_lanes(spec)
    m, n, k, g = spec.m, spec.n, spec.k, spec.groups
    if lanes is None or not 1 <= m <= MAX_FUSED_ROWS:
        raise QuantKernelError(f"the half-group kernel takes 1..{MAX_FUSED_ROWS} rows and two or more groups of "
                               f"an even size, got {m} rows, group {spec.group}, {g} groups")
    multi = m > 1
    dims = "b, r, l, g" if multi else "r, l, g"
    lines, code_ins, code_ts, code_maps, unpack = _half_code_inputs(spec, dims)
    xv_shape, xh_shape = ((m, g, 2, lanes), (m, g, lanes)) if multi else ((g, 2, lanes), (g, lanes))
    xv_t, xh_t = tensor_type(xv_shape, "f32"), tensor_type(xh_shape, "f32")
    x2_t = tensor_type((m, k), "f32")
    lines.append(_x_as_rows(spec))
    if multi:
        lines.append("%xv = " + _reshape("expand", "%x2", x2_t, xv_t, [[0], [1, 2, 3]], list(xv_shape)))
    else:
        lines += ["%x1 = " + _reshape("collapse", "%x2", x2_t, tensor_type((k,), "f32"), [[0, 1]], []),
                  "%xv = " + _reshape("expand", "%x1", tensor_type((k,), "f32"), xv_t, [[0, 1, 2]], list(xv_shape))]
    lead = "0, " if multi else ""
    sizes = f"{m}, " if multi else ""
    for name, h in (("%xa", 0), ("%xb", 1)):
        ones = "1, " if multi else ""
        lines.append(f"{name} = tensor.extract_slice %xv[{lead}0, {h}, 0] [{sizes}{g}, 1, {lanes}] [{ones}1, 1, 1] "
                     f": {xv_t} to {xh_t}")
    x_map = f"affine_map<({dims}) -> ({'b, ' if multi else ''}g, l)>"
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    st = spec.scale_type
    if _converts_scales(spec, isa):
        lines += _scales_as_f32(spec, scale_ins)
        scale_ins, st = [f"{name}_f32" for name in scale_ins], "f32"
    part_shape = (m, n, lanes) if multi else (n, lanes)
    part_t = tensor_type(part_shape, "f32")
    maps = ([x_map, x_map, *code_maps] + [f"affine_map<({dims}) -> (r, g)>"] * len(scale_ins)
            + [f"affine_map<({dims}) -> ({'b, ' if multi else ''}r, l)>"])
    rows = _rows_per_step(spec, isa)
    if multi:
        info = _compilation_info([m, min(ROWS_PER_WORKGROUP, n), 0, 0], [m, rows, lanes, 0], [0, 0, 0, 1])
    else:
        info = _compilation_info([min(ROWS_PER_WORKGROUP, n), 0, 0], [rows, lanes, 0], [0, 0, 1])

    def widened(v: str, out: str) -> list[str]:
        return widen_f16(v, out, "f16", isa) if st == "f16" else [f"{out} = arith.addf {v}, %zf : f32"]

    def fma(out: str, a: str, b: str, acc: str | None = None) -> list[str]:
        return multiply_add(out, a, b, acc, "f32", isa)

    body = ["%zf = arith.constant 0.0 : f32", *unpack, *widened("%s", "%sf"),
            *fma("%pa", "%xa_", "%lo"), *fma("%p", "%xb_", "%hi", "%pa")]
    if spec.has_min:
        body += [*widened("%mn", "%mf"), "%xs = arith.addf %xa_, %xb_ : f32", *fma("%mx", "%mf", "%xs"),
                 *fma("%t", "%sf", "%p", "%mx")]
    else:
        body += fma("%t", "%sf", "%p")
    code_args = ["%b0: i8"] if spec.fmt == "q4" else ["%b0: i8", "%b1: i8"]
    bargs = ", ".join(["%xa_: f32", "%xb_: f32", *code_args, f"%s: {st}"] + ([f"%mn: {st}"] if spec.has_min else []))
    kinds = ", ".join(['"parallel"'] * (len(part_shape)) + ['"reduction"'])
    ins = ["%xa", "%xb", *code_ins, *scale_ins]
    ins_t = [xh_t, xh_t, *code_ts, *([tensor_type((n, g), st)] * len(scale_ins))]
    y2_t = tensor_type((m, n), "f32")
    lines += [
        "%zero = arith.constant 0.0 : f32",
        f"%part_empty = tensor.empty() : {part_t}",
        f"%part_init = linalg.fill ins(%zero : f32) outs(%part_empty : {part_t}) -> {part_t}",
        f"%part = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{kinds}]}}",
        f"    ins({', '.join(ins)} : {', '.join(ins_t)}) outs(%part_init : {part_t}) "
        f"attrs = {{compilation_info = {info}}} {{",
        f"  ^bb0({bargs}, %out: f32):",
        *[f"      {line}" for line in body],
        "      %r = arith.addf %out, %t : f32",
        "      linalg.yield %r : f32",
        f"}} -> {part_t}",
    ]
    out_shape = (m, n) if multi else (n,)
    out_t = tensor_type(out_shape, "f32")
    sum_dims = "b, r, l" if multi else "r, l"
    sum_kinds = ", ".join(['"parallel"'] * len(out_shape) + ['"reduction"'])
    lines += [
        f"%empty = tensor.empty() : {out_t}",
        f"%init = linalg.fill ins(%zero : f32) outs(%empty : {out_t}) -> {out_t}",
        f"%acc = linalg.generic {{indexing_maps = [affine_map<({sum_dims}) -> ({sum_dims})>, "
        f"affine_map<({sum_dims}) -> ({sum_dims.rsplit(', ', 1)[0]})>], "
        f"iterator_types = [{sum_kinds}]}}",
        f"    ins(%part : {part_t}) outs(%init : {out_t}) {{",
        "  ^bb0(%v: f32, %o: f32):",
        "      %u = arith.addf %o, %v : f32",
        "      linalg.yield %u : f32",
        f"}} -> {out_t}",
    ]
    if multi:
        lines.append(f"%y2 = tensor.cast %acc : {out_t} to {y2_t}")
    else:
        lines.append("%y2 = " + _reshape("expand", "%acc", out_t, y2_t, [[0, 1]], [1, n]))
    lines.append(_rows_as_y(spec))
    return _function(spec, lines)


def _dequantizing_reduction(result: str, spec: QLinearSpec, maps: list[str], iterators: list[str], out_t: str,
                            ins: list[str], ins_t: list[str], attr: str, product: list[str],
                            isa: FloatIsa = HARDWARE_FLOAT) -> list[str]:
    """`result = linalg.generic`, zero-initialised: its body dequantizes one code into %w (`_body`), the
    `product` lines make %p from %a and %w, and %p is added to the accumulator. Needs %zero defined."""
    bargs, deq, _ = _body(spec, isa=isa)
    kinds = ", ".join(f'"{it}"' for it in iterators)
    return [
        f"{result}_empty = tensor.empty() : {out_t}",
        f"{result}_init = linalg.fill ins(%zero : f32) outs({result}_empty : {out_t}) -> {out_t}",
        f"{result} = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{kinds}]}}",
        f"    ins({', '.join(ins)} : {', '.join(ins_t)}) outs({result}_init : {out_t}){attr} {{",
        f"  ^bb0({bargs}, %out: f32):",
        *[f"      {line}" for line in deq + product],
        "      %r = arith.addf %out, %p : f32",
        "      linalg.yield %r : f32",
        f"}} -> {out_t}",
    ]


def horizontal_matvec_mlir(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """One activation row in one generic reading the codes, reduced horizontally at each vector step.

    The fallback for shapes the half-group kernel cannot tile (one group per
    row would leave a unit dimension)."""
    if spec.m != 1:
        raise QuantKernelError(f"the fused kernel takes one activation row, got {spec.m}")
    n, k, g, half = spec.n, spec.k, spec.groups, spec.group // 2
    lines, q_t = _codes_by_half(spec)
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    xv_t, out_t, y2_t = (tensor_type(s, "f32") for s in ((g, 2, half), (n,), (1, n)))
    lines += [
        _x_as_rows(spec),
        "%x1 = " + _reshape("collapse", "%x2", tensor_type((1, k), "f32"), tensor_type((k,), "f32"), [[0, 1]], []),
        "%xv = " + _reshape("expand", "%x1", tensor_type((k,), "f32"), xv_t, [[0, 1, 2]], [g, 2, half]),
    ]
    dims = "r, g, b, h"
    maps = ([f"affine_map<({dims}) -> (g, h, b)>", _code_map(spec, dims, "r", "g", "b", "h")]
            + [f"affine_map<({dims}) -> (r, g)>"] * len(scale_ins) + [f"affine_map<({dims}) -> (r)>"])
    attr = f" attrs = {{compilation_info = {_compilation_info(*_tiles(spec))}}}"
    _, _, w = _body(spec, isa=isa)
    lines += ["%zero = arith.constant 0.0 : f32"]
    lines += _dequantizing_reduction(
        "%acc", spec, maps, ["parallel", "reduction", "reduction", "reduction"], out_t,
        ["%xv", "%qw", *scale_ins], [xv_t, q_t, *([_scales_t(spec)] * len(scale_ins))], attr,
        [f"%p = arith.mulf %a, {w} : f32"], isa)
    lines += [
        "%y2 = " + _reshape("expand", "%acc", out_t, y2_t, [[0, 1]], [1, n]),
        _rows_as_y(spec),
    ]
    return _function(spec, lines)


def dequantize_matmul_mlir(spec: QLinearSpec, q4_bytes: bool = True, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """A dequantization generic to a float [N, K] tile, then a matmul: once per call
    (templates/qlinear_dequantize_matmul.mlir).

    Used where the fused generic is the wrong tool: prefill chunks on CPU (M > 1,
    where the pinned IREE runs the fused form far below float32 matmul speed, so
    dequantizing once per chunk costs less CPU per token) and GPU targets (the
    fused form's CPU-sized vectors do not lower to SPIR-V). With constant-expression
    hoisting off (backends/targets.py) the float tile lives only during the call.

    q4_bytes: q4 codes read as bytes, the nibble picked by the half index (a
    shift of 0 or 4): CPU. The i4 bitcast read transposed (byte b, nibble h
    written to [h, b]) is the portable form (GPU targets), and on CPU made
    prefill slower (docs/quantization.md, "The kernels").
    """
    return instantiate("qlinear_dequantize_matmul", name=spec.name, **_shape(spec), q4_bytes=q4_bytes,
                       fma=isa.fma, f16=isa.f16)


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------


def _spec_of(op: ir.Operation) -> QLinearSpec:
    x, codes, scales, mins, fmt, group = op.operands
    x_shape, x_type = shape_and_type(x)
    if x_type != "f32":
        raise QuantKernelError(f"qlinear activations must be f32, got {x_type}")
    (n, _), _ = shape_and_type(codes)
    _, s_type = shape_and_type(scales)
    spec = QLinearSpec(str(constant(fmt)), int(constant(group)), s_type, not is_constant(mins, "none"), x_shape, n)
    if spec.fmt not in ("q8", "q4", "q5") or spec.scale_type not in ("f16", "f32") or spec.k % spec.group:
        raise QuantKernelError(f"no kernel for {spec}")
    if spec.fmt in ("q4", "q5") and not spec.has_min:
        raise QuantKernelError(f"{spec.fmt} qlinear needs mins")
    if spec.fmt == "q5" and spec.group % 16:
        raise QuantKernelError(f"q5 groups are multiples of 16, got {spec.group}")
    return spec


def int8_dot_shape(spec: QLinearSpec, norm: RowNorm | None = None, residual: bool = False,
                   gate: str | None = None, isa: Int8Isa = AVX512_VNNI) -> Int8DotShape:
    """The int8-dot kernel of a site; gate: the gated MLP activation it takes in (int8_decode.GATES), if any."""
    return Int8DotShape(spec.fmt, spec.group, spec.scale_type, spec.has_min, spec.k, spec.n, norm, residual, gate,
                        isa)


def uses_int8_dot(spec: QLinearSpec) -> bool:
    """Whether a one-row call of this shape can take the int8-activation kernel (kernels/int8_decode.py)."""
    return spec.m == 1 and supports_int8_dot(int8_dot_shape(spec))


def _flatten(result: str, src: str, shape: tuple[int, ...]) -> str:
    """`result` = the f32 tensor `src` of `shape` as one dimension."""
    size = 1
    for d in shape:
        size *= d
    src_t, flat_t = tensor_type(shape, "f32"), tensor_type((size,), "f32")
    if len(shape) == 1:
        return f"{result} = tensor.cast {src} : {src_t} to {flat_t}"
    return f"{result} = " + _reshape("collapse", src, src_t, flat_t, [list(range(len(shape)))], [])


def int8_dot_function_name(spec: QLinearSpec, shape: Int8DotShape) -> str:
    """The util.func of a site: spec.name, plus the kernel's fusion suffix (fusion.py) where it fuses."""
    return spec.name + shape.name[len(int8_dot_shape(spec).name):]


def int8_dot_mlir(spec: QLinearSpec, shape: Int8DotShape | None = None) -> list[str]:
    """The int8-activation decode kernel behind the util.func signature: its executable, then the func.

    The func takes (x, codes, scales[, mins]); with a fused norm x is the un-normalized row and
    %w [K] the norm weight follows it; a gated x is the [g, u] row of 2K values; with a fused
    residual %r (y's shape) comes last.
    """
    shape = shape or int8_dot_shape(spec)
    k, n = spec.k, spec.n
    y_shape = (*spec.x_shape[:-1], n)
    x_shape = (*spec.x_shape[:-1], shape.x_len)
    lines = [_flatten("%x1", "%x", x_shape)] + ([_flatten("%r1", "%r", y_shape)] if shape.residual else [])
    lines += [
        int8_dot_dispatch(shape, "%x1", "%codes", "%scales", "%mins" if spec.has_min else None, "%y1",
                          norm_weight="%w" if shape.norm else None, residual="%r1" if shape.residual else None),
        "%y2 = " + _reshape("expand", "%y1", tensor_type((n,), "f32"), tensor_type((1, n), "f32"), [[0, 1]], [1, n]),
        _rows_as_y(spec),
    ]
    params = [f"%x: {tensor_type(x_shape, 'f32')}"] + ([f"%w: {tensor_type((k,), 'f32')}"] if shape.norm else [])
    params += [f"%codes: {_stored_codes_t(spec)}", f"%scales: {_scales_t(spec)}"]
    params += ([f"%mins: {_scales_t(spec)}"] if spec.has_min else [])
    params += [f"%r: {tensor_type(y_shape, 'f32')}"] if shape.residual else []
    return [int8_dot_executable(shape), _function(spec, lines, params, int8_dot_function_name(spec, shape))]


def int8_gemm_shape(spec: QLinearSpec, isa: Int8Isa = AVX512_VNNI) -> Int8GemmShape:
    return Int8GemmShape(spec.fmt, spec.group, spec.scale_type, spec.has_min, spec.m, spec.k, spec.n, isa)


def uses_int8_gemm(spec: QLinearSpec) -> bool:
    """Whether a prefill chunk of this shape can take the int8 GEMM kernel (kernels/int8_gemm.py).

    Only in one-row bundles, whose decode is int8 too (uses_int8_dot). A batched bundle decodes
    its rows with float activations (fused_rows_mlir), and its scheduler may advance a row's next
    token inside another row's prefill call: with int8 prefill products, the same token would then
    meet int8 or float activations depending on what the other rows were doing, and a stream's
    text would depend on its neighbours.
    """
    one_row = len(spec.x_shape) < 3 or spec.x_shape[0] == 1
    return one_row and spec.m > MAX_FUSED_ROWS and supports_int8_gemm(int8_gemm_shape(spec))


def int8_gemm_mlir(spec: QLinearSpec, isa: Int8Isa = AVX512_VNNI) -> list[str]:
    """The int8 prefill kernel behind the usual util.func signature: its two executables, then the func."""
    shape = int8_gemm_shape(spec, isa)
    lines = [
        _x_as_rows(spec),
        *int8_gemm_dispatches(shape, "%x2", "%codes", "%scales", "%mins" if spec.has_min else None, "%y2"),
        _rows_as_y(spec),
    ]
    return [quantize_executable(shape), gemm_executable(shape), _function(spec, lines, _params(spec))]


def expand_qlinear_ops(mlir: str, cpu_tiles: bool, int8: Int8Kernels = FLOAT_KERNELS,
                       float_isa: FloatIsa = HARDWARE_FLOAT) -> tuple[str, Counter[str]]:
    """Replace every foldline::qlinear op in the module text with a call to its kernel.

    cpu_tiles: a CPU target: the fused, tiled kernel for single rows (decode) and
    dequantize-then-matmul for prefill chunks; otherwise dequantize-then-matmul.
    int8: the int8-activation kernels the target's CPU takes (select.choose_kernels), where int8
    activations are asked for: with int8.decode, one-row calls whose shape allows take the
    int8-dot kernel of that ISA (int8_decode.py); with int8.prefill, prefill chunks the int8
    GEMM (int8_gemm.py). Every other call keeps its float kernel, spelt for `float_isa`: the
    FMA and f16 conversion the target's CPU has (mlir.FloatIsa.of; CPU targets only).

    Returns the new module text and how many sites took each kind of kernel.
    """

    def plan(op: ir.Operation) -> KernelCall:
        spec = _spec_of(op)
        x, codes, scales, mins = op.operands[:4]
        dot = norm = gate = residual = None
        if cpu_tiles and int8.decode is not None and uses_int8_dot(spec):
            norm, residual = match_norm(x, spec.k), match_residual(op.results[0])
            gate = None if norm else match_gate(x, spec.k)
            dot = int8_dot_shape(spec, norm.norm if norm else None, residual is not None,
                                 gate.activation if gate else None, int8.decode)
        rows = (*spec.x_shape[:-1],)

        def operands() -> list[ir.Value]:
            row = norm.h if norm else gate.gate_up if gate else x
            made = [builtin_tensor(row, tensor_type((*rows, dot.x_len if dot else spec.k), "f32"))]
            if norm:
                made.append(builtin_tensor(norm.weight, tensor_type((spec.k,), "f32")))
            made += [builtin_tensor(codes, _stored_codes_t(spec)), builtin_tensor(scales, _scales_t(spec))]
            if spec.has_min:
                made.append(builtin_tensor(mins, _scales_t(spec)))
            if residual:
                made.append(builtin_tensor(residual.residual, tensor_type((*rows, spec.n), "f32")))
            return made

        if dot is not None:
            name, kind, code = int8_dot_function_name(spec, dot), f"qlinear decode {dot.isa.name}", \
                (lambda: int8_dot_mlir(spec, dot))
        elif cpu_tiles and int8.prefill is not None and uses_int8_gemm(spec):
            name, kind, code = spec.name, f"qlinear prefill {int8.prefill.name}", \
                (lambda: int8_gemm_mlir(spec, int8.prefill))
        elif cpu_tiles and fuses_rows(spec):
            name, kind, code = spec.name, f"qlinear rows {FLOAT}", lambda: fused_rows_code(spec, float_isa)
        else:
            phase = "decode" if spec.m == 1 else "prefill"
            name, kind, code = spec.name, f"qlinear {phase} {FLOAT}", \
                (lambda: [dequantize_matmul_mlir(spec, q4_bytes=cpu_tiles, isa=float_isa)])
        # The call goes where every operand is defined: at the residual add when it takes one.
        return KernelCall(at=residual.add if residual else op, callee=name, operands=operands,
                          result_type=tensor_type((*rows, spec.n), "f32"),
                          replaces=[residual.add, op] if residual else [op], code=code, kind=kind)

    return rewrite_sites(mlir, (OP_NAME,), plan)
