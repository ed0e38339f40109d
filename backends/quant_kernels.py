"""Kernels for `foldline::qlinear`, generated as linalg per shape and entry point.

The importer keeps `foldline::qlinear` out of the aten decompositions, so it
reaches MLIR as `torch.operator "torch.foldline.qlinear"`. `expand_qlinear_ops`
replaces each one with a `util.call` to a generated `util.func`:

- decode (one activation row) on CPU: `fused_matvec_mlir`, a generic that
  reads the narrow codes and dequantizes one element at a time in its body,
  keeping 16 partial sums per output row in a vector register (the lane is a
  parallel dimension), then a small generic adding the lanes:

      q4 codes (i8 param [N, K/2]) -> expand [N, G, j, 8] -> flow.tensor.bitcast -> i4 [N, G, j, 16]
      part[n, l] += fma(x[g, j, l], scale[n, g] * float(q[n, g, j, l]) (+ min[n, g]), 0)
      y[n] = sum_l part[n, l]

  There is no separate dequantization op to hoist or materialise: no float
  copy of the weight exists, and each decode step reads only the quantized
  bytes (tests/test_quant_compile.py checks the dispatches). Why this form,
  and what IREE does with the alternatives: docs/quantization.md;
- decode of a batched bundle (2 to 8 rows) on CPU: `multirow_lane_partials_mlir`,
  the same form with a row dimension, the codes read once for all rows;
- prefill chunks (more rows) on CPU, and every call on GPU targets:
  `dequantize_matmul_mlir`, the weight dequantized into a float tile once per
  call and multiplied by all M rows. On SmolLM2 this took 7.8 CPU ms per
  prefill token against 30.9 for the fused form at M = 16 (llama.cpp: 7.4); the
  fused form's CPU-sized vectors do not lower to SPIR-V. CPU modules compile
  without constant-expression hoisting, so the tile is never moved into a
  load-time float copy of every weight.

Alternatives measured with IREE 3.13 on this machine:

- a dequant generic followed by a matmul for decode is not fused by default
  (`--iree-dispatch-creation-block-matmul-producer-fusion`, on in 3.13); with
  the fusion forced it runs 5-17x slower than the fused matvec;
- nibble unpacking with shifts and masks in the torch graph is never fused;
  torch.uint4 does not import;
- dequantizing to [N, K] with a block-scale map `k floordiv g` stops the
  vectorizer.

CPU modules are compiled with `--iree-llvmcpu-reassociate-fp-reductions=true`
(backends/targets.py): without it each reduction is a chain of scalar adds and
the fused kernel runs 3.5-9x slower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from iree.compiler import ir

OP_NAME = "torch.foldline.qlinear"
_VTENSOR = re.compile(r"!torch\.vtensor<\[([0-9,]*)\],(\w+)>")


class QuantKernelError(ValueError):
    """A foldline::qlinear site this generator cannot express."""


@dataclass(frozen=True)
class QLinearSpec:
    """Everything that shapes one generated kernel."""

    fmt: str  # "q8" or "q4"
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


# The decode kernel keeps LANES partial sums per output row in one vector register and
# reduces them once at the end; ROWS rows per vector step give independent add chains.
LANES = 16
ROWS_PER_STEP = 2
ROWS_PER_WORKGROUP = 32
# Activation rows the fused form takes (decode of a bundle compiled with --batch up to this).
MAX_FUSED_ROWS = 8


def _lanes(spec: QLinearSpec) -> int | None:
    """Lanes for the lane-partials kernel, or None where its dims would be unit (IREE then drops the tiles)."""
    for lanes in (LANES, 8):
        if spec.group % lanes == 0 and spec.group // lanes >= 2 and spec.groups >= 2:
            return lanes
    return None


def _tiles(spec: QLinearSpec) -> tuple[list[int], list[int], list[int]]:
    """(distribution, vector_common_parallel, vector_reduction) of the horizontal-reduction kernel (M = 1)."""
    g = spec.groups
    gt = 2 if g % 2 == 0 else (3 if g % 3 == 0 else 1)
    return [min(32, spec.n), 0, 0], [1, 0, 0], [0, gt, spec.group]


def _compilation_info(distribution: list[int], parallel: list[int], reduction: list[int]) -> str:
    return (f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {distribution}, vector_common_parallel = {parallel}, vector_reduction = {reduction}>, "
            f"translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _body(spec: QLinearSpec) -> tuple[str, list[str], str]:
    """(block arguments, dequantization lines, the value holding the weight element) of the body."""
    st = spec.scale_type
    args = ["%a: f32", f"%q: {'i4' if spec.fmt == 'q4' else 'i8'}", f"%s: {st}"] + ([f"%mn: {st}"] if spec.has_min else [])
    if spec.fmt == "q4":
        lines = ["%qi = arith.extui %q : i4 to i32", "%qf = arith.uitofp %qi : i32 to f32"]
    else:
        lines = ["%qf = arith.sitofp %q : i8 to f32"]
    scale = "%s"
    if st == "f16":
        lines.append("%sf = arith.extf %s : f16 to f32")
        scale = "%sf"
    lines.append(f"%w0 = arith.mulf {scale}, %qf : f32")
    if not spec.has_min:
        return ", ".join(args), lines, "%w0"
    low = "%mn"
    if st == "f16":
        lines.append("%mf = arith.extf %mn : f16 to f32")
        low = "%mf"
    lines.append(f"%w = arith.addf %w0, {low} : f32")
    return ", ".join(args), lines, "%w"


def _reshape(op: str, src: str, src_t: str, dst_t: str, groups: list[list[int]], shape: list[int]) -> str:
    if op == "expand":
        return f"tensor.expand_shape {src} {groups} output_shape {shape} : {src_t} into {dst_t}"
    return f"tensor.collapse_shape {src} {groups} : {src_t} into {dst_t}"


def _tensor(shape: tuple[int, ...] | list[int], element: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{element}>"


def _codes_t(spec: QLinearSpec) -> str:
    return _tensor((spec.n, spec.k // 2 if spec.fmt == "q4" else spec.k), "i8")


def _scales_t(spec: QLinearSpec) -> str:
    return _tensor((spec.n, spec.groups), spec.scale_type)


def _codes_by_group(spec: QLinearSpec) -> tuple[list[str], str]:
    """Lines making %qw, the codes as [N, G, g] (q4: bitcast to i4, no data movement), and its type."""
    n, g, gs = spec.n, spec.groups, spec.group
    if spec.fmt == "q4":
        packed_t, q_t = _tensor((n, g, gs // 2), "i8"), _tensor((n, g, gs), "i4")
        return ["%c3 = " + _reshape("expand", "%codes", _codes_t(spec), packed_t, [[0], [1, 2]], [n, g, gs // 2]),
                f"%qw = flow.tensor.bitcast %c3 : {packed_t} -> {q_t}"], q_t
    q_t = _tensor((n, g, gs), "i8")
    return ["%qw = " + _reshape("expand", "%codes", _codes_t(spec), q_t, [[0], [1, 2]], [n, g, gs])], q_t


def _codes_by_lane(spec: QLinearSpec, lanes: int) -> tuple[list[str], str]:
    """Lines making %qw, the codes as [N, G, j, lanes] (q4: bitcast to i4, no data movement), and its type."""
    n, g, js = spec.n, spec.groups, spec.group // lanes
    if spec.fmt == "q4":
        packed_t, q_t = _tensor((n, g, js, lanes // 2), "i8"), _tensor((n, g, js, lanes), "i4")
        return ["%c4 = " + _reshape("expand", "%codes", _codes_t(spec), packed_t, [[0], [1, 2, 3]], [n, g, js, lanes // 2]),
                f"%qw = flow.tensor.bitcast %c4 : {packed_t} -> {q_t}"], q_t
    q_t = _tensor((n, g, js, lanes), "i8")
    return ["%qw = " + _reshape("expand", "%codes", _codes_t(spec), q_t, [[0], [1, 2, 3]], [n, g, js, lanes])], q_t


def _x_as_rows(spec: QLinearSpec) -> str:
    """%x2: the activation x [..., K] as [M, K]."""
    lead, x_t, x2_t = len(spec.x_shape) - 1, _tensor(spec.x_shape, "f32"), _tensor((spec.m, spec.k), "f32")
    if lead == 0:
        return "%x2 = " + _reshape("expand", "%x", x_t, x2_t, [[0, 1]], [1, spec.k])
    if lead == 1:
        return f"%x2 = tensor.cast %x : {x_t} to {x2_t}"
    return "%x2 = " + _reshape("collapse", "%x", x_t, x2_t, [list(range(lead)), [lead]], [])


def _rows_as_y(spec: QLinearSpec) -> str:
    """%y: the result %y2 [M, N] as [..., N], the activation's leading shape."""
    lead, y2_t = len(spec.x_shape) - 1, _tensor((spec.m, spec.n), "f32")
    y_shape = [*spec.x_shape[:-1], spec.n]
    y_t = _tensor(y_shape, "f32")
    if lead == 0:
        return "%y = " + _reshape("collapse", "%y2", y2_t, y_t, [[0, 1]], [])
    if lead == 1:
        return f"%y = tensor.cast %y2 : {y2_t} to {y_t}"
    return "%y = " + _reshape("expand", "%y2", y2_t, y_t, [list(range(lead)), [lead]], y_shape)


