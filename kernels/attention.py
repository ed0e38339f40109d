"""Decode attention as one hand-written CPU dispatch per layer.

A decode step attends one query token per head over the cache it has just
written. Decomposed into aten ops, IREE runs that as three dispatches per
layer (scores, softmax, weighted sum of values), and its matmul-like
reductions over 3-4 query heads read the f16 cache far below the memory's
bandwidth, each dispatch adding the task system's own cost
(docs/architecture.md, "Decode attention on CPU targets").

The decode programs keep `foldline::cache_attention` and
`foldline::ring_decode_attention` as ops (backends/importer.py), which reach
MLIR as `torch.operator`; for CPU targets `expand_decode_attention_ops`
replaces each with a call to a dispatch written here (`stream.executable`,
vector dialect, called with `flow.dispatch`, as kernels/int8_decode.py).
One workgroup per (row, query head) reads its key/value head's cache slots
in order, 16 features per vector:

    keys [lo, hi): hi = min(pos + 1, L), lo = max(pos + 1 - W, 0) with a window W, else 0
    s[l] = scale * sum_d q[d] * k[l, d]      (scratch, with the running max m)
    p[l] = exp(s[l] - m), z = sum_l p[l]     (16 keys per vector)
    o[d] = (sum_l p[l] * v[l, d]) / z

which is the decomposed form's masked softmax: a masked key's exp(-1e30 - m)
is exactly 0 there, and here it is never visited. A ring holds exactly the
window after the step's write, and slot l is filled once l <= pos, so the
ring form is the same kernel with no window bound. The scores go through a
transient scratch result (rows x L floats), not a stack buffer: at L = 8192
it would exceed IREE's stack allocation limit.

GPU targets import the decomposed form instead (backends/build.py imports
the programs a second time for them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from iree.compiler import ir

from ..frontend.types import MLIR_ELEMENTS
from .mlir import (
    HARDWARE_FLOAT,
    FloatIsa,
    f32_bits,
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

OP_NAMES = ("torch.foldline.cache_attention", "torch.foldline.ring_decode_attention")
CACHE_TYPES = ("f16", "bf16", "f32")
LANES = 16  # features per vector (512 bits of f32)


class AttentionKernelError(SiteError):
    """A kept attention op this generator cannot express."""


@dataclass(frozen=True)
class DecodeAttentionShape:
    """Everything that shapes one kernel.

    slots: the cache's (or ring's) slot count S; length: the keys read, the first L <= S slots;
    window: W > 0 reads only positions above pos - W (a full cache of a sliding-window layer),
    0 reads every slot up to pos (a global layer, or a ring, which holds the window only).
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    slots: int
    length: int
    window: int
    kv_mapping: str  # "blocked" (head h reads kv h // rep) or "interleaved" (kv h % n_kv)
    cache_type: str  # "f16", "bf16" or "f32"
    scale: float
    q_type: str = "f32"  # the compute dtype of q and the output; the kernel works in f32

    @property
    def rows(self) -> int:
        return self.batch * self.q_heads

    @property
    def name(self) -> str:
        return (f"foldline_attn_b{self.batch}_h{self.q_heads}x{self.kv_heads}_d{self.head_dim}_s{self.slots}"
                f"_l{self.length}_w{self.window}_{self.kv_mapping[0]}_{self.cache_type}_sc{f32_bits(self.scale)}"
                + ("" if self.q_type == "f32" else f"_q{self.q_type}"))


def supports(s: DecodeAttentionShape) -> bool:
    """Whole vectors of features, whole head groups, a known cache type and mapping."""
    return (s.head_dim % LANES == 0 and s.q_heads % s.kv_heads == 0 and s.cache_type in CACHE_TYPES
            and s.q_type in CACHE_TYPES
            and s.kv_mapping in ("blocked", "interleaved") and 0 < s.length <= s.slots and s.window >= 0)








def _types(s: DecodeAttentionShape) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        "q": ((s.batch, s.q_heads, 1, s.head_dim), s.q_type),
        "kv": ((s.batch, s.kv_heads, s.slots, s.head_dim), s.cache_type),
        "pos": ((s.batch,), "i64"),
        "scratch": ((s.rows, s.length), "f32"),
    }


def _widen(elem: str, src: str, dst: str, isa: FloatIsa) -> list[str]:
    """`dst` = the vector `src` of `elem` as f32 (the products' widening of the stored dtype)."""
    if elem == "f32":
        return [f"{dst} = arith.addf {src}, %zf : vector<{LANES}xf32>"]  # folded away; keeps one name
    if elem == "f16":
        return widen_f16(src, dst, f"vector<{LANES}xf16>", isa)
    return [f"{dst} = arith.extf {src} : vector<{LANES}x{elem}> to vector<{LANES}xf32>"]


