"""Fused dequantize-matmul kernels for `foldline::qlinear`, generated as linalg per shape.

The importer keeps `foldline::qlinear` out of the aten decompositions, so it
reaches MLIR as `torch.operator "torch.foldline.qlinear"`. `expand_qlinear_ops`
replaces each one with a `util.call` to a generated `util.func` whose single
`linalg.generic` reads the narrow codes, dequantizes one element and
multiply-accumulates it in its body:

    q4 codes (i8 param [N, K/2]) -> expand [N, G, g/2] -> flow.tensor.bitcast -> i4 [N, G, g]
    y[m, n] += x[m, g, j] * (scale[n, g] * float(q[n, g, j]) (+ min[n, g]))

There is no separate dequantization op for IREE's dispatch formation to hoist
into an initializer or to materialise, so no float copy of a weight exists
anywhere in the program (tests/test_quant_compile.py checks the dispatches).
Why this form, measured with IREE 3.13 on this machine:

- a dequant generic followed by a matmul is not fused by default
  (`--iree-dispatch-creation-block-matmul-producer-fusion`, on in 3.13): the
  dequant becomes a load-time initializer that writes an f32 copy of every
  weight; with the fusion forced it runs 5-17x slower than this kernel;
- nibble unpacking with shifts and masks in the torch graph is never fused;
  torch.uint4 does not import;
- dequantizing to [N, K] with a block-scale map `k floordiv g` stops the
  vectorizer.

On CPU the generic carries explicit tile sizes (one output row per vector
step, the reduction tiled by whole groups, 16 rows of x sharing each
dequantized vector when M > 1). The fused form does not lower to SPIR-V, so
Vulkan and CUDA get `portable_kernel_mlir`: a dequantization generic and a
matmul, which IREE may hoist into a load-time float copy of the weight. CPU modules are compiled with
`--iree-llvmcpu-reassociate-fp-reductions=true` (backends/targets.py): without
it each reduction is a chain of scalar adds and these kernels run 3.5-9x slower.
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


def _tiles(spec: QLinearSpec) -> tuple[list[int], list[int], list[int]]:
    """(distribution, vector_common_parallel, vector_reduction) for the CPU pipeline."""
    g = spec.groups
    gt = 2 if g % 2 == 0 else (3 if g % 3 == 0 else 1)
    rows = min(32, spec.n)
    if spec.m == 1:
        return [rows, 0, 0], [1, 0, 0], [0, gt, spec.group]
    # M > 1: up to 6 whole groups per reduction step (1.2-1.4x over one at M = 16; 18 groups of
    # 16 rows exceed IREE's stack limit).
    mt = min(spec.m, 16)
    gt = max(d for d in range(1, 7) if g % d == 0)
    return [mt, rows, 0, 0], [mt, 1, 0, 0], [0, 0, gt, spec.group]


def _compilation_info(spec: QLinearSpec) -> str:
    dist, par, red = _tiles(spec)
    return (f"#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {dist}, vector_common_parallel = {par}, vector_reduction = {red}>, "
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


def kernel_mlir(spec: QLinearSpec, cpu_tiles: bool) -> str:
    """The util.func computing qlinear for one shape: x [..., K] -> y [..., N]."""
    m, n, k, g, gs = spec.m, spec.n, spec.k, spec.groups, spec.group
    st = spec.scale_type
    x_t = f"tensor<{'x'.join(map(str, spec.x_shape))}xf32>"
    y_shape = (*spec.x_shape[:-1], n)
    y_t = f"tensor<{'x'.join(map(str, y_shape))}xf32>"
    codes_cols = k // 2 if spec.fmt == "q4" else k
    codes_t = f"tensor<{n}x{codes_cols}xi8>"
    sc_t = f"tensor<{n}x{g}x{st}>"
    lines = []
    if spec.fmt == "q4":
        lines.append(f"%c3 = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{n}, {g}, {gs // 2}] : "
                     f"{codes_t} into tensor<{n}x{g}x{gs // 2}xi8>")
        q_t = f"tensor<{n}x{g}x{gs}xi4>"
        lines.append(f"%qw = flow.tensor.bitcast %c3 : tensor<{n}x{g}x{gs // 2}xi8> -> {q_t}")
    else:
        q_t = f"tensor<{n}x{g}x{gs}xi8>"
        lines.append(f"%qw = tensor.expand_shape %codes [[0], [1, 2]] output_shape [{n}, {g}, {gs}] : "
                     f"{codes_t} into {q_t}")
    lead = len(spec.x_shape) - 1
    x2_t = f"tensor<{m}x{k}xf32>"
    if lead == 0:
        lines.append("%x2 = " + _reshape("expand", "%x", x_t, x2_t, [[0, 1]], [1, k]))
    elif lead == 1:
        lines.append(f"%x2 = tensor.cast %x : {x_t} to {x2_t}")
    else:
        lines.append("%x2 = " + _reshape("collapse", "%x", x_t, x2_t, [list(range(lead)), [lead]], []))
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    if m == 1:
        lines.append(f"%x3 = tensor.expand_shape %x2 [[0], [1, 2]] output_shape [1, {g}, {gs}] : "
                     f"tensor<1x{k}xf32> into tensor<1x{g}x{gs}xf32>")
        lines.append(f"%xv = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<1x{g}x{gs}xf32> into "
                     f"tensor<{g}x{gs}xf32>")
        xv_t, out_t = f"tensor<{g}x{gs}xf32>", f"tensor<{n}xf32>"
        maps = (["affine_map<(d0, d1, d2) -> (d1, d2)>", "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"]
                + ["affine_map<(d0, d1, d2) -> (d0, d1)>"] * len(scale_ins) + ["affine_map<(d0, d1, d2) -> (d0)>"])
        iters = '"parallel", "reduction", "reduction"'
    else:
        lines.append(f"%xv = tensor.expand_shape %x2 [[0], [1, 2]] output_shape [{m}, {g}, {gs}] : "
                     f"tensor<{m}x{k}xf32> into tensor<{m}x{g}x{gs}xf32>")
        xv_t, out_t = f"tensor<{m}x{g}x{gs}xf32>", f"tensor<{m}x{n}xf32>"
        maps = (["affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>", "affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>"]
                + ["affine_map<(d0, d1, d2, d3) -> (d1, d2)>"] * len(scale_ins)
                + ["affine_map<(d0, d1, d2, d3) -> (d0, d1)>"])
        iters = '"parallel", "parallel", "reduction", "reduction"'
    attr = f" attrs = {{compilation_info = {_compilation_info(spec)}}}" if cpu_tiles else ""
    bargs, deq, w = _body(spec)
    ins = ", ".join(["%xv", "%qw", *scale_ins])
    ins_t = ", ".join([xv_t, q_t, *([sc_t] * len(scale_ins))])
    lines += [
        "%zero = arith.constant 0.0 : f32",
        f"%empty = tensor.empty() : {out_t}",
        f"%init = linalg.fill ins(%zero : f32) outs(%empty : {out_t}) -> {out_t}",
        f"%acc = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{iters}]}}",
        f"    ins({ins} : {ins_t}) outs(%init : {out_t}){attr} {{",
        f"  ^bb0({bargs}, %out: f32):",
        *[f"      {line}" for line in deq],
        f"      %p = arith.mulf %a, {w} : f32",
        "      %r = arith.addf %out, %p : f32",
        "      linalg.yield %r : f32",
        f"}} -> {out_t}",
    ]
    y2_t = f"tensor<{m}x{n}xf32>"
    if m == 1:
        lines.append("%y2 = " + _reshape("expand", "%acc", out_t, y2_t, [[0, 1]], [1, n]))
    else:
        lines.append(f"%y2 = tensor.cast %acc : {out_t} to {y2_t}")
    if lead == 0:
        lines.append("%y = " + _reshape("collapse", "%y2", y2_t, y_t, [[0, 1]], []))
    elif lead == 1:
        lines.append(f"%y = tensor.cast %y2 : {y2_t} to {y_t}")
    else:
        lines.append("%y = " + _reshape("expand", "%y2", y2_t, y_t, [list(range(lead)), [lead]], list(y_shape)))
    params = [f"%x: {x_t}", f"%codes: {codes_t}", f"%scales: {sc_t}"] + ([f"%mins: {sc_t}"] if spec.has_min else [])
    body = "\n  ".join(lines)
    return f"util.func private @{spec.name}({', '.join(params)}) -> {y_t} {{\n  {body}\n  util.return %y : {y_t}\n}}"


def portable_kernel_mlir(spec: QLinearSpec) -> str:
    """For GPU targets: a dequantization generic to [N, K] followed by a matmul.

    The fused CPU form does not lower to SPIR-V (its vectors are CPU-sized);
    this one compiles for Vulkan and CUDA, and IREE may hoist the
    dequantization to load time (a float copy of the weight on the device).
    """
    m, n, k, g, gs = spec.m, spec.n, spec.k, spec.groups, spec.group
    st = spec.scale_type
    x_t = f"tensor<{'x'.join(map(str, spec.x_shape))}xf32>"
    y_shape = (*spec.x_shape[:-1], n)
    y_t = f"tensor<{'x'.join(map(str, y_shape))}xf32>"
    codes_t = f"tensor<{n}x{k // 2 if spec.fmt == 'q4' else k}xi8>"
    sc_t = f"tensor<{n}x{g}x{st}>"
    lines = []
    if spec.fmt == "q4":
        lines.append("%c3 = " + _reshape("expand", "%codes", codes_t, f"tensor<{n}x{g}x{gs // 2}xi8>",
                                         [[0], [1, 2]], [n, g, gs // 2]))
        q_t = f"tensor<{n}x{g}x{gs}xi4>"
        lines.append(f"%qw = flow.tensor.bitcast %c3 : tensor<{n}x{g}x{gs // 2}xi8> -> {q_t}")
    else:
        q_t = f"tensor<{n}x{g}x{gs}xi8>"
        lines.append("%qw = " + _reshape("expand", "%codes", codes_t, q_t, [[0], [1, 2]], [n, g, gs]))
    scale_ins = ["%scales"] + (["%mins"] if spec.has_min else [])
    w3_t = f"tensor<{n}x{g}x{gs}xf32>"
    bargs, deq, w = _body(spec)
    bargs = bargs.replace("%a: f32, ", "")
    maps = ["affine_map<(d0, d1, d2) -> (d0, d1, d2)>"] + ["affine_map<(d0, d1, d2) -> (d0, d1)>"] * len(
        scale_ins) + ["affine_map<(d0, d1, d2) -> (d0, d1, d2)>"]
    lines += [
        f"%wempty = tensor.empty() : {w3_t}",
        f"%w3 = linalg.generic {{indexing_maps = [{', '.join(maps)}], "
        f"iterator_types = [\"parallel\", \"parallel\", \"parallel\"]}}",
        f"    ins({', '.join(['%qw', *scale_ins])} : {', '.join([q_t, *([sc_t] * len(scale_ins))])}) "
        f"outs(%wempty : {w3_t}) {{",
        f"  ^bb0({bargs}, %o: f32):",
        *[f"      {line}" for line in deq],
        f"      linalg.yield {w} : f32",
        f"}} -> {w3_t}",
        "%w = " + _reshape("collapse", "%w3", w3_t, f"tensor<{n}x{k}xf32>", [[0], [1, 2]], []),
    ]
    lead = len(spec.x_shape) - 1
    x2_t, y2_t = f"tensor<{m}x{k}xf32>", f"tensor<{m}x{n}xf32>"
    if lead == 0:
        lines.append("%x2 = " + _reshape("expand", "%x", x_t, x2_t, [[0, 1]], [1, k]))
    elif lead == 1:
        lines.append(f"%x2 = tensor.cast %x : {x_t} to {x2_t}")
    else:
        lines.append("%x2 = " + _reshape("collapse", "%x", x_t, x2_t, [list(range(lead)), [lead]], []))
    lines += [
        "%zero = arith.constant 0.0 : f32",
        f"%yempty = tensor.empty() : {y2_t}",
        f"%yfill = linalg.fill ins(%zero : f32) outs(%yempty : {y2_t}) -> {y2_t}",
        "%y2 = linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, "
        "affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]",
        f"    ins(%x2, %w : {x2_t}, tensor<{n}x{k}xf32>) outs(%yfill : {y2_t}) -> {y2_t}",
    ]
    if lead == 0:
        lines.append("%y = " + _reshape("collapse", "%y2", y2_t, y_t, [[0, 1]], []))
    elif lead == 1:
        lines.append(f"%y = tensor.cast %y2 : {y2_t} to {y_t}")
    else:
        lines.append("%y = " + _reshape("expand", "%y2", y2_t, y_t, [list(range(lead)), [lead]], list(y_shape)))
    params = [f"%x: {x_t}", f"%codes: {codes_t}", f"%scales: {sc_t}"] + ([f"%mins: {sc_t}"] if spec.has_min else [])
    body = "\n  ".join(lines)
    return f"util.func private @{spec.name}({', '.join(params)}) -> {y_t} {{\n  {body}\n  util.return %y : {y_t}\n}}"


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

    cpu_tiles: the fused, tiled CPU kernel; otherwise the portable GPU form.

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
                x_t = f"tensor<{'x'.join(map(str, spec.x_shape))}xf32>"
                codes_t = f"tensor<{spec.n}x{spec.k // 2 if spec.fmt == 'q4' else spec.k}xi8>"
                sc_t = f"tensor<{spec.n}x{spec.groups}x{spec.scale_type}>"
                operands = [_builtin(x, x_t), _builtin(codes, codes_t), _builtin(scales, sc_t)]
                if spec.has_min:
                    operands.append(_builtin(mins, sc_t))
                y_shape = (*spec.x_shape[:-1], spec.n)
                call = ir.Operation.create(
                    "util.call", results=[ir.Type.parse(f"tensor<{'x'.join(map(str, y_shape))}xf32>")],
                    operands=operands, attributes={"callee": ir.FlatSymbolRefAttr.get(spec.name)})
                back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type],
                                           operands=[call.result])
            op.results[0].replace_all_uses_with(back.result)
            op.erase()
            kernels[spec.name] = spec
        for spec in kernels.values():
            text = kernel_mlir(spec, cpu_tiles=True) if cpu_tiles else portable_kernel_mlir(spec)
            ir.InsertionPoint(module.body).insert(ir.Operation.parse(text))
        return str(module), len(found)