def _function(spec: QLinearSpec, lines: list[str]) -> str:
    params = [f"%x: {_tensor(spec.x_shape, 'f32')}", f"%codes: {_codes_t(spec)}", f"%scales: {_scales_t(spec)}"]
    if spec.has_min:
        params.append(f"%mins: {_scales_t(spec)}")
    y_t = _tensor((*spec.x_shape[:-1], spec.n), "f32")
    body = "\n  ".join(lines)
    return f"util.func private @{spec.name}({', '.join(params)}) -> {y_t} {{\n  {body}\n  util.return %y : {y_t}\n}}"


def fused_matvec_mlir(spec: QLinearSpec) -> str:
    """The decode kernel for one activation row: lane partials where the shape allows, else horizontal sums."""
    lanes = _lanes(spec)
    return lane_partials_matvec_mlir(spec, lanes) if lanes else horizontal_matvec_mlir(spec)


def fuses_rows(spec: QLinearSpec) -> bool:
    """Whether a CPU call of this shape reads the codes in its reduction instead of dequantizing a float tile.

    One row (decode), or up to MAX_FUSED_ROWS rows (decode of a batched
    bundle) where the lane-partials form applies; longer prefill chunks
    dequantize once per call and run a matmul.
    """
    return spec.m == 1 or (spec.m <= MAX_FUSED_ROWS and _lanes(spec) is not None)