def decode_attention_executable(s: DecodeAttentionShape, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """The `stream.executable` for one shape: a workgroup per (row, query head), three passes over its keys."""
    if not supports(s):
        raise AttentionKernelError(f"no decode attention kernel for {s}")
    t = _types(s)
    chunks = s.head_dim // LANES
    rep = s.q_heads // s.kv_heads
    q_m, kv_m, pos_m, scr_m = (memref_type(*t[k]) for k in ("q", "kv", "pos", "scratch"))
    kv_vec = f"vector<{LANES}x{s.cache_type}>"
    vf = f"vector<{LANES}xf32>"
    offsets = [f"%d{c} = arith.constant {c * LANES} : index" for c in range(chunks)]
    kv_head = ("%kvh = arith.divui %h, %rep : index" if s.kv_mapping == "blocked"
               else "%kvh = arith.remui %h, %nkv : index")
    lo = ["%lo = arith.constant 0 : index"]
    if s.window:
        lo = [f"%win = arith.constant {s.window} : index",
              "%lo0 = arith.subi %p1, %win : index",
              "%lo = arith.maxsi %lo0, %c0 : index"]
    scores = []
    for c in range(chunks):
        scores += [f"  %kh{c} = vector.load %k[%b, %kvh, %l, %d{c}] : {kv_m}, {kv_vec}",
                   *[f"  {line}" for line in _widen(s.cache_type, f"%kh{c}", f"%kf{c}", isa)]]
    # two accumulator chains over the features, added at the end
    chain = {0: "%zf", 1: "%zf"}
    for c in range(chunks):
        scores += [f"  {line}" for line in multiply_add(f"%a{c}", f"%q{c}", f"%kf{c}", chain[c % 2], vf, isa)]
        chain[c % 2] = f"%a{c}"
    scores += [f"  %dot = arith.addf {chain[0]}, {chain[1]} : {vf}",
               f"  %sum = vector.reduction <add>, %dot : {vf} into f32",
               "  %sc = arith.mulf %sum, %scale : f32",
               f"  memref.store %sc, %scr[%wg, %l] : {scr_m}"]
    values = ["  %pr = memref.load %scr[%wg, %l] : " + scr_m,
              f"  %pbv = vector.broadcast %pr : f32 to {vf}"]
    for c in range(chunks):
        values += [f"  %vh{c} = vector.load %v[%b, %kvh, %l, %d{c}] : {kv_m}, {kv_vec}",
                   *[f"  {line}" for line in _widen(s.cache_type, f"%vh{c}", f"%vf{c}", isa)],
                   *[f"  {line}" for line in multiply_add(f"%n{c}", "%pbv", f"%vf{c}", f"%o{c}", vf, isa)]]
    values.append(f"  scf.yield {', '.join(f'%n{c}' for c in range(chunks))} : {', '.join([vf] * chunks)}")
    body = [
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%q = stream.binding.subspan %qb[%c0] : !stream.binding -> {q_m}",
        f"%k = stream.binding.subspan %kb[%c0] : !stream.binding -> {kv_m}",
        f"%v = stream.binding.subspan %vb[%c0] : !stream.binding -> {kv_m}",
        f"%sp = stream.binding.subspan %pb[%c0] : !stream.binding -> {pos_m}",
        f"%o = stream.binding.subspan %ob[%c0] : !stream.binding -> {q_m}",
        f"%scr = stream.binding.subspan %sb[%c0] : !stream.binding -> {scr_m}",
        "%wg = stream.dispatch.workgroup.id[0] : index",
        f"%nq = arith.constant {s.q_heads} : index",
        f"%nkv = arith.constant {s.kv_heads} : index",
        f"%rep = arith.constant {rep} : index",
        "%b = arith.divui %wg, %nq : index",
        "%h = arith.remui %wg, %nq : index",
        kv_head,
        f"%p64 = memref.load %sp[%b] : {pos_m}",
        "%p = arith.index_cast %p64 : i64 to index",
        "%p1 = arith.addi %p, %c1 : index",
        f"%len = arith.constant {s.length} : index",
        "%hi = arith.minsi %p1, %len : index",
        *lo,
        f"%scale = arith.constant 0x{f32_bits(s.scale).upper()} : f32",
        "%f0 = arith.constant 0.0 : f32",
        "%f1 = arith.constant 1.0 : f32",
        f"%zf = arith.constant dense<0.0> : {vf}",
        *offsets,
        *[line for c in range(chunks) for line in (
            f"%qs{c} = vector.load %q[%b, %h, %c0, %d{c}] : {q_m}, vector<{LANES}x{s.q_type}>",
            *_widen(s.q_type, f"%qs{c}", f"%q{c}", isa))],
        "scf.for %l = %lo to %hi step %c1 {",
        *scores,
        "}",
        # the max and the exponentials 16 keys at a time; lanes past hi are masked off
        f"%c{LANES} = arith.constant {LANES} : index",
        f"%ninfv = arith.constant dense<0xFF800000> : {vf}",
        f"%mv = scf.for %l = %lo to %hi step %c{LANES} iter_args(%mx = %ninfv) -> ({vf}) {{",
        "  %rem = arith.subi %hi, %l : index",
        f"  %mask = vector.create_mask %rem : vector<{LANES}xi1>",
        f"  %sv = vector.maskedload %scr[%wg, %l], %mask, %ninfv : {scr_m}, vector<{LANES}xi1>, {vf} into {vf}",
        f"  %mx2 = arith.maximumf %mx, %sv : {vf}",
        f"  scf.yield %mx2 : {vf}",
        "}",
        f"%m = vector.reduction <maximumf>, %mv : {vf} into f32",
        f"%mb = vector.broadcast %m : f32 to {vf}",
        f"%zv = scf.for %l = %lo to %hi step %c{LANES} iter_args(%zacc = %zf) -> ({vf}) {{",
        "  %rem = arith.subi %hi, %l : index",
        f"  %mask = vector.create_mask %rem : vector<{LANES}xi1>",
        f"  %sv = vector.maskedload %scr[%wg, %l], %mask, %mb : {scr_m}, vector<{LANES}xi1>, {vf} into {vf}",
        f"  %sm = arith.subf %sv, %mb : {vf}",
        f"  %e0 = math.exp %sm : {vf}",
        f"  %e = arith.select %mask, %e0, %zf : vector<{LANES}xi1>, {vf}",
        f"  vector.maskedstore %scr[%wg, %l], %mask, %e : {scr_m}, vector<{LANES}xi1>, {vf}",
        f"  %zacc2 = arith.addf %zacc, %e : {vf}",
        f"  scf.yield %zacc2 : {vf}",
        "}",
        f"%z = vector.reduction <add>, %zv : {vf} into f32",
        f"%acc:{chunks} = scf.for %l = %lo to %hi step %c1 iter_args("
        + ", ".join(f"%o{c} = %zf" for c in range(chunks)) + f") -> ({', '.join([vf] * chunks)}) {{",
        *values,
        "}",
        # no key (a row whose position is outside the cache) gives zeros, not 0/0
        "%pos_z = arith.cmpf ogt, %z, %f0 : f32",
        "%inv0 = arith.divf %f1, %z : f32",
        "%inv = arith.select %pos_z, %inv0, %f0 : f32",
        f"%invb = vector.broadcast %inv : f32 to {vf}",
        *[line for c in range(chunks) for line in (
            f"%r{c} = arith.mulf %acc#{c}, %invb : {vf}",
            *([] if s.q_type == "f32" else [f"%rn{c} = arith.truncf %r{c} : {vf} to vector<{LANES}x{s.q_type}>"]),
            f"vector.store %r{c if s.q_type == 'f32' else 'n' + str(c)}, %o[%b, %h, %c0, %d{c}] : {q_m}, "
            f"vector<{LANES}x{s.q_type}>")],
    ]
    bindings = [f"%{n}: !stream.binding" for n in ("qb", "kb", "vb", "pb", "ob", "sb")]
    return stream_executable(s.name, s.rows, bindings, body)


def decode_attention_function(s: DecodeAttentionShape) -> str:
    """The util.func @name(q, k, v, pos) -> out that a site calls: the dispatch, its scratch dropped."""
    t = _types(s)
    q_t, kv_t, pos_t, scr_t = (tensor_type(*t[k]) for k in ("q", "kv", "pos", "scratch"))
    return "\n".join([
        f"util.func private @{s.name}(%q: {q_t}, %k: {kv_t}, %v: {kv_t}, %pos: {pos_t}) -> {q_t} {{",
        f"  %out, %scratch = flow.dispatch @{s.name}_exe::@{s.name}(%q, %k, %v, %pos) "
        f": ({q_t}, {kv_t}, {kv_t}, {pos_t}) -> ({q_t}, {scr_t})",
        f"  util.return %out : {q_t}",
        "}",
    ])


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------






def shape_of(op: ir.Operation) -> DecodeAttentionShape:
    """The kernel shape of a kept cache_attention / ring_decode_attention op (one query token per row)."""
    q, k, v, _pos, window, scale, kv_mapping, length = op.operands
    if shape_and_type(v) != shape_and_type(k):
        raise AttentionKernelError(f"decode attention takes equal key and value caches; got {k.type}, {v.type}")
    name = ir.StringAttr(op.attributes["name"]).value.removesuffix(".default")
    shape = kernel_shape(*shape_and_type(q), *shape_and_type(k), ring=name.endswith("ring_decode_attention"),
                         window=int(constant(window)), scale=float(constant(scale)),
                         kv_mapping=str(constant(kv_mapping)), length=_length(length))
    if not supports(shape):
        raise AttentionKernelError(f"no decode attention kernel for {shape}")
    return shape


def _length(value: ir.Value) -> int:
    """The op's constant length, or 0 (every slot) for a symbolic one: the kernel stops at pos anyway."""
    return constant(value) if is_constant(value, "int") else 0


def kernel_shape(q_dims: tuple[int, ...], q_type: str, k_dims: tuple[int, ...], cache_type: str, *, ring: bool,
                 window: int, scale: float, kv_mapping: str, length: int) -> DecodeAttentionShape:
    """The kernel shape of one decode attention call, from its operands' geometry and constants."""
    (batch, q_heads, chunk, head_dim), (_, kv_heads, slots, _) = q_dims, k_dims
    if chunk != 1:
        raise AttentionKernelError(f"decode attention takes one query token per row; got q {q_dims}")
    if ring:  # the ring holds the window: every slot up to pos
        length, window = (length if 0 < length < slots else slots), 0
    else:
        length = min(length, slots) if length > 0 else slots
    return DecodeAttentionShape(batch, q_heads, kv_heads, head_dim, slots, length, window, kv_mapping,
                                cache_type, scale, q_type)


def covers(node: torch.fx.Node) -> bool:
    """Whether a kernel here covers an FX cache_attention / ring_decode_attention node (else: decomposed form)."""
    q, k, v, _pos, window, scale, kv_mapping, length = (*node.args, *(0,) * 8)[:8]  # `length` defaults to 0
    qv, kv, vv = q.meta["val"], k.meta["val"], v.meta["val"]
    if (tuple(kv.shape), kv.dtype) != (tuple(vv.shape), vv.dtype) or qv.dim() != 4 or kv.dim() != 4:
        return False
    if qv.dtype not in MLIR_ELEMENTS or kv.dtype not in MLIR_ELEMENTS:
        return False
    try:  # supports() then refuses element types the kernel has no form for
        shape = kernel_shape(tuple(qv.shape), MLIR_ELEMENTS[qv.dtype], tuple(kv.shape), MLIR_ELEMENTS[kv.dtype],
                             ring="ring_decode_attention" in str(node.target), window=int(window),
                             scale=float(scale), kv_mapping=str(kv_mapping),
                             length=length if isinstance(length, int) else 0)
    except AttentionKernelError:
        return False
    return supports(shape)


def expand_decode_attention_ops(mlir: str, float_isa: FloatIsa = HARDWARE_FLOAT) -> tuple[str, Counter[str]]:
    """Replace every kept decode attention op with a call to its hand-written dispatch (CPU targets),
    spelt for `float_isa`: the FMA and f16 conversion the target's CPU has (mlir.FloatIsa.of).

    Returns the new module text and how many sites took the kernel.
    """

    def plan(op: ir.Operation) -> KernelCall:
        s = shape_of(op)
        t = _types(s)

        def operands() -> list[ir.Value]:
            kv = tensor_type(*t["kv"])
            return [builtin_tensor(op.operands[0], tensor_type(*t["q"])), builtin_tensor(op.operands[1], kv),
                    builtin_tensor(op.operands[2], kv), builtin_tensor(op.operands[3], tensor_type(*t["pos"]))]

        return KernelCall(at=op, callee=s.name, operands=operands, result_type=tensor_type(*t["q"]), replaces=[op],
                          code=lambda: [decode_attention_executable(s, float_isa), decode_attention_function(s)],
                          kind="attention decode")

    return rewrite_sites(mlir, OP_NAMES, plan)
