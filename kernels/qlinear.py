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
  bytes (tests/kernels/test_quant_compile.py checks the dispatches). With several
  rows (decode of a batched bundle) the codes are read once for all of them.
  Why this form, and what IREE does with the alternatives: docs/quantization.md.
  On a CPU without FMA or F16C (`x86-64-v2`) it is spelt with a multiply and
  an add, one row per step, and f32 scales converted by a dispatch before it
  (`mlir.FloatIsa`, `fused_rows_code`);
- decode (1 to MAX_FUSED_ROWS rows: one, or a batched bundle's rows) on a CPU
  with an int8 dot product (x86 AVX2 or VNNI, aarch64 dotprod), int8
  activations asked for (the default there): `int8_dot_mlir`, the hand-written
  int8-dot dispatch of kernels/int8_decode.py, in the target's best form
  (kernels/isa.py), behind the same util.func signature; several rows take its
  few-row form, each row to the bit as one row alone;
- prefill chunks (M rows, M a multiple of 16) on such a CPU, int8 activations
  asked for: `int8_gemm_mlir`, the two hand-written
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
from dataclasses import dataclass, replace

from iree.compiler import ir

from ..contract.block_formats import codes_dims
from .fusion import match_gate, match_norm, match_residual
from .int8_channels import int8_decode_executable
from .int8_channels import supports as supports_channel_lanes
from .int8_decode import (
    Int8DotShape,
    RowNorm,
    dispatch_rows,
    int8_dot_dispatch,
)
from .int8_decode import supports as supports_int8_dot
from .int8_gemm import Int8GemmShape, gemm_executable, int8_gemm_dispatches, quantize_executable
from .int8_gemm import supports as supports_int8_gemm
from .isa import FLOAT, FLOAT_KERNELS, Int8Isa, Int8Kernels
from .mlir import HARDWARE_FLOAT, FloatIsa, tensor_type
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
    long = spec.fmt in ("q8", "q5") or spec.groups >= LONG_ROW_GROUPS  # q5 is read widened to q8's bytes
    for rows in ((ROWS_PER_STEP_LONG, ROWS_PER_STEP) if long else (ROWS_PER_STEP,)):
        if spec.n % rows == 0 and spec.m * rows <= 4:
            return rows
    return 1


def _tiles(spec: QLinearSpec) -> tuple[list[int], list[int], list[int]]:
    """(distribution, vector_common_parallel, vector_reduction) of the horizontal-reduction kernel (M = 1)."""
    g = spec.groups
    gt = 2 if g % 2 == 0 else (3 if g % 3 == 0 else 1)
    return [min(32, spec.n), 0, 0, 0], [1, 0, 0, 0], [0, gt, spec.group // 2, 2]


def _reshape(op: str, src: str, src_t: str, dst_t: str, groups: list[list[int]], shape: list[int]) -> str:
    """The right-hand side of a `tensor.{op}_shape` of `src` (templates/reshape.mlir), for the bodies spelt here."""
    return instantiate("reshape", op=op, src=src, src_type=src_t, dst_type=dst_t, groups=groups, shape=shape)


def _stored_codes_t(spec: QLinearSpec) -> str:
    """The codes as the bundle stores them: what a kernel's util.func takes."""
    return tensor_type(codes_dims(spec.fmt, spec.n, spec.k), "i8")


def _shape(spec: QLinearSpec) -> dict[str, object]:
    """The shape of a site as the qlinear templates take it."""
    return dict(fmt=spec.fmt, group=spec.group, groups=spec.groups, scale_type=spec.scale_type,
                has_min=spec.has_min, x_shape=spec.x_shape, m=spec.m, n=spec.n, k=spec.k,
                stored_codes=codes_dims(spec.fmt, spec.n, spec.k))


def _scales_t(spec: QLinearSpec) -> str:
    return tensor_type((spec.n, spec.groups), spec.scale_type)


def _x_as_rows(spec: QLinearSpec) -> str:
    """%x2: the activation x [..., K] as [M, K] (templates/qlinear_x_rows.mlir)."""
    return instantiate("qlinear_x_rows", **_shape(spec), pad="")


def _rows_as_y(spec: QLinearSpec) -> str:
    """%y: the result %y2 [M, N] as [..., N], the activation's leading shape (templates/qlinear_y_rows.mlir)."""
    return instantiate("qlinear_y_rows", **_shape(spec), pad="")


def _params(spec: QLinearSpec) -> list[str]:
    """(x, codes, scales[, mins]): the util.func parameters of a site, the codes as stored."""
    params = [f"%x: {tensor_type(spec.x_shape, 'f32')}", f"%codes: {_stored_codes_t(spec)}",
              f"%scales: {_scales_t(spec)}"]
    return params + ([f"%mins: {_scales_t(spec)}"] if spec.has_min else [])


def _function(spec: QLinearSpec, lines: list[str], params: list[str], name: str | None = None) -> str:
    """The util.func @name (default spec.name) taking `params`, of these body lines, returning %y
    (templates/qlinear_function.mlir)."""
    return instantiate("qlinear_function", name=name or spec.name, params=params, lines=lines,
                       x_shape=spec.x_shape, n=spec.n)


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
    widen = [_widen_scales_executable(spec.n * spec.groups, 1 + spec.has_min)] if (
        half_group and _converts_scales(spec, isa)) else []
    return [*widen, fused_rows_mlir(spec, isa)]


WIDEN_LANES = 8  # f16 values one vector step of the scale conversion takes (two SSE registers of f32)
WIDEN_WORKGROUPS = 8


def _widen_scales_name(size: int, count: int) -> str:
    """The symbol of `_widen_scales_executable(size, count)`."""
    return f"foldline_widen_f16_{size}x{count}"


def _widen_scales_executable(size: int, count: int) -> str:
    """The `stream.executable` converting `count` arrays of `size` f16 bit patterns (i16) to f32
    (templates/widen_f16_executable.mlir).

    Hand-written, as kernels/attention.py: IREE's own dispatch of the same generic drops the
    tiles it is given and masks every vector of a partial tile element by element.
    """
    return instantiate("widen_f16_executable", name=_widen_scales_name(size, count), size=size, count=count,
                       lanes=WIDEN_LANES, workgroups=WIDEN_WORKGROUPS)


def _converts_scales(spec: QLinearSpec, isa: FloatIsa) -> bool:
    """Whether the half-group kernel reads f32 scales converted by `_widen_scales_executable`: f16 scales
    on a CPU without F16C, N x G a whole number of vector steps per workgroup (else it converts them
    in its loop).

    Without f16 conversion in hardware the kernel's body then reads f32 scales instead of converting
    each (row, group)'s scale and min in integer code inside its reduction, a third of the loop's
    instructions on SmolLM2's Q4_1 rows (docs/quantization.md). The halves cross as i16: SSE has
    no f16 vector loads (LLVM would insert them one at a time).
    """
    return (spec.scale_type == "f16" and not isa.f16
            and (spec.n * spec.groups) % (WIDEN_LANES * WIDEN_WORKGROUPS) == 0)


def _half_group_tiles(spec: QLinearSpec, isa: FloatIsa) -> tuple[list[int], list[int], list[int]]:
    """(distribution, vector_common_parallel, vector_reduction) of the half-group kernel: a workgroup per
    ROWS_PER_WORKGROUP output rows, `_rows_per_step` rows (of every activation row) and all lanes per
    vector step, one group per reduction step."""
    lanes, rows = spec.group // 2, _rows_per_step(spec, isa)
    if spec.m > 1:
        return [spec.m, min(ROWS_PER_WORKGROUP, spec.n), 0, 0], [spec.m, rows, lanes, 0], [0, 0, 0, 1]
    return [min(ROWS_PER_WORKGROUP, spec.n), 0, 0], [rows, lanes, 0], [0, 0, 1]


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
    The kernel is templates/qlinear_half_group.mlir.
    """
    lanes = _half_lanes(spec)
    if lanes is None or not 1 <= spec.m <= MAX_FUSED_ROWS:
        raise QuantKernelError(f"the half-group kernel takes 1..{MAX_FUSED_ROWS} rows and two or more groups of "
                               f"an even size, got {spec.m} rows, group {spec.group}, {spec.groups} groups")
    distribution, parallel, reduction = _half_group_tiles(spec, isa)
    widen = _widen_scales_name(spec.n * spec.groups, 1 + spec.has_min) if _converts_scales(spec, isa) else None
    return instantiate("qlinear_half_group", name=spec.name, **_shape(spec), lanes=lanes, distribution=distribution,
                       parallel=parallel, reduction=reduction, widen_scales=widen, fma=isa.fma, f16=isa.f16)


def horizontal_matvec_mlir(spec: QLinearSpec, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """One activation row in one generic reading the codes, reduced horizontally at each vector step
    (templates/qlinear_horizontal_matvec.mlir).

    The fallback for shapes the half-group kernel cannot tile (one group per
    row would leave a unit dimension)."""
    if spec.m != 1:
        raise QuantKernelError(f"the fused kernel takes one activation row, got {spec.m}")
    distribution, parallel, reduction = _tiles(spec)
    return instantiate("qlinear_horizontal_matvec", name=spec.name, **_shape(spec), distribution=distribution,
                       parallel=parallel, reduction=reduction, f16=isa.f16)


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
                   gate: str | None = None, isa: Int8Isa = AVX512_VNNI, channel_lanes: bool = False) -> Int8DotShape:
    """The int8-dot kernel of a site, over as many of its rows per dispatch as fit (int8_decode.dispatch_rows);
    gate: the gated MLP activation it takes in (int8_decode.GATES), if any; channel_lanes: the channel-lane
    kernel (kernels/int8_channels.py) where it takes the shape, for every row count alike."""
    one = Int8DotShape(spec.fmt, spec.group, spec.scale_type, spec.has_min, spec.k, spec.n, norm, residual, gate, isa)
    if channel_lanes and supports_channel_lanes(replace(one, channel_lanes=True)):
        one = replace(one, channel_lanes=True)
    return replace(one, rows=dispatch_rows(one, spec.m)) if spec.m > 1 else one


def uses_int8_dot(spec: QLinearSpec) -> bool:
    """Whether a call of this shape (1 to MAX_FUSED_ROWS rows: decode, or a prefill chunk as short) can take
    the int8-activation kernel (kernels/int8_decode.py): a batched bundle's k-row entry points take it for
    exactly the sites its 1-row entry point does, the shape being the same but for the rows."""
    return 1 <= spec.m <= MAX_FUSED_ROWS and supports_int8_dot(int8_dot_shape(spec))


def _flatten(result: str, src: str, shape: tuple[int, ...]) -> str:
    """`result` = the f32 tensor `src` of `shape` as one dimension (templates/flatten.mlir)."""
    size = 1
    for d in shape:
        size *= d
    return instantiate("flatten", result=result, src=src, shape=shape, size=size)


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
    k, n, m = spec.k, spec.n, spec.m
    y_shape = (*spec.x_shape[:-1], n)
    x_shape = (*spec.x_shape[:-1], shape.x_len)
    lines = [_flatten("%x1", "%x", x_shape)] + ([_flatten("%r1", "%r", y_shape)] if shape.residual else [])
    lines += _int8_dot_calls(spec, shape)
    lines += [
        "%y2 = " + _reshape("expand", "%y1", tensor_type((m * n,), "f32"), tensor_type((m, n), "f32"), [[0, 1]],
                            [m, n]),
        _rows_as_y(spec),
    ]
    params = [f"%x: {tensor_type(x_shape, 'f32')}"] + ([f"%w: {tensor_type((k,), 'f32')}"] if shape.norm else [])
    params += [f"%codes: {_stored_codes_t(spec)}", f"%scales: {_scales_t(spec)}"]
    params += ([f"%mins: {_scales_t(spec)}"] if spec.has_min else [])
    params += [f"%r: {tensor_type(y_shape, 'f32')}"] if shape.residual else []
    return [int8_decode_executable(shape), _function(spec, lines, params, int8_dot_function_name(spec, shape))]


def _int8_dot_calls(spec: QLinearSpec, shape: Int8DotShape) -> list[str]:
    """%y1 [M*N] from %x1 [M*x_len] (and %r1 [M*N]): one dispatch of shape.rows rows, or where the rows'
    stack does not fit, one per slice of shape.rows rows, put together in row order."""
    m, n, rows = spec.m, spec.n, shape.rows
    mins = "%mins" if spec.has_min else None
    norm_weight = "%w" if shape.norm else None
    if rows == m:
        return [int8_dot_dispatch(shape, "%x1", "%codes", "%scales", mins, "%y1", norm_weight=norm_weight,
                                  residual="%r1" if shape.residual else None)]
    dispatches = [int8_dot_dispatch(shape, f"%xs{i}", "%codes", "%scales", mins, f"%ys{i}", norm_weight=norm_weight,
                                    residual=f"%rs{i}" if shape.residual else None) for i in range(m // rows)]
    return instantiate("qlinear_row_slices", m=m, n=n, rows=rows, x_len=shape.x_len, residual=shape.residual,
                       dispatches=dispatches).split("\n")


def int8_gemm_shape(spec: QLinearSpec, isa: Int8Isa = AVX512_VNNI) -> Int8GemmShape:
    return Int8GemmShape(spec.fmt, spec.group, spec.scale_type, spec.has_min, spec.m, spec.k, spec.n, isa)


def uses_int8_gemm(spec: QLinearSpec) -> bool:
    """Whether a prefill chunk of this shape can take the int8 GEMM kernel (kernels/int8_gemm.py).

    Batched bundles too: their rows decode with the int8 kernels (uses_int8_dot), and a caller
    may still feed a row's next token in a prefill call (runtime/batch.py; the scheduler does
    not), where the GEMM quantizes that row as the decode kernel does (int8_decode.quantize_group).
    """
    return spec.m > MAX_FUSED_ROWS and supports_int8_gemm(int8_gemm_shape(spec))


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
                                 gate.activation if gate else None, int8.decode, int8.channel_lanes)
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
            lanes = " channel-lanes" if dot.channel_lanes else ""
            name, kind, code = int8_dot_function_name(spec, dot), f"qlinear decode {dot.isa.name}{lanes}", \
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
        return KernelCall(at=ir.InsertionPoint(residual.add if residual else op), callee=name, operands=operands,
                          result_type=tensor_type((*rows, spec.n), "f32"),
                          replaces=[residual.add, op] if residual else [op], code=code, kind=kind)

    return rewrite_sites(mlir, (OP_NAME,), plan)