def fused_rows_mlir(spec: QLinearSpec) -> str:
    """The fused decode kernel for spec.m rows: one row, or a few rows sharing each dequantized code."""
    return fused_matvec_mlir(spec) if spec.m == 1 else multirow_lane_partials_mlir(spec)


def _dequantizing_reduction(result: str, spec: QLinearSpec, maps: list[str], iterators: list[str], out_t: str,
                            ins: list[str], ins_t: list[str], attr: str, product: list[str]) -> list[str]:
    """`result = linalg.generic`, zero-initialised: its body dequantizes one code into %w (`_body`), the
    `product` lines make %p from %a and %w, and %p is added to the accumulator. Needs %zero defined."""
    bargs, deq, _ = _body(spec)
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


def lane_partials_matvec_mlir(spec: QLinearSpec, lanes: int = LANES) -> str:
    """One activation row through LANES partial sums per output row, then one sum over the lanes.

    The reduction over K is split as (g, j, l), l the LANES codes one vector
    load brings; l is a parallel dimension of the first generic, so each vector
    step is elementwise: widen the codes, scale (+ min), multiply by x and add
    into a register that lives across the whole row. No horizontal reduction
    runs inside the loop (the form below needs one per step, and its chain of
    dependent adds bounded the speed). The products are written as
    `math.fma(x, w, 0)`: a plain mulf+addf body is recognised as a contraction
    and lowered lane by lane. No operand may have a unit dimension: IREE's
    unit-dim folding rebuilds the generic without its compilation_info.
    """
    if spec.m != 1:
        raise QuantKernelError(f"the fused kernel takes one activation row, got {spec.m}")
    n, k, g, gs = spec.n, spec.k, spec.groups, spec.group
    js = gs // lanes
    lines, q_t = _codes_by_lane(spec, lanes)
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    x1_t, xv_t, part_t, out_t, y2_t = (_tensor(sh, "f32") for sh in ((k,), (g, js, lanes), (n, lanes), (n,), (1, n)))
    lines += [_x_as_rows(spec),
              "%x1 = " + _reshape("collapse", "%x2", _tensor((1, k), "f32"), x1_t, [[0, 1]], []),
              "%xv = " + _reshape("expand", "%x1", x1_t, xv_t, [[0, 1, 2]], [g, js, lanes])]
    # iteration (row, lane | group, step): parallel dims first, reductions innermost, as IREE keeps them
    maps = (["affine_map<(r, l, g, j) -> (g, j, l)>", "affine_map<(r, l, g, j) -> (r, g, j, l)>"]
            + ["affine_map<(r, l, g, j) -> (r, g)>"] * len(scale_ins) + ["affine_map<(r, l, g, j) -> (r, l)>"])
    rows = ROWS_PER_STEP if n % ROWS_PER_STEP == 0 else 1
    info = _compilation_info([min(ROWS_PER_WORKGROUP, n), 0, 0, 0], [rows, lanes, 0, 0], [0, 0, 1, 1])
    _, _, w = _body(spec)
    lines += ["%zero = arith.constant 0.0 : f32"]
    lines += _dequantizing_reduction(
        "%part", spec, maps, ["parallel", "parallel", "reduction", "reduction"], part_t,
        ["%xv", "%qw", *scale_ins], [xv_t, q_t, *([_scales_t(spec)] * len(scale_ins))],
        f" attrs = {{compilation_info = {info}}}",
        ["%z = arith.constant 0.0 : f32", f"%p = math.fma %a, {w}, %z : f32"])
    lines += [
        f"%empty = tensor.empty() : {out_t}",
        f"%init = linalg.fill ins(%zero : f32) outs(%empty : {out_t}) -> {out_t}",
        "%acc = linalg.generic {indexing_maps = [affine_map<(r, l) -> (r, l)>, affine_map<(r, l) -> (r)>], "
        'iterator_types = ["parallel", "reduction"]}',
        f"    ins(%part : {part_t}) outs(%init : {out_t}) {{",
        "  ^bb0(%v: f32, %o: f32):",
        "      %t = arith.addf %o, %v : f32",
        "      linalg.yield %t : f32",
        f"}} -> {out_t}",
        "%y2 = " + _reshape("expand", "%acc", out_t, y2_t, [[0, 1]], [1, n]),
        _rows_as_y(spec),
    ]
    return _function(spec, lines)


def multirow_lane_partials_mlir(spec: QLinearSpec) -> str:
    """The lane-partials kernel for M > 1 activation rows (decode of a batched bundle).

    Iteration (m, r, l | g, j): every row m of a tile keeps its own LANES
    partial sums for output row r, and the codes of (r, g, j) are read once for
    all M rows. Dequantizing a float tile instead writes an f32 copy of the
    weight on every call: for SmolLM2's 49152 x 576 Q8_0 head at batch 8 that
    copy alone took 22 of the 81 ms decode step. M is never 1 here (IREE's
    unit-dim folding would drop the tiles; one row takes the kernel above).
    """
    lanes = _lanes(spec)
    m, n, k, g, gs = spec.m, spec.n, spec.k, spec.groups, spec.group
    if not 1 < m <= MAX_FUSED_ROWS or lanes is None:
        raise QuantKernelError(f"the multi-row kernel takes 2..{MAX_FUSED_ROWS} rows in groups of whole lanes, "
                               f"got {m} rows, group {gs}")
    js = gs // lanes
    lines, q_t = _codes_by_lane(spec, lanes)
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    x2_t, xv_t, part_t, y2_t = (_tensor(sh, "f32") for sh in ((m, k), (m, g, js, lanes), (m, n, lanes), (m, n)))
    lines += [_x_as_rows(spec),
              "%xv = " + _reshape("expand", "%x2", x2_t, xv_t, [[0], [1, 2, 3]], [m, g, js, lanes])]
    maps = (["affine_map<(b, r, l, g, j) -> (b, g, j, l)>", "affine_map<(b, r, l, g, j) -> (r, g, j, l)>"]
            + ["affine_map<(b, r, l, g, j) -> (r, g)>"] * len(scale_ins) + ["affine_map<(b, r, l, g, j) -> (b, r, l)>"])
    rows = ROWS_PER_STEP if m * ROWS_PER_STEP <= 4 and n % ROWS_PER_STEP == 0 else 1
    info = _compilation_info([m, min(ROWS_PER_WORKGROUP, n), 0, 0, 0], [m, rows, lanes, 0, 0], [0, 0, 0, 1, 1])
    _, _, w = _body(spec)
    lines += ["%zero = arith.constant 0.0 : f32"]
    lines += _dequantizing_reduction(
        "%part", spec, maps, ["parallel", "parallel", "parallel", "reduction", "reduction"], part_t,
        ["%xv", "%qw", *scale_ins], [xv_t, q_t, *([_scales_t(spec)] * len(scale_ins))],
        f" attrs = {{compilation_info = {info}}}",
        ["%z = arith.constant 0.0 : f32", f"%p = math.fma %a, {w}, %z : f32"])
    lines += [
        f"%empty = tensor.empty() : {y2_t}",
        f"%init = linalg.fill ins(%zero : f32) outs(%empty : {y2_t}) -> {y2_t}",
        "%y2 = linalg.generic {indexing_maps = [affine_map<(b, r, l) -> (b, r, l)>, affine_map<(b, r, l) -> (b, r)>], "
        'iterator_types = ["parallel", "parallel", "reduction"]}',
        f"    ins(%part : {part_t}) outs(%init : {y2_t}) {{",
        "  ^bb0(%v: f32, %o: f32):",
        "      %t = arith.addf %o, %v : f32",
        "      linalg.yield %t : f32",
        f"}} -> {y2_t}",
        _rows_as_y(spec),
    ]
    return _function(spec, lines)


def horizontal_matvec_mlir(spec: QLinearSpec) -> str:
    """One activation row in one generic reading the codes, reduced horizontally at each vector step.

    The fallback for shapes the lane-partials kernel cannot tile (groups of 16
    with 8 lanes would leave a unit dimension)."""
    if spec.m != 1:
        raise QuantKernelError(f"the fused kernel takes one activation row, got {spec.m}")
    n, k, g, gs = spec.n, spec.k, spec.groups, spec.group
    lines, q_t = _codes_by_group(spec)
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    x3_t, xv_t, out_t, y2_t = (_tensor(s, "f32") for s in ((1, g, gs), (g, gs), (n,), (1, n)))
    lines += [
        _x_as_rows(spec),
        "%x3 = " + _reshape("expand", "%x2", _tensor((1, k), "f32"), x3_t, [[0], [1, 2]], [1, g, gs]),
        "%xv = " + _reshape("collapse", "%x3", x3_t, xv_t, [[0, 1], [2]], []),
    ]
    maps = (["affine_map<(d0, d1, d2) -> (d1, d2)>", "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"]
            + ["affine_map<(d0, d1, d2) -> (d0, d1)>"] * len(scale_ins) + ["affine_map<(d0, d1, d2) -> (d0)>"])
    attr = f" attrs = {{compilation_info = {_compilation_info(*_tiles(spec))}}}"
    _, _, w = _body(spec)
    lines += ["%zero = arith.constant 0.0 : f32"]
    lines += _dequantizing_reduction(
        "%acc", spec, maps, ["parallel", "reduction", "reduction"], out_t,
        ["%xv", "%qw", *scale_ins], [xv_t, q_t, *([_scales_t(spec)] * len(scale_ins))], attr,
        [f"%p = arith.mulf %a, {w} : f32"])
    lines += [
        "%y2 = " + _reshape("expand", "%acc", out_t, y2_t, [[0, 1]], [1, n]),
        _rows_as_y(spec),
    ]
    return _function(spec, lines)


def dequantize_matmul_mlir(spec: QLinearSpec) -> str:
    """A dequantization generic to a float [N, K] tile, then a matmul: once per call.

    Used where the fused generic is the wrong tool: prefill chunks on CPU (M > 1,
    where IREE 3.13 runs the fused form at a third of float32 matmul speed, while
    dequantizing once per chunk costs ~4x less CPU per token) and GPU targets (the
    fused form's CPU-sized vectors do not lower to SPIR-V). With constant-expression
    hoisting off (backends/targets.py) the float tile lives only during the call.
    """
    m, n, k, g, gs = spec.m, spec.n, spec.k, spec.groups, spec.group
    lines, q_t = _codes_by_group(spec)
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    w3_t, w_t, x2_t, y2_t = (_tensor(s, "f32") for s in ((n, g, gs), (n, k), (m, k), (m, n)))
    bargs, deq, w = _body(spec)
    maps = (["affine_map<(d0, d1, d2) -> (d0, d1, d2)>"] + ["affine_map<(d0, d1, d2) -> (d0, d1)>"] * len(scale_ins)
            + ["affine_map<(d0, d1, d2) -> (d0, d1, d2)>"])
    lines += [
        f"%wempty = tensor.empty() : {w3_t}",
        f"%w3 = linalg.generic {{indexing_maps = [{', '.join(maps)}], "
        'iterator_types = ["parallel", "parallel", "parallel"]}',
        f"    ins({', '.join(['%qw', *scale_ins])} : {', '.join([q_t, *([_scales_t(spec)] * len(scale_ins))])}) "
        f"outs(%wempty : {w3_t}) {{",
        f"  ^bb0({bargs.replace('%a: f32, ', '')}, %o: f32):",
        *[f"      {line}" for line in deq],
        f"      linalg.yield {w} : f32",
        f"}} -> {w3_t}",
        "%w = " + _reshape("collapse", "%w3", w3_t, w_t, [[0], [1, 2]], []),
        _x_as_rows(spec),
        "%zero = arith.constant 0.0 : f32",
        f"%yempty = tensor.empty() : {y2_t}",
        f"%yfill = linalg.fill ins(%zero : f32) outs(%yempty : {y2_t}) -> {y2_t}",
        "%y2 = linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, "
        "affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]",
        f"    ins(%x2, %w : {x2_t}, {w_t}) outs(%yfill : {y2_t}) -> {y2_t}",
        _rows_as_y(spec),
    ]
    return _function(spec, lines)


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------


def _shape_and_type(value: ir.Value) -> tuple[tuple[int, ...], str]:
    m = _VTENSOR.match(str(value.type))
    if m is None:
        raise QuantKernelError(f"qlinear operand has unsupported type {value.type}")
    dims = tuple(int(d) for d in m.group(1).split(",") if d)
    return dims, m.group(2)


def _owner(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    return getattr(owner, "operation", owner) if isinstance(owner, (ir.Operation, ir.OpView)) else None


def _constant(value: ir.Value) -> object:
    """The Python value of a torch.constant.{int,str,none} operand."""
    op = _owner(value)
    if op is None or not op.name.startswith("torch.constant."):
        raise QuantKernelError(f"qlinear expects a constant here, got {value}")
    if op.name == "torch.constant.none":
        return None
    attr = op.attributes["value"]
    return ir.StringAttr(attr).value if op.name == "torch.constant.str" else ir.IntegerAttr(attr).value


def _builtin(value: ir.Value, want: str) -> ir.Value:
    """The builtin tensor behind a !torch.vtensor operand (a weight's util.global.load, else a cast)."""
    op = _owner(value)
    if op is not None and op.name == "torch_c.from_builtin_tensor":
        return op.operands[0]
    return ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(want)], operands=[value]).result


def _spec_of(op: ir.Operation) -> QLinearSpec:
    x, codes, scales, mins, fmt, group = op.operands
    x_shape, x_type = _shape_and_type(x)
    if x_type != "f32":
        raise QuantKernelError(f"qlinear activations must be f32, got {x_type}")
    (n, _), _ = _shape_and_type(codes)
    _, s_type = _shape_and_type(scales)
    mins_op = _owner(mins)
    has_min = not (mins_op is not None and mins_op.name == "torch.constant.none")
    spec = QLinearSpec(str(_constant(fmt)), int(_constant(group)), s_type, has_min, x_shape, n)
    if spec.fmt not in ("q8", "q4") or spec.scale_type not in ("f16", "f32") or spec.k % spec.group:
        raise QuantKernelError(f"no kernel for {spec}")
    if spec.fmt == "q4" and not spec.has_min:
        raise QuantKernelError("q4 qlinear needs mins")
    return spec


def expand_qlinear_ops(mlir: str, cpu_tiles: bool) -> tuple[str, int]:
    """Replace every foldline::qlinear op in the module text with a call to its kernel.

    cpu_tiles: a CPU target: the fused, tiled kernel for single rows (decode) and
    dequantize-then-matmul for prefill chunks; otherwise dequantize-then-matmul.

    Returns the new module text and the number of sites rewritten.
    """
    if OP_NAME not in mlir:
        return mlir, 0
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(mlir)
        found: list[ir.Operation] = []

        def visit(op):
            if op.name == "torch.operator" and ir.StringAttr(op.attributes["name"]).value in (OP_NAME,
                                                                                              OP_NAME + ".default"):
                found.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        kernels: dict[str, QLinearSpec] = {}
        for op in found:
            spec = _spec_of(op)
            x, codes, scales, mins = op.operands[:4]
            with ir.InsertionPoint(op), op.location:
                operands = [_builtin(x, _tensor(spec.x_shape, "f32")), _builtin(codes, _codes_t(spec)),
                            _builtin(scales, _scales_t(spec))]
                if spec.has_min:
                    operands.append(_builtin(mins, _scales_t(spec)))
                call = ir.Operation.create(
                    "util.call", results=[ir.Type.parse(_tensor((*spec.x_shape[:-1], spec.n), "f32"))],
                    operands=operands, attributes={"callee": ir.FlatSymbolRefAttr.get(spec.name)})
                back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type],
                                           operands=[call.result])
            op.results[0].replace_all_uses_with(back.result)
            op.erase()
            kernels[spec.name] = spec
        for spec in kernels.values():
            text = fused_rows_mlir(spec) if cpu_tiles and fuses_rows(spec) else dequantize_matmul_mlir(spec)
            ir.InsertionPoint(module.body).insert(ir.Operation.parse(text))
        return str(module), len(found)
